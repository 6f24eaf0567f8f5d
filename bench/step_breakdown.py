"""Where a generation step's time goes: a per-step breakdown from libpipe's own trace.

For each C (default 1 and 32) the llama.cpp comparison's workload (bench/generate.py --reference
llamacpp: C prompts of --prompt-tokens chat tokens, all submitted at once, --new-tokens each, no
stop) runs through the Python binding's Generator on SmolLM2-135M-Instruct (float32, or --dtype bf16), after a
warm-up wave of the same prompts. Two traced waves follow:
- one with pipe_session_trace_start_with_operators: each stage's slice holds the time its thread
  spent per operator (RecordFunction; a linear layer's with its weight's shape), and the engine's
  track holds each step's launch (planning, building the inputs, submitting), collect (from the
  last stage's end to the scheduler picking the step up), sample and deliver;
- one with the plain trace, which gives the step's timeline without the operators' observer (it
  costs about a microsecond per operator): the times per stage and the hand-overs come from it.

A step is joined across the tracks by its request id. Decode steps (no prompt row) are summarised
per step: the engine's launch, the wait for stage 0, each stage's compute, each hand-over between
stages (split into waiting for the next stage to finish its previous step, and the hand-over
itself), the collect, sampling; and per stage, from the operator trace, its compute by kind:
linear layers (attention projections and MLP), the language-model head (the linear layer whose
output is the vocabulary), attention (pipe::cache_attention, or scaled_dot_product_attention where
it is not rewritten), cache gather (index_select of the rows' slots, gone where it is), cache write (nonzero, index, index_put_: write_cache; pipe::cache_write_), everything else (norms,
rotary, element-wise, embedding) and the interpreter (the slice beyond its operators' sum). Also
the stages' busy fractions over the wave and tokens/s of the plain wave.

    python bench/step_breakdown.py [--concurrency 1 32] [--dtype fp32|bf16] [--quantize int8|int4]
                                   [--prompt-tokens 128] [--new-tokens 64]
                                   [--split-at model.layers.16:begin] [--trace DIR] [--out FILE]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/build.sh
and `ctest -R bindings_stage` (the binding's native module), or with libpipe installed.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate as gen_bench  # noqa: E402  (the workload, the model, the skeleton export)


def wave(generator, prompts, new_tokens):
    """All prompts at once, each --new-tokens long; returns the wall time."""
    done = generator.stats()["sequences_finished"] + len(prompts)
    start = time.perf_counter()
    gens = [generator.generate(p, max_new_tokens=new_tokens) for p in prompts]
    limit = time.monotonic() + 900
    while generator.stats()["sequences_finished"] < done:
        if time.monotonic() > limit:
            sys.exit("step_breakdown.py: the generations did not finish within 900 s")
        time.sleep(0.002)
    wall = time.perf_counter() - start
    for g in gens:
        g.close()
    return wall


def traced_wave(generator, prompts, new_tokens, operators, path):
    session = generator.session
    before = session.stats()
    session.trace_start(operators=operators)
    wall = wave(generator, prompts, new_tokens)
    session.trace_stop(path)
    after = session.stats()
    with open(path) as f:
        trace = json.load(f)
    busy = [(a["busy_ms"] - b["busy_ms"]) / (wall * 1000) for a, b in zip(after, before)]
    return trace, wall, busy


def steps_of(trace, stages):
    """{request: {"launch": ev, "collect": ev, "sample": ev, "stages": [ev per stage]}}"""
    names = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    steps, by_step = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        track = names.get(e["tid"], "")
        if track.startswith("stage "):
            steps.setdefault(e["args"]["request"], {}).setdefault("stages", {})[int(track[6:])] = e
        elif e["name"].startswith("launch step"):
            steps.setdefault(e["args"]["request"], {})["launch"] = e
            by_step[e["args"]["step"]] = e["args"]["request"]
        elif e["name"].startswith("collect step"):
            steps.setdefault(e["args"]["request"], {})["collect"] = e
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"].startswith("sample step") and e["args"]["step"] in by_step:
            steps[by_step[e["args"]["step"]]]["sample"] = e
    complete = {}
    for r, s in steps.items():
        if "launch" in s and "collect" in s and len(s.get("stages", {})) == stages:
            s["stages"] = [s["stages"][k] for k in range(stages)]
            complete[r] = s
    return complete


def end(e):
    return e["ts"] + e["dur"]


def timeline(trace, stages):
    """Per decode step, in ms: launch (planning, inputs, submit, until stage 0 starts; a wait for stage 0 apart),
    stage compute, waits and hand-overs between stages, collect, sample, and the step's latency."""
    steps = steps_of(trace, stages)
    stage_spans = [sorted((s["stages"][k]["ts"], end(s["stages"][k])) for s in steps.values()) for k in range(stages)]
    rows = []
    for s in steps.values():
        if s["launch"]["args"]["prompt_rows"] > 0:
            continue
        st = s["stages"]
        # Planning, building the inputs and submitting, until stage 0 starts (it may start before the submit
        # returns), and the wait for stage 0 to finish an earlier step.
        row = {"rows": s["launch"]["args"]["rows"]}
        free0 = max([e for b, e in stage_spans[0] if e <= st[0]["ts"]], default=0)
        row["wait for stage 0"] = max(0, min(free0, st[0]["ts"]) - s["launch"]["ts"])
        row["launch"] = st[0]["ts"] - s["launch"]["ts"] - row["wait for stage 0"]
        for k in range(stages):
            row[f"stage {k}"] = st[k]["dur"]
            if k + 1 < stages:
                gap = st[k + 1]["ts"] - end(st[k])
                # The next stage was still busy with an earlier step until `free`.
                free = max([e for b, e in stage_spans[k + 1] if e <= st[k + 1]["ts"]], default=0)
                waiting = max(0, min(free, st[k + 1]["ts"]) - end(st[k]))
                row[f"wait {k}->{k + 1}"] = waiting
                row[f"hand-over {k}->{k + 1}"] = gap - waiting
        row["collect"] = s["collect"]["ts"] + s["collect"]["dur"] - end(st[-1])
        row["sample"] = s["sample"]["dur"] if "sample" in s else 0
        row["latency"] = (end(s["sample"]) if "sample" in s else end(s["collect"])) - s["launch"]["ts"]
        rows.append(row)
    return rows


