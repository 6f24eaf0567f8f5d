"""The 2-stage MLP of the scheduler benchmark on PyTorch's own torch.distributed.pipelining:
pipeline() traces and splits the model at blocks.2 (SplitPoint.BEGINNING), each stage runs in
its own process (Gloo on loopback, 1 intra-op thread each on this 2-core machine), and
ScheduleGPipe drives 8 micro-batches per step. Prints samples/s next to the unsplit eager model.

    python bench/pytorch_pipelining.py [--steps 10] [--microbatches 8]
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_bench_models import MLP  # noqa: E402  (the same model as libpipe's benchmark)


def stage_process(rank, world, steps, microbatches, port, result):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MLP(split=False).eval()
    x = torch.randn(256, 1024)
    mb = x.chunk(microbatches)[0]
    pipe = pipeline(model, mb_args=(mb,), split_spec={"blocks.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches)
    with torch.no_grad():
        for step in range(steps + 2):  # two warm-up steps
            if step == 2:
                dist.barrier()
                start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step()
        dist.barrier()
    if rank == world - 1:
        result.put(steps * 256 / (time.perf_counter() - start))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = MLP(split=False).eval()
    x = torch.randn(256, 1024)
    best = 0.0
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
            start = time.perf_counter()
            for _ in range(args.steps):
                model(x)
        best = max(best, args.steps * 256 / (time.perf_counter() - start))
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [
        ctx.Process(target=stage_process, args=(r, 2, args.steps, args.microbatches, port, result)) for r in range(2)
    ]
    for p in procs:
        p.start()
    sps = result.get(timeout=600)
    for p in procs:
        p.join()
    print(
        f"| torch.distributed.pipelining (pipeline + ScheduleGPipe, 2 Gloo processes, {args.microbatches} "
        f"micro-batches) | eager unsplit best {best:.1f} samples/s | pipelined {sps:.1f} samples/s = {sps / best:.3f}x |"
    )


if __name__ == "__main__":
    main()
