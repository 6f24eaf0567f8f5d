"""The random-weight Hugging Face models of tests/llm and how they are exported and run (shared by
test_decoder.py, test_generate.py and conftest.py's `exported` fixture).

Tiny random-weight Llama (tied head, llama3 rope scaling in one variant), Qwen2 (q/k/v biases),
Mistral (a sliding window shorter than the sequences) and GPT-2 (learned positions, fused q/k/v
stored [in, out], always tied) are saved with save_pretrained; the skeleton exported from their
config.json takes its weights from their own model.safetensors. The weights are drawn with a large
initializer_range so that generations vary from token to token (with the default, a random model
repeats one token, which a broken cache would too). The reference: transformers' greedy
`generate`, prompt by prompt.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch

MAX_LEN = 40
SLOTS = 4
NEW_TOKENS = 12
VOCAB = 256
# Prompts of different lengths; more of them than SLOTS, so that some wait for a slot and join
# while others are mid-flight; the longest is prefilled in chunks of CHUNK tokens.
PROMPTS = [
    [5, 6, 7, 8, 9],
    [100, 3],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [200, 201, 17, 250, 9, 9, 40],
    [77],
    [13, 31, 131, 113, 11, 3, 30, 90, 180, 255, 0, 12, 21, 14],
]
CHUNK = 4


def common(**kw):
    base = dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    base.update(kw)
    return base


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**common(tie_word_embeddings=True)))


def llama3_rope():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Scaled frequencies that differ from the defaults within the positions generated here.
    rope = dict(
        rope_type="llama3",
        rope_theta=500.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return LlamaForCausalLM(LlamaConfig(**common(rope_parameters=rope, num_key_value_heads=1)))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**common(num_key_value_heads=4)))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    # A window shorter than prompt + generation, so that the sliding mask decides outputs.
    return MistralForCausalLM(MistralConfig(**common(sliding_window=8, head_dim=32)))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=3,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=VOCAB,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": llama, "llama3_rope": llama3_rope, "qwen2": qwen2, "mistral": mistral, "gpt2": gpt2}


def num_layers(config):
    return config.get("n_layer") or config["num_hidden_layers"]


def layer_path(config):
    """Where the decoder layers are: Hugging Face's module path, which the decoder keeps."""
    return "transformer.h" if config["model_type"] == "gpt2" else "model.layers"


def split_points(config, stages):
    """Cuts between decoder layers for `stages` stages (none for 1)."""
    layers = num_layers(config)
    cut = [round(k * layers / stages) for k in range(1, stages)]
    return [f"{layer_path(config)}.{k}:begin" for k in cut]


@dataclass
class Exported:
    folder: str
    skeleton: str
    weights: str
    config: dict
    reference: list = field(default_factory=list)  # transformers' greedy tokens per prompt


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def export(folder, out, *args):
    """`python -m libpipe.export_llm FOLDER OUT ARGS...` run in this process (its main(), whose
    exit status and output are what the command gives): starting a Python that imports torch costs
    seconds per export. test_decoder.py runs the command itself once."""
    stdout, stderr = io.StringIO(), io.StringIO()
    from libpipe.export_llm import main

    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([str(folder), str(out), *map(str, args)])
        except SystemExit as e:  # argparse refusing an argument
            code = e.code
    return Result(code, stdout.getvalue(), stderr.getvalue())


def export_command(folder, out, *args):
    return subprocess.run(
        [sys.executable, "-m", "libpipe.export_llm", str(folder), str(out), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def greedy_reference(hf, prompts, new_tokens=NEW_TOKENS):
    """transformers' greedy tokens after each prompt, one prompt at a time (no padding), on the model's device."""
    reference = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            reference.append(out[0, len(p) :].tolist())
    return reference


def make_exported(name, folder):
    """Saves model `name` (seed 0) to `folder`, exports its skeleton with SLOTS slots of MAX_LEN
    tokens, and computes transformers' greedy tokens for PROMPTS."""
    torch.manual_seed(0)
    hf = MODELS[name]().eval()
    hf.save_pretrained(folder)
    skeleton = os.path.join(folder, "decoder.pt")
    result = export(folder, skeleton, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS, "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert "KV cache" in result.stdout
    reference = greedy_reference(hf, PROMPTS)
    # The tests can fail: a random model that repeated one token would not tell a broken cache.
    assert all(len(set(r)) >= 3 for r in reference), reference
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return Exported(str(folder), skeleton, os.path.join(folder, "model.safetensors"), config, reference)
