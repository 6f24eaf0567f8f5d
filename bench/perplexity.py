"""Perplexity of libpipe's weights at each precision (fp32, int8, int4), beside llama.cpp's `llama-perplexity` on
the same text at the same bits (F32, Q8_0, Q4_0 GGUFs of the same weights): what 8- and 4-bit weights cost in
quality.

The text is fixed: docs/DESIGN.md as it was at commit TEXT_COMMIT (English prose and some code, in this
repository's licence), read with `git show`. Both sides score it as llama-perplexity does: the tokens are cut into
--chunks chunks of --ctx tokens (default 8 x 512, from the start), each chunk is one sequence, and only the
predictions of its second half count (each of tokens ctx/2 + 1 .. ctx - 1 given all tokens before it in its
chunk), so that every scored token has at least ctx/2 tokens of context. Perplexity is exp of the mean negative
log-likelihood of the scored tokens; the +/- is its standard error (as llama-perplexity prints).

libpipe: the model exported once as a float32 skeleton (libpipe.export_llm), a libpipe.Generator at each
precision (int8 and int4: `quantize=`, activations in float32) cut with --split-at or --stages, every chunk
submitted at once with prompt_logprobs=True (each prompt token's log-probability given those before it, computed
by libpipe's own kernels and caches, one token a step) and max_new_tokens=1. Tokens: libpipe's own tokenizer
(libpipe.text) on the model folder. llama.cpp: `llama-perplexity -f TEXT -c CTX --chunks N -b CTX` with its
GGUF's tokenizer (the token counts are printed: they agree for SmolLM2).

    python bench/perplexity.py [--model smollm2|llama1b|DIR] [--dtype fp32 int8 int4] [--reference llamacpp]
                               [--ctx 512] [--chunks 8] [--split-at POINT | --stages 2] [--threads T] [--json OUT]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/test.sh (or ctest's
bindings_python), which installs the Python binding into it. The first run with llama.cpp builds
llama-perplexity (bench/llamacpp.py).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "models")]

from generate import GGUF_TYPES, checkpoint, machine, model_folder  # noqa: E402

TEXT_COMMIT = "2a09177"
TEXT_PATH = "docs/DESIGN.md"


def fixed_text():
    """The benchmark's text: TEXT_PATH at TEXT_COMMIT (never the working tree's, which changes)."""
    r = subprocess.run(
        ["git", "-C", ROOT, "show", f"{TEXT_COMMIT}:{TEXT_PATH}"], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        sys.exit(f"perplexity.py: cannot read {TEXT_PATH} at {TEXT_COMMIT} (a git checkout is needed): {r.stderr}")
    return r.stdout


def chunks_of(ids, ctx, count):
    if len(ids) < ctx * count:
        sys.exit(f"perplexity.py: the text has {len(ids)} tokens, fewer than {count} chunks of {ctx}")
    return [ids[i * ctx : (i + 1) * ctx] for i in range(count)]


def perplexity(nlls):
    """(perplexity, its standard error) from the scored tokens' negative log-likelihoods, as llama-perplexity
    computes them (the error of the mean NLL carried through exp)."""
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum((x - mean) ** 2 for x in nlls) / (n - 1)
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / n)


def libpipe_perplexity(folder, chunks, ctx, precision, cut, threads, work):
    import libpipe
    from libpipe.export_llm import export_llm

    skeleton = os.path.join(work, f"skeleton-{ctx}-{len(chunks)}.pt")
    if not os.path.exists(skeleton):
        export_llm(folder, skeleton, max_seq_len=ctx + 8, max_batch=len(chunks))
    quantize = precision if precision in ("int8", "int4") else None
    start = time.perf_counter()
    with libpipe.Generator(
        skeleton, weights=checkpoint(folder), quantize=quantize, threads_per_stage=threads, **cut
    ) as generator:
        loaded = time.perf_counter()
        generations = [generator.generate(c, max_new_tokens=1, prompt_logprobs=True) for c in chunks]
        nlls = []
        for g in generations:
            g.wait()
            scored = g.prompt_logprobs
            nlls += [-scored[p].logprob for p in range(ctx // 2 + 1, ctx)]
        done = time.perf_counter()
    ppl, err = perplexity(nlls)
    return {
        "ppl": ppl,
        "error": err,
        "scored_tokens": len(nlls),
        "load_s": loaded - start,
        "score_s": done - loaded,
        "tokens_per_s": len(chunks) * ctx / (done - loaded),
    }


def llamacpp_perplexity(bin_dir, gguf, text_file, ctx, chunks, threads):
    cmd = [
        str(bin_dir / "llama-perplexity"),
        "-m",
        str(gguf),
        "-f",
        text_file,
        "-c",
        str(ctx),
        "-b",
        str(ctx),
        "--chunks",
        str(chunks),
        "-t",
        str(threads),
    ]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"perplexity.py: `{' '.join(cmd)}` failed ({r.returncode}):\n{r.stderr[-4000:]}")
    out = r.stdout + r.stderr
    final = [line for line in out.splitlines() if "Final estimate: PPL =" in line]
    if not final:
        sys.exit(f"perplexity.py: llama-perplexity printed no final estimate:\n{out[-4000:]}")
    words = final[-1].split("PPL =", 1)[1].split()
    tokens = [line for line in out.splitlines() if "tokenization took" in line or "tokenizing the input" in line]
    return {"ppl": float(words[0]), "error": float(words[2]), "seconds": took, "log": tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    parser.add_argument("--reference", nargs="*", default=["llamacpp"], choices=["llamacpp"])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--split-at", action="append")
    parser.add_argument("--stages", type=int)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    parser.add_argument("--threads-per-stage", type=int, default=0)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    import libpipe

    folder = model_folder(args.model)
    text = fixed_text()
    tokenizer = libpipe.Tokenizer.load(folder)
    ids = tokenizer.encode(text)
    chunks = chunks_of(ids, args.ctx, args.chunks)
    cut = {"split_at": args.split_at} if args.split_at else {"stages": args.stages or 2}
    print(f"machine: {machine()}", flush=True)
    print(
        f"text: {TEXT_PATH} at {TEXT_COMMIT}, {len(ids)} tokens (libpipe's tokenizer); {args.chunks} chunks of "
        f"{args.ctx}, {args.chunks * (args.ctx - args.ctx // 2 - 1)} tokens scored; model {folder}",
        flush=True,
    )
    result = {"machine": machine(), "model": str(folder), "ctx": args.ctx, "chunks": args.chunks, "libpipe": {}}
    with tempfile.TemporaryDirectory() as work:
        for precision in args.dtype:
            r = libpipe_perplexity(folder, chunks, args.ctx, precision, cut, args.threads_per_stage, work)
            result["libpipe"][precision] = r
            print(
                f"libpipe {precision}: PPL {r['ppl']:.4f} +/- {r['error']:.4f} ({r['scored_tokens']} tokens scored, "
                f"{r['tokens_per_s']:.0f} prompt tokens/s)",
                flush=True,
            )
        if "llamacpp" in args.reference:
            import llamacpp
            from smollm2 import gguf_path

            bin_dir = llamacpp.build()
            if args.model == "smollm2":
                f32 = llamacpp.f32_gguf(bin_dir, gguf_path())
                models = {
                    d: f32 if d == "fp32" else llamacpp.converted_gguf(bin_dir, f32, GGUF_TYPES[d]) for d in args.dtype
                }
            else:
                f32 = llamacpp.hf_gguf(folder, "F32")
                models = {
                    d: f32 if d == "fp32" else llamacpp.converted_gguf(bin_dir, f32, GGUF_TYPES[d]) for d in args.dtype
                }
            text_file = os.path.join(work, "text.txt")
            with open(text_file, "w") as f:
                f.write(text)
            result["llamacpp"] = {}
            for precision, gguf in models.items():
                r = llamacpp_perplexity(bin_dir, gguf, text_file, args.ctx, args.chunks, args.threads)
                result["llamacpp"][precision] = {"gguf": os.path.basename(gguf), **r}
                print(
                    f"llama.cpp {GGUF_TYPES[precision]}: PPL {r['ppl']:.4f} +/- {r['error']:.4f} "
                    f"({'; '.join(r['log'])})",
                    flush=True,
                )
    base = result["libpipe"].get("fp32")
    print("\n| precision | libpipe PPL | vs libpipe fp32 | llama.cpp PPL | libpipe / llama.cpp |")
    print("| --- | --- | --- | --- | --- |")
    for precision, r in result["libpipe"].items():
        rel = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if base else "-"
        lc = result.get("llamacpp", {}).get(precision)
        lc_s = f"{lc['ppl']:.4f} ({GGUF_TYPES[precision]})" if lc else "-"
        ratio = f"{r['ppl'] / lc['ppl']:.4f}" if lc else "-"
        print(f"| {precision} | {r['ppl']:.4f} +/- {r['error']:.4f} | {rel} | {lc_s} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
