"""A switch's effect on generation speed, measured in pairs within one process: the same generator built with an
environment switch on, then off, then on again, ..., each running the same wave of prompts.

Why in one process and in pairs: on a shared host the memory bandwidth moves by a third within minutes
(bench/RESULTS.md), so two runs of bench/generate.py minutes apart differ by more than most changes to a decode
step; alternating the two settings wave by wave puts both under the same swings, and the medians of the pairs
compare them. Each generator is built fresh (the switch is read when a session or a stage is built), runs one
warm-up wave (TorchScript's profiling runs, the kernel choice), then the timed wave: C prompts of --prompt-tokens
ids, --new-tokens each, all submitted at once; tokens/s is the generated tokens over the wave's wall time.

    python bench/paired_switch.py --switch LIBPIPE_RUN_ALONE [--values 1 0] [--stages 2 | --split-at P]
                                  [--dtype bf16] [--concurrency 1] [--prompt-tokens 16] [--new-tokens 128]
                                  [--repeats 5] [--model llama1b|DIR]

Run with the project's virtualenv python after scripts/build.sh and `ctest -R bindings_stage` (the binding's
native module), or with libpipe installed; SmolLM2-135M-Instruct by default (bench/generate.py's model).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate as gen_bench  # noqa: E402  (the models, the skeleton export, the machine line)


def timed_wave(generator, prompts, new_tokens):
    start = time.perf_counter()
    generations = [generator.generate(p, max_new_tokens=new_tokens) for p in prompts]
    for g in generations:
        list(g)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", required=True, help="the environment variable to set for each generator")
    ap.add_argument("--values", nargs="+", default=["1", "0"], help="its values, measured in turn")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--split-at", action="append", default=[])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), llama1b or a Hugging Face folder")
    args = ap.parse_args()

    from libpipe import Generator

    folder = gen_bench.model_folder(args.model)
    weights = gen_bench.checkpoint(folder)
    print(f"machine: {gen_bench.machine()}")
    c = args.concurrency
    prompts = [[10 + 7 * i + row for i in range(args.prompt_tokens)] for row in range(c)]
    cut = {"split_at": args.split_at} if args.split_at else {"stages": args.stages}
    rates = {v: [] for v in args.values}
    with tempfile.TemporaryDirectory() as work:
        skeleton = os.path.join(work, "skeleton.pt")
        gen_bench.export_skeleton(folder, skeleton, args.prompt_tokens + args.new_tokens + 8, c, dtype=args.dtype)
        for _ in range(args.repeats):
            for v in args.values:
                os.environ[args.switch] = v
                with Generator(skeleton, weights=weights, dtype={"bf16": "bfloat16"}.get(args.dtype), **cut) as g:
                    timed_wave(g, prompts, args.new_tokens)  # warm-up
                    rates[v].append(timed_wave(g, prompts, args.new_tokens))
                print(f"{args.switch}={v}: {rates[v][-1]:.1f} tokens/s", flush=True)
    print(f"\n{args.switch}, {args.dtype}, {c} sequence(s), {cut}, medians of {args.repeats} (tokens/s):")
    for v in args.values:
        print(f"  {v}: {statistics.median(rates[v]):.1f} (min {min(rates[v]):.1f}, max {max(rates[v]):.1f})")


if __name__ == "__main__":
    main()
