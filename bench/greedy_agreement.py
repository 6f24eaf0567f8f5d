"""Greedy agreement of libpipe's 8- and 4-bit weights (and bf16) with its float32, on chat prompts: how often
quantized weights change what the model answers, beside perplexity (bench/perplexity.py), which says how much
they change its probabilities.

The prompts are fixed: PROMPTS, 32 short user questions of varied kinds (facts, how-to, code, writing,
arithmetic), each one user turn through the model's chat template (transformers' tokenizer,
`apply_chat_template(add_generation_prompt=True)`). Every precision answers the same prompt ids greedily, at most
--new-tokens (64) tokens, a sequence ending at the model's end-of-turn id (SmolLM2's <|im_end|>, 2) or at the limit.

- libpipe: the model exported once as a float32 skeleton (libpipe.export_llm, a cache slot per prompt), a
  libpipe.Generator at each precision (fp32; int8 and int4: `quantize=`, activations in float32, int4's output
  head in int8 as libpipe keeps it, and int4-head-int4 with the head in 4 bits too; bf16: a bf16 skeleton with dtype="bfloat16", the weights cast at load), cut
  with --split-at or --stages, every prompt submitted at once (the same batch for every precision), in this
  process;
- transformers: LlamaForCausalLM.generate(do_sample=False) in float32, one prompt at a time (no padding), the
  reference of libpipe's fp32 row;
- llama.cpp (--reference llamacpp): llama-server (bench/llamacpp.py builds it) on the F32 GGUF libpipe's float32
  weights come from and the Q8_0 and Q4_0 that llama-quantize makes of it, the same prompt ids as token arrays to
  /completion, temperature 0 and top_k 1, prompt cache off, one request at a time; each compared with llama.cpp's
  own F32 (llama.cpp's tokens are never compared with libpipe's: other kernels, other near ties).

Per precision against its float32 (libpipe's, or llama.cpp's F32): the sequences equal token for token, and the
mean over prompts of the share of the float32 answer matched before the first difference (the first index where
the two differ, or where the shorter ends, over the float32 answer's length; 1.0 if equal). libpipe's fp32 is
also compared with transformers' (its row "vs transformers").

    python bench/greedy_agreement.py [--model smollm2|llama1b|DIR] [--dtype fp32 bf16 int8 int4 ...]
                                     [--new-tokens 64] [--prompts 32] [--split-at POINT | --stages 2]
                                     [--reference transformers llamacpp] [--threads T] [--out FILE]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/test.sh (or ctest's
bindings_python), which installs the Python binding into it.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "models")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never wait on a network

from generate import EOS, GGUF_TYPES, Transformers, checkpoint, machine, model_folder  # noqa: E402

PROMPTS = [
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "Who wrote the novel Pride and Prejudice?",
    "What is 17 times 23?",
    "Why do cats purr?",
    "Explain what a black hole is in simple words.",
    "What is the boiling point of water at sea level?",
    "Give me two tips for learning a new language.",
    "Write a Python function that reverses a string.",
    "What does DNA stand for?",
    "How do vaccines work?",
    "Suggest a name for a small bakery.",
    "What is the largest ocean on Earth?",
    "Write a short poem about the sea.",
    "How can I make my coffee less bitter?",
    "What is the difference between a noun and a verb?",
    "Why do leaves change color in autumn?",
    "What is the square root of 144?",
    "Describe a rainbow to someone who has never seen one.",
    "What are the benefits of drinking water?",
    "How does a bicycle stay upright?",
    "Write a SQL query that counts the rows of a table named users.",
    "What language is spoken in Brazil?",
    "How do I tie a tie?",
    "What is the speed of light?",
    "Give me a fun fact about octopuses.",
    "What causes thunder?",
    "Write one sentence to thank a colleague for their help.",
    "What is machine learning?",
    "How many days are there in a leap year?",
    "Which planet is known as the red planet?",
    "What should I do if I cannot fall asleep?",
]


def chat_ids(folder, messages):
    """Each message as one user turn through the folder's chat template, with the assistant's turn opened."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for text in messages:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append([int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def first_difference(output, reference):
    """The first index where the two differ, or where the shorter one ends; None when equal."""
    if output == reference:
        return None
    return next((k for k, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


def agreement(outputs, reference):
    """The outputs against the reference, prompt by prompt: sequences equal, mean share before the first
    difference, and each prompt's first difference (None: equal)."""
    firsts = [first_difference(o, r) for o, r in zip(outputs, reference)]
    shares = [1.0 if f is None else f / max(len(r), 1) for f, r in zip(firsts, reference)]
    return {
        "sequences_equal": sum(f is None for f in firsts),
        "sequences": len(firsts),
        "mean_share_before_first_difference": statistics.mean(shares),
        "first_difference": firsts,
    }


# ---- libpipe ------------------------------------------------------------------------------------


def libpipe_outputs(folder, skeletons, prompts, new_tokens, precision, cut, threads):
    """The prompts' greedy answers at `precision`, all submitted at once to one Generator: (outputs, seconds)."""
    import libpipe

    options = {"quantize": precision[:4]} if precision.startswith("int") else {}
    if precision == "bf16":
        options["dtype"] = "bfloat16"
    skeleton = skeletons["bf16" if precision == "bf16" else "fp32"]
    # int4-head-int4: the output head in 4 bits too (libpipe keeps it in int8 under int4 otherwise).
    if precision == "int4-head-int4":
        options["quantize_head"] = "int4"
    generator = libpipe.Generator(skeleton, weights=checkpoint(folder), threads_per_stage=threads, **cut, **options)
    with generator:
        start = time.perf_counter()
        generations = [generator.generate(p, max_new_tokens=new_tokens, stop_ids=[EOS]) for p in prompts]
        outputs = [list(g.wait()) for g in generations]
        seconds = time.perf_counter() - start
    return outputs, seconds


# ---- llama.cpp ----------------------------------------------------------------------------------


def llamacpp_outputs(bin_dir, gguf, prompts, new_tokens, threads, work):
    """llama-server's greedy answers to the prompt ids, one request at a time: (outputs, seconds). The end-of-turn
    id is appended where the server stopped at it, as libpipe's outputs hold it."""
    from http_load import HOST, start_llama_server

    ctx = max(len(p) for p in prompts) + new_tokens + 16
    server = start_llama_server(bin_dir, gguf, 1, ctx, threads, False, os.path.join(work, f"{gguf.name}.log"))
    try:
        outputs = []
        start = time.perf_counter()
        for p in prompts:
            body = {
                "prompt": p,
                "n_predict": new_tokens,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            }
            request = urllib.request.Request(
                f"http://{HOST}:{server.port}/completion",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=600) as r:
                answer = json.load(r)
            tokens = [int(t) for t in answer["tokens"]]
            if answer.get("stop_type") == "eos" and (not tokens or tokens[-1] != EOS):
                tokens.append(EOS)
            outputs.append(tokens)
        seconds = time.perf_counter() - start
    finally:
        server.stop()
    return outputs, seconds


# ---- the run ------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["fp32", "bf16", "int8", "int4", "int4-head-int4"],
        choices=["fp32", "bf16", "int8", "int4", "int4-head-int4"],
        help="libpipe's precisions (fp32, the reference, is always run); int4-head-int4: int4 with the output head "
        "in 4 bits too (the Generator's quantize_head=int4), which libpipe keeps in int8 otherwise",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)}")
    parser.add_argument("--split-at", action="append")
    parser.add_argument("--stages", type=int)
    parser.add_argument("--threads-per-stage", type=int, default=0, help="0: libpipe's default")
    parser.add_argument(
        "--reference", nargs="*", default=["transformers", "llamacpp"], choices=["transformers", "llamacpp"]
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="transformers' and llama.cpp's threads")
    parser.add_argument("--out", help="write the figures and every output here (JSON)")
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        sys.exit(f"greedy_agreement.py: --prompts must be 1..{len(PROMPTS)}")

    from libpipe.export_llm import export_llm

    folder = model_folder(args.model)
    prompts = chat_ids(folder, PROMPTS[: args.prompts])
    cut = {"split_at": args.split_at} if args.split_at else {"stages": args.stages or 2}
    precisions = ["fp32"] + [d for d in args.dtype if d != "fp32"]
    print(f"machine: {machine()}", flush=True)
    print(
        f"model {folder}; {len(prompts)} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"at most {args.new_tokens} new tokens each, ending at id {EOS}; libpipe cut {cut}",
        flush=True,
    )
    result = {
        "machine": machine(),
        "model": str(folder),
        "new_tokens": args.new_tokens,
        "cut": cut,
        "prompts": prompts,
        "libpipe": {},
    }
    max_len = max(map(len, prompts)) + args.new_tokens + 8
    with tempfile.TemporaryDirectory() as work:
        skeletons = {"fp32": os.path.join(work, "fp32.pt"), "bf16": os.path.join(work, "bf16.pt")}
        export_llm(folder, skeletons["fp32"], max_seq_len=max_len, max_batch=len(prompts), dtype="fp32")
        if "bf16" in precisions:
            export_llm(folder, skeletons["bf16"], max_seq_len=max_len, max_batch=len(prompts), dtype="bf16")
        for precision in precisions:
            outputs, seconds = libpipe_outputs(
                folder, skeletons, prompts, args.new_tokens, precision, cut, args.threads_per_stage
            )
            result["libpipe"][precision] = {"outputs": outputs, "seconds": seconds}
            print(
                f"libpipe {precision}: {sum(map(len, outputs))} tokens in {seconds:.1f} s",
                flush=True,
            )
        fp32 = result["libpipe"]["fp32"]["outputs"]
        for precision in precisions:
            result["libpipe"][precision]["vs_fp32"] = agreement(result["libpipe"][precision]["outputs"], fp32)
        if "transformers" in args.reference:
            import torch

            hf = Transformers(folder)
            start = time.perf_counter()
            reference = [hf.generate([p], args.new_tokens, args.threads)[0][0] for p in prompts]
            result["transformers"] = {
                "outputs": reference,
                "seconds": time.perf_counter() - start,
                "torch": torch.__version__,
            }
            result["libpipe"]["fp32"]["vs_transformers"] = agreement(fp32, reference)
            print(f"transformers fp32: {sum(map(len, reference))} tokens", flush=True)
        if "llamacpp" in args.reference:
            import llamacpp
            from smollm2 import gguf_path

            bin_dir = llamacpp.build()
            if args.model == "smollm2":
                f32 = llamacpp.f32_gguf(bin_dir, gguf_path())
            else:
                f32 = llamacpp.hf_gguf(folder, "F32")
            wanted = [d for d in ("fp32", "int8", "int4") if d in precisions]
            models = {d: f32 if d == "fp32" else llamacpp.converted_gguf(bin_dir, f32, GGUF_TYPES[d]) for d in wanted}
            result["llamacpp"] = {"package": f"{llamacpp.PACKAGE}=={llamacpp.VERSION}", "threads": args.threads}
            for precision, gguf in models.items():
                outputs, seconds = llamacpp_outputs(bin_dir, gguf, prompts, args.new_tokens, args.threads, work)
                result["llamacpp"][precision] = {"gguf": gguf.name, "outputs": outputs, "seconds": seconds}
                print(f"llama.cpp {GGUF_TYPES[precision]}: {sum(map(len, outputs))} tokens in {seconds:.1f} s")
            for precision in models:
                result["llamacpp"][precision]["vs_f32"] = agreement(
                    result["llamacpp"][precision]["outputs"], result["llamacpp"]["fp32"]["outputs"]
                )

    def cells(a):
        if a is None:
            return "- | -"
        return f"{a['sequences_equal']} / {a['sequences']} | {a['mean_share_before_first_difference']:.3f}"

    print(
        f"\n{len(prompts)} chat prompts, at most {args.new_tokens} new tokens each. Equal: sequences equal token "
        "for token; share: mean share of the float32 answer matched before the first difference."
    )
    print("\n| weights | libpipe: equal to its fp32 | share | llama.cpp: equal to its F32 | share |")
    print("| --- | --- | --- | --- | --- |")
    names = {
        "fp32": "fp32 / F32",
        "bf16": "bf16",
        "int8": "int8 / Q8_0",
        "int4": "int4 (head int8) / Q4_0",
        "int4-head-int4": "int4, head int4 too",
    }
    for precision in precisions:
        lc = result.get("llamacpp", {}).get(precision, {}).get("vs_f32")
        print(f"| {names[precision]} | {cells(result['libpipe'][precision]['vs_fp32'])} | {cells(lc)} |")
    vs_hf = result["libpipe"]["fp32"].get("vs_transformers")
    if vs_hf:
        print(f"| libpipe fp32 against transformers' fp32 | {cells(vs_hf)} | - | - |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
