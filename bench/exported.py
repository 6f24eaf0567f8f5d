"""The same models from a torch.export program (.pt2) and from TorchScript, run by libpipe.

libpipe loads two formats: TorchScript (stages run by the TorchScript interpreter; on the CPU they
also get libpipe's packed-linear and cache-attention rewrites) and torch.export programs written by
`libpipe.export_program` (stages run by LibTorch's nativert, without those rewrites). This measures
what a user pays for choosing .pt2, on two models built here with the same weights in both forms:

  mlp    the scheduler benchmark's 2-stage MLP (bench/make_bench_models.py's MLP: 4 residual blocks
         Linear(1024→4096)-GELU-Linear(4096→1024), batch 256), cut at its pipe_split() marker between
         blocks 2 and 3 as bench/pipeline_bench.cpp cuts it (the marker survives in the .pt2)
  llama  a decoder: a random-weight Hugging Face LlamaForCausalLM returning its logits (4 layers,
         hidden 256, 4 heads, 2 KV heads, intermediate 512, vocab 1024, use_cache=False), batch 8 of
         64 tokens, cut at model.layers.2:begin (2 layers per stage); exported with dynamic batch and
         sequence length

TorchScript is torch.jit.trace of the model; .pt2 is libpipe.export_program. For each model:
- per-stage run time: `pipe split MODEL SPLIT --input IN --json` reports each stage's estimated_ms
  (the fastest of 15 timed runs of the stage alone, on its share of the cores' threads);
- throughput: `pipe bench MODEL SPLIT --input IN --requests R --concurrency 2 --microbatches 8
  --json` (the scheduler benchmark's setting: 2 callers, 8 micro-batches, adaptive) reports
  samples_per_s.
Each measurement runs --rounds times, the two formats alternately (the order flips every round,
so that a machine's drift hits both alike); the table gives each format's median (min–max), and two
ratios .pt2 / TorchScript: of the medians, and of the best rounds (the fastest time, the highest
throughput), which the verdict "within 1.3x" (time at most 1.3x, throughput at least 1/1.3) reads.
On a shared machine (a VM whose neighbours take its cores for seconds at a time) rounds come out
bimodal and the median can land on either mode for either format; the best round is the one least
disturbed, as a stage's estimate itself is the fastest of its 15 runs. Before timing, each form runs once through `pipe run` and its outputs are compared with
eager PyTorch's (max |difference|), and the run stops if the two forms' stages do not hold the same
parameters and buffers (the same cut).

    python bench/exported.py [--pipe build/pipe] [--rounds 5] [--requests 40] [--llama-requests 100]
                             [--models mlp llama] [--quick] [--work DIR] [--json FILE]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/build.sh,
on an otherwise idle machine. The machine (CPU model, cores, the instruction sets that matter:
avx2, avx512f, avx512_bf16, AMX) and the load average are printed first. --quick (2 rounds, 10 / 20
requests) is a smoke run of a minute or two whose figures are not for the record.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.append(os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # make_bench_models
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the Llama is built from a config

FORMATS = ("TorchScript", ".pt2")
EXT = {"TorchScript": ".pt", ".pt2": ".pt2"}
TARGET = 1.3  # .pt2 within 1.3x of TorchScript

# name -> the split arguments of every pipe command (the same for both formats).
SPLITS = {
    "mlp": [],  # the pipe_split() marker between blocks 2 and 3
    "llama": ["--split-at", "model.layers.2:begin"],
}
DESCRIPTION = {
    "mlp": "2-stage MLP (scheduler benchmark), batch 256",
    "llama": "Llama-shaped decoder, 4 layers / hidden 256, batch 8 x 64 tokens",
}


def cpu_info():
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def machine():
    model, flags = cpu_info()
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    have = " ".join(f if f in flags else f"no {f}" for f in wanted)
    return f"{model}, {os.cpu_count()} cores; {have}"


def build_mlp(work):
    """bench/make_bench_models.py's MLP with its marker: traced, and exported with export_program."""
    import torch
    from make_bench_models import MLP
    from safetensors.torch import save_file

    from libpipe import export_program

    torch.manual_seed(0)
    x = torch.randn(256, 1024)
    model = MLP().eval()
    with torch.no_grad():
        torch.jit.trace(model, (x,)).save(os.path.join(work, "mlp.pt"))
        expected = model(x)
    export_program(model, (x,), path=os.path.join(work, "mlp.pt2"))
    save_file({"x": x}, os.path.join(work, "mlp.inputs.safetensors"))
    return {"output": expected}


