"""Building a decoder from a Hugging Face config dict (the model type's layers, in the checkpoint's
dtype or another), and scripting or exporting it for libpipe."""

import torch

from .gpt2 import build_gpt2
from .llama import (
    MLP,
    Attention,
    DecoderLayer,
    DecoderLM,
    DecoderModel,
    RotaryEmbedding,
    _sliding_windows,
    rotary_inv_freq,
)

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")


_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def config_dtype(config):
    """The dtype the checkpoint was saved in (config's `dtype`, or `torch_dtype` before
    transformers 5), float32 if it says nothing."""
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)


def build_decoder(
    config, max_len, slots, dtype=torch.float32, weights_device="cpu", placeholder_caches=False, cache_dtype=None
):
    """An eager DecoderLM for a Hugging Face config dict (config.json), with caches of
    [slots, kv_heads, max_len, head_dim] per attention layer. ValueError for what it cannot build
    exactly: another model type, rope type, activation, or a max_len or slots below 1.
    weights_device "meta" makes the parameters without memory (for a skeleton); the caches and
    rotary frequencies are always made on the CPU. placeholder_caches makes each cache a
    zero-stride placeholder (see libpipe.decoders' docstring: libpipe allocates it; eager calls refuse it).
    cache_dtype (a torch.dtype; default `dtype`) stores keys and values in another dtype than the
    model's, e.g. bfloat16 caches for a float32 model: half the bytes attention reads, each key and
    value rounded once when written, read back in the model's dtype."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported are the Llama-family causal LMs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if max_len < 1 or slots < 1:
        raise ValueError(f"max_len and slots must be at least 1 (got {max_len} and {slots})")
    weights = {"dtype": dtype, "device": torch.device(weights_device)}
    if model_type == "gpt2":
        return build_gpt2(config, max_len, slots, weights, placeholder_caches, cache_dtype).eval()
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    eps = float(config.get("rms_norm_eps", 1e-6))
    layers_n = config["num_hidden_layers"]
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
    else:
        qkv_bias = o_bias = mlp_bias = False
    windows = _sliding_windows(config, model_type, layers_n)
    inv_freq, scaling = rotary_inv_freq(config, head_dim)
    layers = [
        DecoderLayer(
            Attention(
                hidden,
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
                o_bias,
                windows[i],
                slots,
                max_len,
                weights,
                placeholder_caches,
                cache_dtype,
            ),
            MLP(hidden, config["intermediate_size"], mlp_bias, weights),
            hidden,
            eps,
            weights,
        )
        for i in range(layers_n)
    ]
    model = DecoderModel(layers, vocab, hidden, eps, RotaryEmbedding(inv_freq, scaling), weights)
    tied = bool(config.get("tie_word_embeddings", False))
    return DecoderLM(model, vocab, hidden, tied, slots, max_len, weights).eval()


def script_decoder(decoder):
    """torch.jit.script of a DecoderLM."""
    return torch.jit.script(decoder)


def export_decoder(decoder, path=None):
    """torch.export of a DecoderLM or GPT2LM for libpipe's .pt2 front-end, as
    libpipe.export_program makes programs (eval, no_grad, not decomposed, so that the caches'
    index_put_ stay in place and persist across runs), with the batch B and the width T of tokens
    both dynamic from 1 (a decode step is T = 1; a micro-batch may be one row). With `path`, also
    saves it there (torch.export.save: every tensor with its data; libpipe.export_llm writes a
    skeleton instead). Returns the ExportedProgram.

    The example call has B = T = 2 (export specializes a dimension whose example is 1); its
    values are never run, so any decoder exports, whatever its slots and max_len. The contract's
    checks are aten._assert_async nodes that raise check_call's messages when the program runs
    (on the CPU; on a CUDA device _assert_async is a device-side assertion, fatal to the
    process's CUDA context), and each attention layer reads max(start + lengths) with
    aten.item into an unbacked size in 1 .. max_len that narrows its cache."""
    from torch.export import Dim

    from ..exported import export_program

    tokens = torch.zeros(2, 2, dtype=torch.int64)
    start = torch.zeros(2, dtype=torch.int64)
    lengths = torch.tensor([2, 1], dtype=torch.int64)
    slots = torch.tensor([0, 1], dtype=torch.int64)
    return export_program(
        decoder, (tokens, start, lengths, slots), dynamic_shapes={"tokens": {1: Dim("T", min=1)}}, path=path
    )
