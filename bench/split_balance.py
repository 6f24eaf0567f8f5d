"""Split balance of the three policies on a 12-layer stack of unequal blocks.

Each block costs something different, and parameter bytes are a poor guide to time: some blocks
are wide Linear layers (many bytes, moderate time), others repeat a small Linear several times
(few bytes, much time). For 4 stages, each policy's plan is timed stage by stage on the same
example input by libpipe itself (`pipe split --input ... --json` reports estimated_ms per stage
and the balance sum(t) / (N * max t)); the median of several runs is reported.

    python bench/split_balance.py build/pipe [--stages 4] [--runs 5]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file


class Block(torch.nn.Module):
    def __init__(self, width, hidden, repeats):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)
        self.repeats = repeats

    def forward(self, x):
        h = self.up(x)
        for _ in range(self.repeats):  # unrolled by tracing: compute without extra parameters
            h = torch.tanh(h) * 0.5 + h
        return x + self.down(h)


# (hidden, repeats) per block: wide blocks carry bytes, repeated ones carry time; costs differ
# by up to about 5x from block to block.
STACKS = {
    # Heavy and light blocks mixed: equal layer counts land unevenly, a good cut exists.
    "mixed": [
        (1024, 3),
        (256, 1),
        (512, 6),
        (1024, 2),
        (256, 2),
        (256, 8),
        (1024, 1),
        (512, 1),
        (256, 6),
        (512, 3),
        (1024, 1),
        (512, 2),
    ],
    # The heaviest blocks first: the best cut between blocks is limited by the two heaviest
    # neighbours, whatever the policy.
    "front_heavy": [
        (1024, 3),
        (1024, 2),
        (1024, 1),
        (512, 6),
        (1024, 1),
        (512, 3),
        (512, 2),
        (256, 8),
        (512, 1),
        (256, 6),
        (256, 2),
        (256, 1),
    ],
}


class UnequalStack(torch.nn.Module):
    def __init__(self, specs, width=256):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(width, h, r) for h, r in specs)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def split_json(pipe, model, inputs, stages, policy):
    r = subprocess.run(
        [pipe, "split", model, "--stages", str(stages), "--policy", policy, "--input", inputs, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout)


def best_balance(costs, parts):
    """The best balance any cut between layers can reach, by trying them all."""
    best = 0.0
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        best = max(best, sum(sums) / (parts * max(sums)))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pipe")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"| stack | policy | balance (median of {args.runs}) | min | max | layers per stage |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as d:
        for name, specs in STACKS.items():
            torch.manual_seed(0)
            x = torch.randn(64, 256)
            model, inputs = os.path.join(d, f"{name}.pt"), os.path.join(d, "in.safetensors")
            torch.jit.trace(UnequalStack(specs).eval(), (x,)).save(model)
            save_file({"x": x}, inputs)
            for policy in ("uniform", "params", "time"):
                balances, layouts = [], []
                for _ in range(args.runs):
                    plan = split_json(args.pipe, model, inputs, args.stages, policy)
                    balances.append(plan["balance"])
                    layouts.append(tuple(len({p.split(".")[1] for p in s["parameters"]}) for s in plan["stages"]))
                print(
                    f"| {name} | {policy} | {statistics.median(balances):.3f} | {min(balances):.3f} | "
                    f"{max(balances):.3f} | {'/'.join(map(str, max(set(layouts), key=layouts.count)))} |"
                )
            # Per-layer times, measured the same way (one stage per layer), and the best cut they allow.
            per_layer = [
                s["estimated_ms"] for s in split_json(args.pipe, model, inputs, len(specs), "uniform")["stages"]
            ]
            print(
                f"| {name} | best cut between layers | {best_balance(per_layer, args.stages):.3f} | | | "
                f"layer ms: {' '.join(f'{t:.2f}' for t in per_layer)} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
