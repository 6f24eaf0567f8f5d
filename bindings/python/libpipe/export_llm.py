"""Export a Hugging Face causal LM as a libpipe decoder skeleton (the decoder contract: see
libpipe.decoders).

    python -m libpipe.export_llm HF_MODEL_DIR OUT.pt [--max-seq-len L] [--max-batch S] [--dtype fp32|bf16|fp16]
                                 [--cache-dtype fp32|bf16|fp16]

reads HF_MODEL_DIR/config.json (Llama, Qwen2, Mistral, GPT-2), builds the decoder with caches for S
sequences (slots) of up to L tokens each, scripts it and saves it without weights: parameters on
the meta device, named as in the Hugging Face checkpoint, so that

    pipe ... OUT.pt --weights HF_MODEL_DIR/model.safetensors          (or model.safetensors.index.json)

loads them unchanged (a tied head included). The rotary frequencies and the caches are
non-persistent buffers, which no checkpoint holds: the skeleton keeps them with their data, the
caches as zero-stride placeholders (a few bytes each), which libpipe allocates in the stage that
owns each layer: 2 x layers x S x kv_heads x L x head_dim x dtype size bytes in all (printed).

OUT ending in .pt2 writes the decoder as a torch.export program instead (libpipe's exported-program
front-end, run by LibTorch's nativert; libpipe.decoders.export_decoder: B and T dynamic from 1, the
contract's checks as aten._assert_async nodes), traced with fake tensors (nothing of the model's
size is allocated) and saved with an empty (0-byte) record for every parameter and cache: libpipe
loads the parameters from --weights (a tied head is one record under both names) and allocates
zeros for the caches, which the program writes in place; the rotary frequencies keep their data.

--dtype defaults to the checkpoint's (config.json `dtype` / `torch_dtype`, else fp32): libpipe
refuses weights whose dtype differs from the skeleton's unless a session dtype converts them.
--cache-dtype (default: --dtype) stores the KV caches in another dtype, e.g. bf16 for a float32
model: half the cache's memory and half the bytes attention reads per token, each key and value
rounded once when written (greedy tokens may then part from float32's at near ties:
bench/RESULTS.md reports how often). A session dtype converts the caches with the weights.

From Python: export_llm(model_dir, out, max_seq_len=..., max_batch=..., dtype=..., cache_dtype=...)
returns the eager decoder it saved (nn.Module, weights uninitialised).
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch

from .decoders import build_decoder, config_dtype
from .decoders.make import _DTYPES
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


def export_llm(model_dir, out, *, max_seq_len=None, max_batch=DEFAULT_MAX_BATCH, dtype=None, cache_dtype=None):
    """Writes the skeleton of the decoder for model_dir's config.json to `out`. max_seq_len
    defaults to the config's max_position_embeddings; dtype ("fp32" | "bf16" | "fp16" or a
    torch.dtype) to the checkpoint's; cache_dtype (the same choices) to dtype. ValueError for
    what cannot be exported (the message says why). Returns the eager decoder."""
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
    if isinstance(cache_dtype, str):
        if cache_dtype not in _DTYPES:
            raise ValueError(f"cache_dtype {cache_dtype!r} is not one of fp32, bf16, fp16")
        cache_dtype = _DTYPES[cache_dtype]
    # Nothing big is made here: the weights are on the meta device, the caches placeholders.
    decoder = build_decoder(
        config,
        int(max_seq_len),
        int(max_batch),
        dtype,
        weights_device="meta",
        placeholder_caches=True,
        cache_dtype=cache_dtype,
    )
    if os.fspath(out).endswith(".pt2"):
        save_exported_skeleton(decoder, os.fspath(out))
        return decoder
    scripted = torch.jit.script(decoder)
    try:
        save_skeleton(scripted, os.fspath(out), module=decoder)
    except (OSError, RuntimeError) as e:  # TorchScript's writer raises RuntimeError for a bad path
        raise ValueError(f"cannot write {os.fspath(out)}: {e}") from None
    return decoder


def _is_skeleton_tensor(t):
    """A parameter on the meta device or a placeholder cache (a tensor covering more elements
    than it stores): what a skeleton holds no data for."""
    return t.is_meta or t.untyped_storage().nbytes() < t.numel() * t.element_size()


def _swap_tensors(decoder, make):
    """Replaces every skeleton tensor of `decoder` (parameters and buffers, tied ones by one
    object) with make(tensor); returns (the originals to restore, the names replaced)."""
    made, originals, names = {}, [], set()
    for prefix, mod in decoder.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for name, t in list(table.items()):
                if t is None or not _is_skeleton_tensor(t):
                    continue
                if id(t) not in made:
                    new = make(t)
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
                originals.append((table, name, t))
                table[name] = made[id(t)]
                names.add(f"{prefix}.{name}" if prefix else name)
    return originals, names


def _placeholder(t):
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def save_exported_skeleton(decoder, out):
    """Writes the decoder (meta weights, placeholder caches: as build_decoder makes them for a
    skeleton) as a torch.export program (libpipe.decoders.export_decoder) to `out`, a .pt2 archive
    whose records for the parameters and the caches are empty (0 bytes), so that its size does not
    grow with the model's: libpipe loads the weights from the checkpoint (--weights; a tied head
    is one record under both names, which the checkpoint's one tensor fills) and allocates zeros
    for a tensor the program writes in place with no data in the archive (the caches). The
    rotary frequencies keep their data. Nothing of the model's size is allocated: the program is
    traced with fake tensors standing for the weights and caches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .decoders import export_decoder

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        originals, names = _swap_tensors(decoder, lambda t: torch.empty(t.shape, dtype=t.dtype))
    try:
        program = export_decoder(decoder)
    finally:
        for table, name, t in originals:
            table[name] = t
    # torch.export.save writes each tensor's storage: placeholders instead of the fake tensors (a
    # few bytes each, one per tied group), whose records are then emptied.
    placeholders = {}

    def placeholder(t):
        if id(t) not in placeholders:
            new = _placeholder(t)
            placeholders[id(t)] = (
                torch.nn.Parameter(new, requires_grad=False) if isinstance(t, torch.nn.Parameter) else new
            )
        return placeholders[id(t)]

    for table in (program.state_dict, program.constants):
        for name, t in table.items():
            if name in names:
                table[name] = placeholder(t)
    folder, name = os.path.split(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {out}: {folder} is not a folder")
    try:
        # A folder of its own beside `out`: the archive's top folder is its file's stem, so the
        # file is written under out's own name there, then moved: a reader never sees half of it.
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=folder) as tmp:
            saved = os.path.join(tmp, "saved", name)
            os.mkdir(os.path.dirname(saved))
            with warnings.catch_warnings():
                # "No complete tensor found in the group!": a placeholder's storage is smaller than it.
                warnings.filterwarnings("ignore", message="No complete tensor found")
                torch.export.save(program, saved)
            skeleton = os.path.join(tmp, name)
            _empty_records(saved, skeleton, names)
            os.replace(skeleton, out)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot write {out}: {e}") from None


