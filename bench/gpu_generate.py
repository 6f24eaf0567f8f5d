"""Token generation on one GPU (issue 40): libpipe's `pipe generate --devices cuda:0` against transformers'
`generate` on the same GPU, prompts and dtype, in one run.

Models, bfloat16 with random weights built from their configs (a GPU machine has no model hub and no package
registry; speed does not depend on the weights' values): SmolLM2-135M's architecture and bench/llama1b.py's 1B
Llama. Per model, libpipe over 1 and 2 stages on the one GPU and transformers, C sequences at once (default 1, 8,
32 and 128) of --prompt-tokens (128) random prompt ids each, --new-tokens (64) generated with no stop:

- tokens/s: generated tokens over the generation's time (libpipe: `pipe generate --json`'s tokens_per_s, the
  process start and model load excluded; transformers: its generate() call's wall time);
- TTFT: libpipe's mean over sequences from submit; transformers' a generate() of one new token on the batch;
- inter-token latency: (time of the whole generation - TTFT) / (new tokens - 1), per sequence;
- decode at one sequence as a share of the bandwidth bound: the weights' bytes per token over the GPU's measured
  device-to-device copy rate (bytes read plus bytes written per second, torch's copy_ of 1 GiB).

transformers runs its padded batches (all prompts have the same length here, so no padding: its best case),
libpipe its continuous batching, with its decode steps replayed as CUDA graphs (the default) and, for the layouts of
--graphs-off-stages, without (LIBPIPE_CUDA_GRAPHS=0). Graphs pad a decode step of C rows to 2^k + 1 rows in free
cache slots (runtime/generate/graph_padding.h), so each skeleton has that many slots. `--device cpu` with small
--concurrency tries the script's logic without a GPU.

    python bench/gpu_generate.py [--pipe build/pipe] [--models smollm2 llama1b] [--concurrency 1 8 32 128]
                                 [--stages 1 2] [--graphs-off-stages 1] [--repeats 1] [--device cuda:0]
                                 [--work DIR] [--out FILE]

scripts/test-gpu.sh runs it after the GPU tests; record its tables in bench/RESULTS.md with the device, driver and
date it prints.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def model_config(name):
    if name == "smollm2":
        return SMOLLM2
    from llama1b import CONFIG

    return CONFIG


def build_model(name, work):
    """A bfloat16 Hugging Face folder of model `name` with random weights (seed 0), written once into `work`."""
    folder = os.path.join(work, f"{name}-bf16")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.no_grad():
        model = LlamaForCausalLM(LlamaConfig(**model_config(name))).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def weight_bytes(folder):
    """Bytes a decode step reads: every weight once (a tied head once, as it is stored once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.endswith("embed_tokens.weight") and "lm_head.weight" in f.keys():
                continue  # an untied embedding: one row per token
            t = f.get_slice(key)
            n = 1
            for d in t.get_shape():
                n *= d
            total += n * 2
    return total


def copy_rate(device):
    """The device's copy rate in GB/s (bytes read + bytes written), the best of 5 copies of 1 GiB."""
    import torch

    if not device.startswith("cuda"):
        return None
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 2 / best / 1e9


def prompts(count, length, vocab):
    import torch

    g = torch.Generator().manual_seed(1234)
    # Ids away from the specials at the bottom of the vocabulary.
    return torch.randint(100, vocab, (count, length), generator=g).tolist()


def graph_slots(c):
    """The cache slots a decode step of c rows needs to be padded to a CUDA graph's shape: 2^k + 1 >= c + 1."""
    power = 1
    while power < c:
        power *= 2
    return power + 1


def libpipe_run(args, folder, skeleton, batch, stages, graphs=True):
    cmd = [args.pipe, "generate", skeleton, "--weights", os.path.join(folder, "model.safetensors")]
    cmd += ["--dtype", "bf16", "--devices", args.device, "--stages", str(stages), "--json"]
    cmd += ["--max-new-tokens", str(args.new_tokens)]
    for p in batch:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    env = dict(os.environ) if graphs else {**os.environ, "LIBPIPE_CUDA_GRAPHS": "0"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"gpu_generate.py: `pipe generate` failed ({r.returncode}): {r.stderr.strip()}")
    out = json.loads(r.stdout)
    tokens = sum(map(len, out["outputs"]))
    seconds = tokens / out["tokens_per_s"]
    ttft = out["time_to_first_token_ms"] / 1000
    return {
        "tokens_per_s": out["tokens_per_s"],
        "ttft_ms": ttft * 1000,
        "itl_ms": (seconds - ttft) / (args.new_tokens - 1) * 1000,
        "outputs": out["outputs"],
    }


class Transformers:
    def __init__(self, folder, device):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()

    def generate(self, batch, new_tokens):
        torch = self.torch
        ids = torch.tensor(batch, device=self.device)
        with torch.inference_mode():
            self.sync()
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            self.sync()
            seconds = time.perf_counter() - start
        return out[:, ids.shape[1] :].tolist(), seconds

    def sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize(self.device)

    def run(self, batch, new_tokens):
        outs, seconds = self.generate(batch, new_tokens)
        _, first = self.generate(batch, 1)
        tokens = sum(map(len, outs))
        return {
            "tokens_per_s": tokens / seconds,
            "ttft_ms": first * 1000,
            "itl_ms": (seconds - first) / (new_tokens - 1) * 1000,
            "outputs": outs,
        }


def median(runs, key):
    return statistics.median(r[key] for r in runs)


def device_line(device):
    import torch

    if not device.startswith("cuda"):
        return f"device: {device} (a dry run of the script's logic, not a GPU figure)"
    p = torch.cuda.get_device_properties(device)
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    return f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, driver {driver or '?'}, CUDA {torch.version.cuda}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipe", default=os.path.join(HERE, "..", "build", "pipe"))
    ap.add_argument("--models", nargs="+", choices=["smollm2", "llama1b"], default=["smollm2", "llama1b"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--graphs-off-stages", type=int, nargs="*", default=[1], help="layouts also run without graphs")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--work", help="where the models and skeletons go (default: a temporary folder)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the inter-token latency needs two tokens)")
    work = args.work or tempfile.mkdtemp(prefix="libpipe-gpu-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        from libpipe.export_llm import export_llm
    except ImportError:  # a GPU machine's own Python, without the binding installed: the source tree's package
        sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
        from libpipe.export_llm import export_llm

    print(device_line(args.device), f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rate = copy_rate(args.device)
    if rate:
        print(f"device-to-device copy rate: {rate:.0f} GB/s (read + write)", flush=True)
    results = {"device": device_line(args.device), "copy_rate_gb_per_s": rate, "rows": []}
    for name in args.models:
        folder = build_model(name, work)
        step_bytes = weight_bytes(folder)
        hf = Transformers(folder, args.device)
        hf.generate(prompts(2, 8, 1000), 4)  # warm-up: kernels picked, memory pooled
        print(f"\n{name}: bf16, {step_bytes / 1e6:.0f} MB of weights per decode step", flush=True)
        print(
            "| sequences | layout | tokens/s | vs transformers | TTFT ms | inter-token ms | decode share of bound "
            "| greedy answers equal to transformers' |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for c in args.concurrency:
            batch = prompts(c, args.prompt_tokens, model_config(name)["vocab_size"])
            slots = graph_slots(c)
            skeleton = os.path.join(work, f"{name}-{slots}slots.pt")
            if not os.path.exists(skeleton):
                export_llm(
                    folder, skeleton, max_seq_len=args.prompt_tokens + args.new_tokens, max_batch=slots, dtype="bf16"
                )
            layouts = [(s, True) for s in args.stages] + [(s, False) for s in args.graphs_off_stages]
            label = {
                (s, g): f"libpipe {s} stage{'s' if s > 1 else ''}{'' if g else ', graphs off'}" for s, g in layouts
            }
            runs = {"transformers": []}
            runs.update({label[k]: [] for k in layouts})
            for _ in range(args.repeats):
                runs["transformers"].append(hf.run(batch, args.new_tokens))
                for s, g in layouts:
                    runs[label[(s, g)]].append(libpipe_run(args, folder, skeleton, batch, s, graphs=g))
            hf_tps = median(runs["transformers"], "tokens_per_s")
            for layout, rs in runs.items():
                tps, ttft, itl = median(rs, "tokens_per_s"), median(rs, "ttft_ms"), median(rs, "itl_ms")
                share = ""
                if rate and c == 1:
                    share = f"{(1000 / itl) * step_bytes / (rate * 1e9):.0%}"
                agree = sum(a == b for a, b in zip(rs[0]["outputs"], runs["transformers"][0]["outputs"]))
                print(
                    f"| {c} | {layout} | {tps:.1f} | {tps / hf_tps:.2f}x | {ttft:.1f} | {itl:.2f} | {share} "
                    f"| {agree} of {c} |",
                    flush=True,
                )
                results["rows"].append(
                    {
                        "model": name,
                        "sequences": c,
                        "layout": layout,
                        "tokens_per_s": tps,
                        "ttft_ms": ttft,
                        "itl_ms": itl,
                        "greedy_equal_to_transformers": f"{agree} of {c}",
                    }
                )
        del hf
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
