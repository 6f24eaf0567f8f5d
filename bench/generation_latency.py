"""Latency of a wave of chat generations through the Python binding: tokens/s, time to first token,
inter-token gaps (p50, p99, longest) and the stages' busy fractions while the pipeline is full.

C chat prompts of SmolLM2-135M-Instruct (real user messages through the chat template, as
bench/generate.py makes them) are submitted at once to a libpipe.Generator (--split-at cut, C
cache slots, greedy, at most --max-new-tokens, stop at eos); a thread per generation records when
each token arrives. One warm-up wave, then the measured one, traced for the busy fractions
(generate.py's steady_state_busy).

--compare runs each configuration in its own process, alternating them for --rounds rounds (so a
drift in the machine's speed hits all), and prints every run and the medians per C and
configuration: `mixed` (the default: decode rows and prompt chunks share steps) against `one-kind`
(LIBPIPE_MIXED_STEPS=0: a step carries prompt chunks or decode rows, never both).

    python bench/generation_latency.py --compare [--concurrency 8 32] [--rounds 3] [--prefill-chunk N]
                                      [--split-at model.layers.17:begin] [--out FILE]

Run with the project's virtualenv python after scripts/build.sh, with the binding installed
(ctest's bindings_stage, or bindings/python/install.sh).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIGS = {"mixed": {}, "one-kind": {"LIBPIPE_MIXED_STEPS": "0"}}


def quantile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def one_run(args):
    """One measured wave in this process; prints one JSON line."""
    import generate
    import libpipe
    from smollm2 import smollm2_folder
    from transformers import AutoTokenizer

    folder = smollm2_folder()
    weights = os.path.join(folder, "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    c = args.concurrency[0]
    prompts = generate.chat_prompts(tokenizer, c)[:c]
    skeleton = os.path.join(args.work, f"smollm2-{c}slots-{args.max_len}.pt")
    if not os.path.exists(skeleton):
        generate.export_skeleton(folder, skeleton, args.max_len, c)
    options = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}
    with libpipe.Generator(skeleton, weights=weights, split_at=args.split_at, **options) as gen:

        def wave():
            gens = [gen.generate(p, max_new_tokens=args.max_new_tokens, stop_ids=[generate.EOS]) for p in prompts]
            start = time.perf_counter()
            arrivals = [[] for _ in gens]

            def read(i, g):
                for _ in g:
                    arrivals[i].append(time.perf_counter())

            threads = [threading.Thread(target=read, args=(i, g)) for i, g in enumerate(gens)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            for g in gens:
                g.close()
            return arrivals, start, wall

        wave()  # warm-up
        gen.session.trace_start()
        arrivals, start, wall = wave()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            gen.session.trace_stop(path)
            with open(path) as f:
                steady = generate.steady_state_busy(json.load(f), len(gen.session.stats()))
    first = [a[0] - start for a in arrivals if a]
    gaps = sorted(b - a for tokens in arrivals for a, b in zip(tokens, tokens[1:]))
    print(
        json.dumps(
            {
                "concurrency": c,
                "tokens_per_s": sum(map(len, arrivals)) / wall,
                "ttft_mean_ms": 1000 * statistics.mean(first),
                "ttft_max_ms": 1000 * max(first),
                "itl_p50_ms": 1000 * quantile(gaps, 0.5),
                "itl_p99_ms": 1000 * quantile(gaps, 0.99),
                "itl_max_ms": 1000 * gaps[-1],
                "busy_pipeline_full": steady[0] if steady else None,
            }
        ),
        flush=True,
    )


def compare(args):
    runs = []
    for r in range(args.rounds):
        for c in args.concurrency:
            for name, env in CONFIGS.items():
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--one-run",
                    "--concurrency",
                    str(c),
                    "--work",
                    args.work,
                ]
                cmd += ["--max-new-tokens", str(args.max_new_tokens), "--max-len", str(args.max_len)]
                cmd += ["--prefill-chunk", str(args.prefill_chunk)]
                for s in args.split_at:
                    cmd += ["--split-at", s]
                out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"generation_latency.py: a run failed:\n{out.stderr[-3000:]}")
                row = {"config": name, "round": r, **json.loads(out.stdout.strip().splitlines()[-1])}
                runs.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(
        "| sequences | steps | tokens/s | TTFT mean ms | TTFT max ms | ITL p50 ms | ITL p99 ms | ITL max ms | busy (pipeline full) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        for name in CONFIGS:
            rows = [x for x in runs if x["config"] == name and x["concurrency"] == c]
            med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k.endswith(("_s", "_ms"))}
            busy = [x["busy_pipeline_full"] for x in rows if x["busy_pipeline_full"]]
            busy_text = "; ".join(" / ".join(f"{100 * b:.0f}%" for b in x) for x in busy)
            print(
                f"| {c} | {name} | {med['tokens_per_s']:.1f} | {med['ttft_mean_ms']:.0f} | {med['ttft_max_ms']:.0f} | "
                f"{med['itl_p50_ms']:.0f} | {med['itl_p99_ms']:.0f} | {med['itl_max_ms']:.0f} | {busy_text} |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": runs}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", action="store_true", help="mixed steps against one kind of row per step")
    ap.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=320, help="cache positions per slot")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the generator's prefill_chunk (0: its default)")
    ap.add_argument("--split-at", action="append", default=None)
    ap.add_argument("--work", help="folder for the skeletons (default: a temporary one)")
    ap.add_argument("--out", help="also write every run to this JSON file")
    args = ap.parse_args()
    args.split_at = args.split_at or ["model.layers.17:begin"]
    if args.one_run:
        return one_run(args)
    work = args.work or tempfile.mkdtemp(prefix="bench-latency-")
    args.work = work
    if args.compare:
        return compare(args)
    args.concurrency = args.concurrency[:1]
    return one_run(args)


if __name__ == "__main__":
    sys.exit(main())