def kind(op, vocab):
    name = op.split(" [")[0]
    if name == "aten::linear" or name.startswith("pipe::panel_linear"):  # grouped and int8 ones too
        return "LM head" if f"[{vocab}x" in op else "linear layers"  # out x in: the head's out is the vocabulary
    if name in ("aten::scaled_dot_product_attention", "pipe::cache_attention"):
        return "attention"
    if name == "aten::index_select":
        return "cache gather"
    if name in ("aten::index_put_", "aten::nonzero", "aten::index", "aten::unbind", "pipe::cache_write_"):
        return "cache write"
    return "other operators"


KINDS = [
    "linear layers",
    "LM head",
    "attention",
    "cache gather",
    "cache write",
    "other operators",
    "interpreter",
]


def operator_breakdown(trace, stages, vocab):
    """Per stage, mean ms per decode step by kind, and the top operators."""
    steps = steps_of(trace, stages)
    per_stage = []
    for k in range(stages):
        sums = {kd: 0.0 for kd in KINDS}
        ops = {}
        n = 0
        for s in steps.values():
            if s["launch"]["args"]["prompt_rows"] > 0:
                continue
            ev = s["stages"][k]
            timed = ev["args"].get("operators_us", {})
            for op, us in timed.items():
                sums[kind(op, vocab)] += us
                ops[op] = ops.get(op, 0.0) + us
            sums["interpreter"] += max(0.0, ev["dur"] - sum(timed.values()))
            n += 1
        n = max(n, 1)
        per_stage.append(
            {
                "ms_per_step": {kd: v / n / 1000 for kd, v in sums.items()},
                "total_ms_per_step": sum(sums.values()) / n / 1000,
                "top_operators_ms": {op: us / n / 1000 for op, us in sorted(ops.items(), key=lambda x: -x[1])[:40]},
            }
        )
    return per_stage


def mean_row(rows):
    keys = rows[0].keys() if rows else []
    return {k: statistics.fmean(r[k] for r in rows) / (1 if k == "rows" else 1000) for k in keys}


