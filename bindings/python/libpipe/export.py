"""Exporting a model in two parts, for libpipe's per-stage weight loading:

- save_skeleton(script_module, path, module=None, keep=()): the TorchScript code with every
  parameter and buffer on the meta device (a file of a few kB whatever the model's size), except
  those a checkpoint will not hold (the module's non-persistent buffers, or `keep`), which keep
  their data. Tied weights stay tied.
- save_checkpoint(module, path, max_shard_bytes=None): the weights as safetensors, one file, or
  (with max_shard_bytes) shards plus a Hugging Face style `<path>.index.json`; a tensor shared
  under several names (a tied head) is stored once.

    ts = torch.jit.trace(model.eval(), example_inputs)
    libpipe.save_checkpoint(ts, "out/model.safetensors", max_shard_bytes=2 << 30)
    libpipe.save_skeleton(ts, "out/model.skeleton.pt", module=model)
    # pipe run out/model.skeleton.pt --weights out/model.safetensors.index.json ...
"""

import json
import os

import torch
from safetensors.torch import save_file


def _storage_key(t):
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _named_tensors(module):
    """(name, tensor) for every parameter and buffer, tied ones under each of their names."""
    out = []
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    out.append((f"{prefix}.{name}" if prefix else name, t))
    seen, unique = set(), []
    for name, t in out:
        if name not in seen:
            seen.add(name)
            unique.append((name, t))
    return unique


def save_checkpoint(module, path, max_shard_bytes=None):
    """Writes the module's weights to `path` (a .safetensors file), or with max_shard_bytes to
    shards `<stem>-00001-of-0000N.safetensors` plus `<path>.index.json`. Returns the file to
    give libpipe (the file, or the index)."""
    stored, seen = {}, set()
    for name, t in _named_tensors(module):
        key = _storage_key(t)
        if key in seen:
            continue  # a tied tensor is stored once, under its first name
        seen.add(key)
        stored[name] = t.detach().to("cpu").contiguous()
    if not max_shard_bytes:
        save_file(stored, path)
        return path
    shards, current, size = [], {}, 0
    for name, t in stored.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        shards.append(current)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, file)
        for name, t in shard.items():
            weight_map[name] = os.path.basename(file)
            total += t.numel() * t.element_size()
    index = path + ".index.json"
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return index


def _unstored_buffers(module):
    """Names of `module`'s non-persistent buffers: registered, but left out of its state_dict, so
    no checkpoint written from it (Hugging Face's included) stores them."""
    stored = set(module.state_dict().keys())
    return [name for name, _ in module.named_buffers(remove_duplicate=False) if name not in stored]


def save_skeleton(script_module, path, *, module=None, keep=()):
    """Saves a copy-free skeleton of a TorchScript module: the same code, every parameter and
    buffer replaced by a meta tensor of the same shape and dtype (tied ones by one shared meta
    tensor). The module itself is left as it was.

    A checkpoint need not hold every tensor: Hugging Face's never store non-persistent buffers
    (Llama's `rotary_emb.inv_freq`, BERT's `embeddings.position_ids`), and TorchScript does not
    record which buffers those are. Tensors kept here stay in the skeleton with their data, and
    libpipe uses that data for any tensor the checkpoint lacks:

    - module: the nn.Module that `script_module` was traced or scripted from; its non-persistent
      buffers (in named_buffers() but not in state_dict()) are kept. Raises ValueError if one of
      them is not in `script_module` (a different module, or names under another prefix).
    - keep: names of further parameters or buffers of `script_module` to keep (ValueError for a
      name it does not have).

    A tensor tied to a kept one is kept too. Without these, a tensor missing from the checkpoint
    is an error when libpipe loads the stage."""
    names = {name for name, _ in _named_tensors(script_module)}
    if isinstance(keep, str):
        keep = [keep]
    wanted = list(keep)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ValueError(
            f"save_skeleton: keep names {unknown}, which are not parameters or buffers of the "
            f"TorchScript module (names are dotted paths such as 'model.rotary_emb.inv_freq')"
        )
    if module is not None:
        buffers = _unstored_buffers(module)
        foreign = [n for n in buffers if n not in names]
        if foreign:
            raise ValueError(
                f"save_skeleton: the module's non-persistent buffers {foreign} are not in the "
                f"TorchScript module; pass the nn.Module it was traced or scripted from"
            )
        wanted += buffers
    # Kept by storage, so that a tie between a kept tensor and another name is not broken.
    wanted = set(wanted)
    kept = {_storage_key(t) for name, t in _named_tensors(script_module) if name in wanted}
    originals, metas = [], {}
    for _, mod in script_module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for name, t in list(table.items()):
                if t is None:
                    continue
                key = _storage_key(t)
                if key in kept:
                    continue
                if key not in metas:
                    meta = torch.empty_like(t, device="meta")
                    metas[key] = torch.nn.Parameter(meta, requires_grad=False) if kind == "_parameters" else meta
                originals.append((table, name, t))
                table[name] = metas[key]
    try:
        script_module.save(path)
    finally:
        for table, name, t in originals:
            table[name] = t