def _empty_records(source, out, names):
    """Copies the .pt2 archive `source` to `out` with the records of the tensors `names` (by
    fully qualified name, in the weights and constants configs) empty and their metadata
    contiguous (a placeholder was saved with zero strides)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter

    configs = ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json")
    with PT2ArchiveReader(source) as reader:
        records = {r: reader.read_bytes(r) for r in reader.get_file_names()}
    emptied = set()
    for path in configs:
        config = json.loads(records[path])
        folder = path.rsplit("/", 1)[0]
        for fqn, entry in config["config"].items():
            if fqn not in names:
                continue
            meta = entry["tensor_meta"]
            sizes = [d["as_int"] for d in meta["sizes"]]
            strides, step = [], 1
            for size in reversed(sizes):
                strides.insert(0, {"as_int": step})
                step *= max(size, 1)
            meta["strides"] = strides
            meta["storage_offset"] = {"as_int": 0}
            emptied.add(f"{folder}/{entry['path_name']}")
        records[path] = json.dumps(config).encode()
    with PT2ArchiveWriter(out) as writer:
        for record, data in records.items():
            if record.startswith(".data/"):
                continue  # the writer's own (version, serialization id)
            writer.write_bytes(record, b"" if record in emptied else data)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m libpipe.export_llm",
        description="Export a Hugging Face causal LM (Llama, Qwen2, Mistral, GPT-2) as a libpipe decoder skeleton "
        "whose weights load from the model's own checkpoint.",
    )
    parser.add_argument("model_dir", help="Hugging Face model folder (config.json)")
    parser.add_argument("out", help="the skeleton to write (.pt: TorchScript; .pt2: a torch.export program)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="cache length per sequence (tokens)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="cache slots (sequences at once)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: the checkpoint's")
    parser.add_argument(
        "--cache-dtype", choices=["fp32", "bf16", "fp16"], default=None, help="the KV caches' (default: --dtype)"
    )
    args = parser.parse_args(argv)
    try:
        decoder = export_llm(
            args.model_dir,
            args.out,
            max_seq_len=args.max_seq_len,
            max_batch=args.max_batch,
            dtype=args.dtype,
            cache_dtype=args.cache_dtype,
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
