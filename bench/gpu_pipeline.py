"""GPU benchmarks of the stages-on-GPUs issue, in one run on one machine (rows for RESULTS.md):

1. Throughput of a Llama-style model in bf16: 2 stages on one GPU (each on a stream of its own)
   against the same model unsplit, run by libpipe as one stage and by PyTorch eagerly, through
   `pipe bench` (C threads) with the same requests.
2. Hand-over bandwidth: a micro-batch handed from a CPU stage to a GPU stage (pinned staging +
   asynchronous copy) and back, against a plain pinned cudaMemcpyAsync (torch's non_blocking copy
   from pinned memory) and a pageable copy of the same size.

    python bench/gpu_pipeline.py PIPE_CLI WORKDIR

Needs a CUDA device, transformers, and libpipe's Python binding installed in this Python (the GPU
suite, tests/gpu/run.sh, installs it)."""

import json
import os
import subprocess
import sys
import time

import torch

import libpipe
from libpipe import pipe_split

GPU = torch.device("cuda:0")


def llama_bf16(workdir, layers=8, batch=8, seq=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    class LastTokenLogits(LlamaForCausalLM):
        # What decoding samples from: the logits of the last position only.
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits[:, -1, :]

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LastTokenLogits(cfg).eval().to(GPU, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        ts = torch.jit.trace(model, (ids.to(GPU),))
    path = os.path.join(workdir, "llama_bf16.pt")
    ts.save(path)
    inputs = os.path.join(workdir, "llama_ids.safetensors")
    from safetensors.torch import save_file

    save_file({"input_ids": ids}, inputs)
    return model, ids, path, inputs, layers


def pipe_bench(cli, *args):
    result = subprocess.run([cli, "bench", *map(str, args), "--json"], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    return json.loads(result.stdout)


def eager_samples_per_s(model, ids, requests):
    with torch.no_grad():
        for _ in range(3):
            model(ids.to(GPU)).cpu()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(requests):
            model(ids.to(GPU)).cpu()
        elapsed = time.perf_counter() - start
    return requests * ids.shape[0] / elapsed


def throughput(cli, workdir, requests=60):
    model, ids, path, inputs, layers = llama_bf16(workdir)
    rows = []
    eager = eager_samples_per_s(model, ids, requests)
    rows.append(("PyTorch eager, unsplit, 1 caller", eager, None))
    del model
    torch.cuda.empty_cache()
    split = ["--split-at", f"model.layers.{layers // 2 - 1}:end"]
    for concurrency in (1, 2, 4):
        one = pipe_bench(
            cli, path, "--input", inputs, "--devices", "cuda:0", "--requests", requests, "--concurrency", concurrency
        )
        rows.append((f"libpipe 1 stage on cuda:0, {concurrency} caller(s)", one["samples_per_s"], one))
        for m in (1, 2, 4):
            two = pipe_bench(
                cli,
                path,
                *split,
                "--input",
                inputs,
                "--devices",
                "cuda:0,cuda:0",
                "--microbatches",
                m,
                "--requests",
                requests,
                "--concurrency",
                concurrency,
            )
            rows.append(
                (
                    f"libpipe 2 stages on cuda:0 (2 streams), {m} micro-batch(es), {concurrency} caller(s)",
                    two["samples_per_s"],
                    two,
                )
            )
    return eager, rows


class Pass(torch.nn.Module):
    """Two stages that only hand the tensor over: the cost measured is the hand-over."""

    def forward(self, x):
        y = torch.flatten(x)
        pipe_split()
        return torch.flatten(y)


def timed(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def handover(workdir, sizes_mb=(4, 64, 256)):
    path = os.path.join(workdir, "pass.pt")
    torch.jit.script(Pass()).save(path)
    plan = libpipe.Model.load(path).split()
    up = plan.session(microbatches=1, devices="cpu,cuda:0", outputs="device")
    down = plan.session(microbatches=1, devices="cuda:0,cpu")
    rows = []
    for mb in sizes_mb:
        n = mb * (1 << 20) // 4
        host = torch.randn(n)
        pinned = host.pin_memory()
        dev = torch.empty(n, device=GPU)
        src = host.to(GPU)
        back = torch.empty(n, pin_memory=True)
        gb = n * 4 / 1e9
        up_pipe = timed(lambda: up.run(x=host))
        up_pinned = timed(lambda: dev.copy_(pinned, non_blocking=True))
        up_pageable = timed(lambda: host.to(GPU))
        down_pipe = timed(lambda: down.run(x=src))
        down_pinned = timed(lambda: back.copy_(src, non_blocking=True))
        down_pageable = timed(lambda: src.cpu())
        rows.append(
            {
                "MiB": mb,
                "cpu_to_gpu_GBps": {
                    "libpipe": gb / up_pipe,
                    "pinned cudaMemcpyAsync": gb / up_pinned,
                    "pageable": gb / up_pageable,
                },
                "gpu_to_cpu_GBps": {
                    "libpipe": gb / down_pipe,
                    "pinned cudaMemcpyAsync": gb / down_pinned,
                    "pageable": gb / down_pageable,
                },
            }
        )
    up.close()
    down.close()
    return rows


def main():
    cli, workdir = sys.argv[1], sys.argv[2]
    os.makedirs(workdir, exist_ok=True)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, libpipe {libpipe.version()}")
    eager, rows = throughput(cli, workdir)
    print(
        "\n| Llama-style bf16 (8 layers, hidden 2048, batch 8 x 512 tokens, last-token logits) | samples/s | vs eager |"
    )
    print("| --- | --- | --- |")
    for name, sps, _ in rows:
        print(f"| {name} | {sps:.1f} | {sps / eager:.3f}x |")
    hand = handover(workdir)
    print(
        "\n| hand-over size | CPU→GPU libpipe | pinned cudaMemcpyAsync | pageable | GPU→CPU libpipe | pinned | pageable |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in hand:
        u, d = r["cpu_to_gpu_GBps"], r["gpu_to_cpu_GBps"]
        print(
            f"| {r['MiB']} MiB | {u['libpipe']:.1f} GB/s | {u['pinned cudaMemcpyAsync']:.1f} | {u['pageable']:.1f} | "
            f"{d['libpipe']:.1f} GB/s | {d['pinned cudaMemcpyAsync']:.1f} | {d['pageable']:.1f} |"
        )
    with open(os.path.join(workdir, "gpu_pipeline.json"), "w") as f:
        json.dump({"throughput": [(n, s, r) for n, s, r in rows], "handover": hand}, f, indent=1)


if __name__ == "__main__":
    main()