def run_one(Generator, folder, weights, tokenizer, c, args, work):
    prompts = gen_bench.fixed_prompts(tokenizer, c, args.prompt_tokens)
    max_len = args.prompt_tokens + args.new_tokens + 8
    skeleton = os.path.join(work, f"smollm2-{args.dtype}-{c}slots-{max_len}.pt")
    if not os.path.exists(skeleton):
        gen_bench.export_skeleton(folder, skeleton, max_len, c, dtype=args.dtype)
    cut = {"split_at": args.split_at} if args.split_at else {"stages": args.stages}
    # A bf16 skeleton takes the checkpoint's float32 weights cast at load, as `pipe generate --dtype bf16` does.
    dtype = {"bf16": "bfloat16"}.get(args.dtype)
    # --quantize: the float32 skeleton's linear layers stored as 8- or 4-bit codes at load (bench/generate.py's int8 and
    # int4 rows).
    with Generator(skeleton, weights=weights, dtype=dtype, quantize=args.quantize, **cut) as g:
        stages = g.session.num_stages
        vocab = g.info.vocab
        wave(g, prompts, args.new_tokens)  # warm-up: TorchScript's profiling runs, the allocator
        ops_path = os.path.join(args.trace or work, f"trace-ops-C{c}.json")
        plain_path = os.path.join(args.trace or work, f"trace-C{c}.json")
        ops_trace, ops_wall, _ = traced_wave(g, prompts, args.new_tokens, True, ops_path)
        trace, wall, busy = traced_wave(g, prompts, args.new_tokens, False, plain_path)
    plain_rows, ops_rows = timeline(trace, stages), timeline(ops_trace, stages)
    return {
        "concurrency": c,
        "stages": stages,
        "decode_steps": len(plain_rows),
        "tokens_per_s": c * args.new_tokens / wall,
        "tokens_per_s_with_operator_timing": c * args.new_tokens / ops_wall,
        "busy": busy,
        "per_decode_step_ms": mean_row(plain_rows),
        "per_decode_step_ms_with_operator_timing": mean_row(ops_rows),
        "stages_by_kind": operator_breakdown(ops_trace, stages, vocab),
    }


def print_result(r):
    step = r["per_decode_step_ms"]
    print(
        f"\nC = {r['concurrency']}: {r['tokens_per_s']:.1f} tokens/s (with operator timing "
        f"{r['tokens_per_s_with_operator_timing']:.1f}), {r['decode_steps']} decode steps of "
        f"{step['rows']:.1f} rows, stages busy {' / '.join(f'{b:.0%}' for b in r['busy'])}"
    )
    print("| per decode step | ms |\n| --- | --- |")
    for k, v in step.items():
        if k != "rows":
            print(f"| {k} | {v:.2f} |")
    for k, st in enumerate(r["stages_by_kind"]):
        print(f"\nstage {k} by kind (operator-timed wave), {st['total_ms_per_step']:.2f} ms per decode step:")
        print("| kind | ms | share |\n| --- | --- | --- |")
        for kd, v in st["ms_per_step"].items():
            print(f"| {kd} | {v:.2f} | {v / max(st['total_ms_per_step'], 1e-9):.0%} |")
        top = list(st["top_operators_ms"].items())[:12]
        print("top operators: " + ", ".join(f"{op} {ms:.2f}" for op, ms in top))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the skeleton's and the weights' dtype")
    ap.add_argument("--quantize", help="the linear layers' weights at load: int8, int4, int4:64 (with --dtype fp32)")
    ap.add_argument("--split-at", action="append", default=[])
    ap.add_argument("--trace", help="keep the traces (trace-C<C>.json, trace-ops-C<C>.json) in this folder")
    ap.add_argument("--out", help="also write the figures to this JSON file")
    args = ap.parse_args()

    from smollm2 import smollm2_folder
    from transformers import AutoTokenizer

    Generator = gen_bench.binding_generator()
    if Generator is None:
        sys.exit("step_breakdown.py: needs the Python binding's native module (ctest -R bindings_stage)")
    folder = smollm2_folder()
    weights = os.path.join(folder, "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    results = {"machine": gen_bench.machine(), "load_average_before": os.getloadavg(), "argv": sys.argv[1:]}
    print(f"machine: {results['machine']}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as work:
        results["runs"] = [run_one(Generator, folder, weights, tokenizer, c, args, work) for c in args.concurrency]
    results["load_average_after"] = os.getloadavg()
    for r in results["runs"]:
        print_result(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