def build_llama(work):
    """A tiny random-weight LlamaForCausalLM returning logits: traced, and exported with dynamic
    batch and sequence length."""
    import torch
    from torch.export import Dim
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from libpipe import export_program
    from safetensors.torch import save_file

    class LlamaLogits(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    hf_logging.set_verbosity_error()
    config = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaLogits(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (8, 64))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's warnings about HF's Python branches
        torch.jit.trace(model, (input_ids,)).save(os.path.join(work, "llama.pt"))
        expected = model(input_ids)
    export_program(
        model, (input_ids,), dynamic_shapes={"input_ids": {1: Dim.DYNAMIC}}, path=os.path.join(work, "llama.pt2")
    )
    save_file({"input_ids": input_ids}, os.path.join(work, "llama.inputs.safetensors"))
    return {"output": expected}


BUILDERS = {"mlp": build_mlp, "llama": build_llama}


def pipe_cmd(pipe, args):
    r = subprocess.run([pipe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"exported.py: `pipe {' '.join(args)}` failed ({r.returncode}):\n{r.stderr.strip()}")
    return r.stdout


def pipe_json(pipe, args):
    out = pipe_cmd(pipe, args)
    # bench --json prints its object on one line; anything before it is not ours.
    return json.loads(out[out.index("{") :])


def check_outputs(pipe, work, name, expected):
    """Runs each form once and compares its outputs with eager PyTorch's: {format: max |diff|}."""
    from safetensors.torch import load_file

    inputs = os.path.join(work, f"{name}.inputs.safetensors")
    diffs = {}
    for fmt in FORMATS:
        out = os.path.join(work, f"{name}{EXT[fmt]}.out.safetensors")
        pipe_cmd(pipe, ["run", os.path.join(work, name + EXT[fmt]), *SPLITS[name], "--input", inputs, "--output", out])
        got = load_file(out)
        if set(got) != set(expected):
            sys.exit(f"exported.py: {name}{EXT[fmt]} wrote outputs {sorted(got)}, eager has {sorted(expected)}")
        diffs[fmt] = max((got[k] - expected[k]).abs().max().item() for k in expected)
    return diffs


def measure(pipe, work, name, rounds, requests):
    """Per-stage estimated_ms and bench samples_per_s of both forms, alternately, `rounds` times."""
    inputs = os.path.join(work, f"{name}.inputs.safetensors")
    runs = {fmt: {"stage_ms": [], "samples_per_s": [], "bench": []} for fmt in FORMATS}
    for r in range(rounds):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            model = os.path.join(work, name + EXT[fmt])
            plan = pipe_json(pipe, ["split", model, *SPLITS[name], "--input", inputs, "--json"])
            runs[fmt]["stage_ms"].append([s["estimated_ms"] for s in plan["stages"]])
            runs[fmt]["method"] = plan["method"]
            runs[fmt]["stage_parameters"] = [sorted(s["parameters"] + s["buffers"]) for s in plan["stages"]]
        for fmt in order:
            model = os.path.join(work, name + EXT[fmt])
            b = pipe_json(
                pipe,
                [
                    "bench",
                    model,
                    *SPLITS[name],
                    "--input",
                    inputs,
                    "--requests",
                    str(requests),
                    "--concurrency",
                    "2",
                    "--microbatches",
                    "8",
                    "--json",
                ],
            )
            runs[fmt]["samples_per_s"].append(b["samples_per_s"])
            runs[fmt]["bench"].append(b)
        print(
            f"{name} round {r + 1}/{rounds}: "
            + "; ".join(
                f"{fmt} stages {' / '.join(f'{t:.2f}' for t in runs[fmt]['stage_ms'][-1])} ms, "
                f"{runs[fmt]['samples_per_s'][-1]:.1f} samples/s"
                for fmt in FORMATS
            ),
            flush=True,
        )
    stages = {len(s) for fmt in FORMATS for s in runs[fmt]["stage_ms"]}
    if len(stages) != 1 or runs["TorchScript"]["stage_parameters"] != runs[".pt2"]["stage_parameters"]:
        sys.exit(
            f"exported.py: {name}: the two forms were cut differently ("
            + "; ".join(
                f"{fmt}: {runs[fmt]['method']}, {[len(p) for p in runs[fmt]['stage_parameters']]} parameters and buffers"
                for fmt in FORMATS
            )
            + ")"
        )
    return runs


def summarize(runs):
    """Table rows: (what, higher_is_better, {format: [values]})."""
    rows = []
    for k in range(len(runs["TorchScript"]["stage_ms"][0])):
        rows.append((f"stage {k} run time, ms", False, {fmt: [s[k] for s in runs[fmt]["stage_ms"]] for fmt in FORMATS}))
    rows.append(("throughput, samples/s", True, {fmt: runs[fmt]["samples_per_s"] for fmt in FORMATS}))
    out = []
    for what, higher, values in rows:
        med = {fmt: statistics.median(v) for fmt, v in values.items()}
        best = {fmt: (max if higher else min)(v) for fmt, v in values.items()}
        ratio = med[".pt2"] / med["TorchScript"]
        best_ratio = best[".pt2"] / best["TorchScript"]
        within = best_ratio >= 1 / TARGET if higher else best_ratio <= TARGET
        out.append(
            {
                "what": what,
                "values": values,
                "median": med,
                "ratio": ratio,
                "best": best,
                "best_ratio": best_ratio,
                "within": within,
            }
        )
    return out


def fmt_cell(values, median):
    digits = 1 if median >= 100 else 2
    return f"{median:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipe", default=os.path.join(ROOT, "build", "pipe"), help="the pipe CLI (default build/pipe)")
    ap.add_argument("--models", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    ap.add_argument("--rounds", type=int, help="alternating rounds of each measurement (default 5; --quick 2)")
    ap.add_argument("--requests", type=int, help="pipe bench --requests for the MLP (default 40; --quick 10)")
    ap.add_argument("--llama-requests", type=int, help="pipe bench --requests for the Llama (default 100; --quick 20)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds and requests")
    ap.add_argument("--work", help="folder for the models (default: a temporary one, removed afterwards)")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    requests = {
        "mlp": args.requests or (10 if args.quick else 40),
        "llama": args.llama_requests or (20 if args.quick else 100),
    }
    if not os.access(args.pipe, os.X_OK):
        sys.exit(f"exported.py: no pipe CLI at {args.pipe} (build it with scripts/build.sh, or pass --pipe)")

    started = time.monotonic()
    results = {
        "machine": machine(),
        "load_average_before": os.getloadavg(),
        "argv": sys.argv[1:],
        "rounds": rounds,
        "requests": {m: requests[m] for m in args.models},
        "models": {},
    }
    print(f"machine: {results['machine']}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    work = args.work or tempfile.mkdtemp(prefix="bench-exported-")
    os.makedirs(work, exist_ok=True)
    try:
        expected = {}
        for name in args.models:
            t = time.monotonic()
            expected[name] = BUILDERS[name](work)
            print(f"{name}: built {name}.pt and {name}.pt2 in {time.monotonic() - t:.1f} s", flush=True)
        for name in args.models:
            diffs = check_outputs(args.pipe, work, name, expected[name])
            print(
                f"{name}: max |pipe run - eager|: " + ", ".join(f"{fmt} {d:.3g}" for fmt, d in diffs.items()),
                flush=True,
            )
            runs = measure(args.pipe, work, name, rounds, requests[name])
            results["models"][name] = {"max_abs_diff": diffs, "runs": runs, "rows": summarize(runs)}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    results["seconds"] = time.monotonic() - started

    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {results['seconds']:.0f} s in all")
    print()
    print(f"machine: {results['machine']}")
    print()
    print(
        f"| model | measure (median of {rounds}, min–max) | TorchScript | .pt2 | .pt2 / TorchScript, medians "
        f"| .pt2 / TorchScript, best rounds | within {TARGET}x |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, m in results["models"].items():
        for row in m["rows"]:
            what = row["what"]
            if what.startswith("throughput"):
                what += f" ({requests[name]} requests, 2 callers, 8 micro-batches)"
            print(
                f"| {DESCRIPTION[name]} | {what} | "
                + " | ".join(fmt_cell(row["values"][fmt], row["median"][fmt]) for fmt in FORMATS)
                + f" | {row['ratio']:.3f} | {row['best_ratio']:.3f} | {'yes' if row['within'] else 'NO'} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
