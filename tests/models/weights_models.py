"""Generates the stage-weights fixtures: the Llama-style decoder exported as a skeleton (weights
on the meta device) with its weights in safetensors checkpoints, and broken checkpoints for
every error the loader must report.

    python weights_models.py OUT_DIR

writes to OUT_DIR:
  llama.skeleton.pt                 TinyLlama's code, parameters and buffers on meta
  llama.full.pt                     the same model with its weights (to override)
  llama.inputs.safetensors, llama.expected.safetensors
  sharded/llama.safetensors.index.json + 2 shards    tied head stored once (as embed.weight)
  prefixed.safetensors              one file, every name under "model."
  missing/...index.json             a tensor left out
  shape.safetensors                 one tensor with the wrong shape
  dtype.safetensors                 float16 instead of float32
  lost_shard/...index.json          names a shard that does not exist
  corrupt/...index.json             a shard whose header is cut short
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from libpipe import save_checkpoint, save_skeleton
from split_models import TinyLlama


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = TinyLlama().eval()
    inputs = {"input_ids": torch.randint(0, 256, (4, 12))}
    with torch.no_grad():
        expected = model(**inputs)
    ts = torch.jit.trace(model, tuple(inputs.values()))
    ts.save(os.path.join(out, "llama.full.pt"))
    save_skeleton(ts, os.path.join(out, "llama.skeleton.pt"))
    save_file(inputs, os.path.join(out, "llama.inputs.safetensors"))
    save_file({"output": expected}, os.path.join(out, "llama.expected.safetensors"))

    sizes = [t.numel() * t.element_size() for t in ts.state_dict().values()]
    total, largest = sum(sizes), max(sizes)
    for d in ("sharded", "missing", "lost_shard", "corrupt"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    index = save_checkpoint(ts, os.path.join(out, "sharded", "llama.safetensors"), max_shard_bytes=total // 2 + largest)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    assert "lm_head.weight" not in weight_map and "embed.weight" in weight_map, "the tied head is stored once"
    assert len(set(weight_map.values())) == 2, "two shards"

    state = {k: v for k, v in ts.state_dict().items() if k != "lm_head.weight"}
    save_file({"model." + k: v.contiguous() for k, v in state.items()}, os.path.join(out, "prefixed.safetensors"))

    # A tensor missing: same shards, the index forgets one name.
    for f in os.listdir(os.path.join(out, "sharded")):
        if f.endswith(".safetensors"):
            shutil.copy(os.path.join(out, "sharded", f), os.path.join(out, "missing", f))
            shutil.copy(os.path.join(out, "sharded", f), os.path.join(out, "lost_shard", f))
            shutil.copy(os.path.join(out, "sharded", f), os.path.join(out, "corrupt", f))
    broken = dict(weight_map)
    del broken["layers.1.mlp.up_proj.weight"]
    json.dump({"weight_map": broken}, open(os.path.join(out, "missing", "llama.safetensors.index.json"), "w"))
    lost = dict(weight_map)
    lost["norm.weight"] = "llama-00009-of-00009.safetensors"
    json.dump({"weight_map": lost}, open(os.path.join(out, "lost_shard", "llama.safetensors.index.json"), "w"))
    json.dump({"weight_map": weight_map}, open(os.path.join(out, "corrupt", "llama.safetensors.index.json"), "w"))
    shard2 = sorted(f for f in os.listdir(os.path.join(out, "corrupt")) if f.endswith(".safetensors"))[1]
    with open(os.path.join(out, "corrupt", shard2), "r+b") as f:
        f.write((10**9).to_bytes(8, "little"))  # a header length far beyond the file

    wrong_shape = dict(state)
    wrong_shape["norm.weight"] = torch.ones(65)
    save_file({k: v.contiguous() for k, v in wrong_shape.items()}, os.path.join(out, "shape.safetensors"))
    wrong_dtype = dict(state)
    wrong_dtype["norm.weight"] = state["norm.weight"].half()
    save_file({k: v.contiguous() for k, v in wrong_dtype.items()}, os.path.join(out, "dtype.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
