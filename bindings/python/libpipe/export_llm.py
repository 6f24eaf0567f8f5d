"""Export a Hugging Face causal LM as a libpipe decoder skeleton (the decoder contract: see
libpipe.decoder).

    python -m libpipe.export_llm HF_MODEL_DIR OUT.pt [--max-seq-len L] [--max-batch S] [--dtype fp32|bf16|fp16]

reads HF_MODEL_DIR/config.json (Llama, Qwen2, Mistral, GPT-2), builds the decoder with caches for S
sequences (slots) of up to L tokens each, scripts it and saves it without weights: parameters on
the meta device, named as in the Hugging Face checkpoint, so that

    pipe ... OUT.pt --weights HF_MODEL_DIR/model.safetensors          (or model.safetensors.index.json)

loads them unchanged (a tied head included). The rotary frequencies and the caches are
non-persistent buffers, which no checkpoint holds: the skeleton keeps them with their data, the
caches as zero-stride placeholders (a few bytes each), which libpipe allocates in the stage that
owns each layer: 2 x layers x S x kv_heads x L x head_dim x dtype size bytes in all (printed).

--dtype defaults to the checkpoint's (config.json `dtype` / `torch_dtype`, else fp32): libpipe
refuses weights whose dtype differs from the skeleton's unless a session dtype converts them.

From Python: export_llm(model_dir, out, max_seq_len=..., max_batch=..., dtype=...) returns the
eager decoder it saved (nn.Module, weights uninitialised).
"""

import argparse
import json
import os
import sys

import torch

from .decoder import _DTYPES, build_decoder, config_dtype
from .export import save_skeleton

DEFAULT_MAX_BATCH = 8


def cache_bytes(decoder):
    """Bytes of every k_cache and v_cache of a decoder once allocated (placeholders included)."""
    return sum(b.numel() * b.element_size() for n, b in decoder.named_buffers() if n.endswith(("k_cache", "v_cache")))


def read_config(model_dir):
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: give the folder of a Hugging Face model (save_pretrained)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def export_llm(model_dir, out, *, max_seq_len=None, max_batch=DEFAULT_MAX_BATCH, dtype=None):
    """Writes the skeleton of the decoder for model_dir's config.json to `out`. max_seq_len
    defaults to the config's max_position_embeddings; dtype ("fp32" | "bf16" | "fp16" or a
    torch.dtype) to the checkpoint's. ValueError for what cannot be exported (the message says
    why). Returns the eager decoder."""
    config = read_config(model_dir)
    if max_seq_len is None:
        max_seq_len = config.get("max_position_embeddings")
        if not max_seq_len:
            raise ValueError("config.json has no max_position_embeddings: give --max-seq-len")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of fp32, bf16, fp16")
        dtype = _DTYPES[dtype]
    if dtype is None:
        dtype = config_dtype(config)
    # Nothing big is made here: the weights are on the meta device, the caches placeholders.
    decoder = build_decoder(
        config, int(max_seq_len), int(max_batch), dtype, weights_device="meta", placeholder_caches=True
    )
    scripted = torch.jit.script(decoder)
    try:
        save_skeleton(scripted, os.fspath(out), module=decoder)
    except (OSError, RuntimeError) as e:  # TorchScript's writer raises RuntimeError for a bad path
        raise ValueError(f"cannot write {os.fspath(out)}: {e}") from None
    return decoder


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m libpipe.export_llm",
        description="Export a Hugging Face causal LM (Llama, Qwen2, Mistral, GPT-2) as a libpipe decoder skeleton "
        "whose weights load from the model's own checkpoint.",
    )
    parser.add_argument("model_dir", help="Hugging Face model folder (config.json)")
    parser.add_argument("out", help="the skeleton to write (.pt)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="cache length per sequence (tokens)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="cache slots (sequences at once)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: the checkpoint's")
    args = parser.parse_args(argv)
    try:
        decoder = export_llm(
            args.model_dir, args.out, max_seq_len=args.max_seq_len, max_batch=args.max_batch, dtype=args.dtype
        )
    except (ValueError, KeyError) as e:
        what = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
        print(f"export_llm: error: {what}", file=sys.stderr)
        return 1
    per_slot = cache_bytes(decoder) / args.max_batch
    layers = sum(1 for n, _ in decoder.named_buffers() if n.endswith("k_cache"))
    print(
        f"export_llm: wrote {args.out}: {layers} layers, {args.max_batch} slots x "
        f"{decoder.max_len} tokens, KV cache {cache_bytes(decoder) / 2**20:.1f} MiB "
        f"({per_slot / 2**20:.2f} MiB per slot), allocated by libpipe in the stages"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
