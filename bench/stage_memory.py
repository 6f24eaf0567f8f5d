"""Peak memory of building one stage of a large model from a sharded checkpoint.

A model of 1.06 GiB of float32 weights (8 Linear(4096→8192) layers) is exported as a skeleton
plus a 4-shard safetensors checkpoint, and split into 4 stages by parameter bytes. For each stage,
a separate `pipe split ... --weights INDEX --save-stages DIR --stage K` process builds that stage
alone (loading only its tensors from the memory-mapped shards) and saves it; its peak resident
memory is compared with the stage's weight bytes. The fixed runtime overhead is the peak of the
same command without --weights and --save-stages (LibTorch loaded, skeleton read, plan made).

    python bench/stage_memory.py build/pipe [--work DIR]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def generate(work):
    """Writes the model (in its own process, so that the measuring process stays small: a child's
    peak-memory figure starts from its parent's size)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings", "python"))
    from libpipe import save_checkpoint, save_skeleton

    class Big(torch.nn.Module):
        def __init__(self, layers=8, width=4096, hidden=8192):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(width if i % 2 == 0 else hidden, hidden if i % 2 == 0 else width) for i in range(layers)
            )

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    torch.manual_seed(0)
    model = Big().eval()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ts = torch.jit.trace(model, (torch.randn(2, 4096),))
    save_checkpoint(ts, os.path.join(work, "big.safetensors"), max_shard_bytes=total // 4 + (1 << 20))
    save_skeleton(ts, os.path.join(work, "big.skeleton.pt"))
    print(total)


def peak_rss(cmd):
    """Runs cmd; returns (peak resident MiB, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    out, err = proc.communicate()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed: {err.decode()}")
    return usage.ru_maxrss / 1024.0, elapsed, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pipe")
    ap.add_argument("--work", default=None)
    ap.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        return generate(args.work)
    work = args.work or tempfile.mkdtemp(prefix="libpipe-stage-memory-")
    try:
        total = int(
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), args.pipe, "--generate", "--work", work],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        index = os.path.join(work, "big.safetensors.index.json")
        skeleton = os.path.join(work, "big.skeleton.pt")
        files = [f for f in os.listdir(work) if f.endswith(".safetensors")]
        file_bytes = sum(os.path.getsize(os.path.join(work, f)) for f in files)
        split = ["--stages", "4", "--policy", "params"]
        plan = json.loads(
            subprocess.run(
                [args.pipe, "split", skeleton, *split, "--json"], capture_output=True, text=True, check=True
            ).stdout
        )
        base_rss, base_s, _ = peak_rss([args.pipe, "split", skeleton, *split])
        print(
            f"model: {total / 2**30:.2f} GiB of weights in {len(files)} shards ({file_bytes / 2**30:.2f} GiB on disk); "
            f"fixed runtime overhead (pipe split without weights): {base_rss:.0f} MiB peak, {base_s:.2f} s\n"
        )
        print(
            "| stage | weight MiB | peak RSS MiB | RSS - overhead | (RSS - overhead) / weights | build + save s | MiB/s |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        worst = 0.0
        for stage in plan["stages"]:
            k = stage["index"]
            out_dir = os.path.join(work, f"stage{k}")
            os.makedirs(out_dir, exist_ok=True)
            rss, secs, _ = peak_rss(
                [args.pipe, "split", skeleton, *split, "--weights", index, "--save-stages", out_dir, "--stage", str(k)]
            )
            mib = stage["param_bytes"] / 2**20
            ratio = (rss - base_rss) / mib
            worst = max(worst, ratio)
            print(
                f"| {k} | {mib:.0f} | {rss:.0f} | {rss - base_rss:.0f} | {ratio:.3f} | {secs - base_s:.2f} | "
                f"{mib / max(secs - base_s, 1e-6):.0f} |"
            )
            shutil.rmtree(out_dir)
        print(f"\nworst stage: peak RSS = overhead + {worst:.3f} x its weight bytes (target: <= 1.15 x)")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
