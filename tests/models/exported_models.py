"""Generates the torch.export fixtures: the seed and split-test models exported with
libpipe.export_program as `.pt2` archives (torch.export.save), with inputs and eager PyTorch's
reference outputs.

    python exported_models.py OUT_DIR [NAME...]

writes, for each model NAME (all of them, or those named):
    OUT_DIR/NAME.pt2                    the exported program (batch dimension dynamic, min 1)
    OUT_DIR/NAME.inputs.safetensors     one tensor per forward argument, named as in forward
    OUT_DIR/NAME.expected.safetensors   eager PyTorch's output: output / output.<i> / output.<key>
    OUT_DIR/NAME.b3.inputs.safetensors  the same arguments with a batch of 3 (another size than the
    OUT_DIR/NAME.b3.expected.safetensors  main inputs; hf_llama_dyn: another sequence length too)
    OUT_DIR/NAME.state_dict.txt         the eager model's state_dict keys, one per line

The models are the classes of seed_models.py (with pipe_split() markers, kept in the programs as
`pipe.split.default` nodes) and split_models.py, plus two Hugging Face models only here: hf_qwen2
(a tiny Qwen2ForCausalLM returning its logits) and hf_llama_dyn (split_models' HF Llama with the
sequence length dynamic as well). Every expected output comes from a fresh copy of the model, so
the stateful state_across_cut's references are each one call from its initial state.

Every model listed exports. crossing_values is here for its dict output (output.mixed,
output.first); the int, float and bool it sends across its marker are static sizes in an export,
so they become constants. Not here, and why (torch.export 2.11 fails on them):
- seed_models' marker_in_branch, and split_models' control_flow and call_inside_branch: an `if`
  on a tensor's value, "GuardOnDataDependentSymNode: Could not guard on data-dependent
  expression Eq(u0, 1)" (torch.cond would be the exported form).
- seed_models' slow_loop: `range(int(n))` of a tensor n, "GuardOnDataDependentSymNode: Could not
  extract specialized integer from data-dependent expression u0".
- seed_models' gated: not tried; it calls the test gate operator (tests/gate), which the
  TorchScript tests load, and holds stages for tests of the scheduler, not of the front-end.
- split_models' nograd_scripted: exports, but is nograd_layers again for an exported program
  (its `with torch.no_grad()` blocks vanish under export_program's own no_grad).

inside_autocast exports with its autocast block (disabled) as a `higher_order.wrap_with_autocast`
node around a subgraph, which LibTorch 2.11's nativert cannot run; libpipe inlines it when the program
loads. bf16_autocast's block is on: libpipe inlines it with autocast's casts as explicit nodes. The *_grad
fixtures are exported in
grad mode, as users call torch.export.export, with HF's rotary embeddings as wrap_with_set_grad_enabled
regions.

state_across_cut writes a buffer of 4 rows through a view of the batch's size, so its program's
batch dimension has max 4 (the model's own limit), not just min 1.
"""

import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import seed_models
import split_models
import torch
from safetensors.torch import save_file
from split_models import flatten, hf_gpt2, hf_llama, resnet18, tiny_causal_lm  # hf_llama: tests import it from here too
from torch.export import Dim

from libpipe import export_program

BATCH = 4  # the main inputs' batch (seed models: seed_models.BATCH)
OTHER_BATCH = 3  # the .b3 files' batch
SEQ, OTHER_SEQ = 12, 7  # hf_llama_dyn's sequence lengths (main, .b3)


def hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return tiny_causal_lm(Qwen2Config, Qwen2ForCausalLM)


def hf_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return tiny_causal_lm(MistralConfig, MistralForCausalLM)


class Bf16Autocast(torch.nn.Module):
    """An autocast region that is on: its linear runs in bfloat16 (autocast's lower-precision list) and its cat
    of that bfloat16 result with a float32 tensor in float32 (the promote list). libpipe makes the casts explicit
    when the program loads."""

    def __init__(self, width=32):
        super().__init__()
        self.lin0, self.lin1 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.lin0(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin1(x)
            y = torch.cat([h, x], dim=-1)
        return y.float()


def pair(batch, width=seed_models.D):
    return {"x": torch.randn(batch, width), "y": torch.randn(batch, width)}


def features(*shape):
    return lambda batch: {"x": torch.randn(batch, *shape)}


def tokens(batch, seq=SEQ):
    return {"input_ids": torch.randint(0, 256, (batch, seq))}


@dataclass
class Fixture:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int], Dict[str, torch.Tensor]]  # batch -> arguments
    batch: int = BATCH
    # Arguments of the .b3 files (default: `inputs(OTHER_BATCH)`).
    other_inputs: Optional[Callable[[], Dict[str, torch.Tensor]]] = None
    dynamic_shapes: dict = field(default_factory=dict)  # export_program's, besides the batch
    # Exported as most users call torch.export.export: in grad mode, where a `@torch.no_grad()` method (HF's
    # rotary embeddings) becomes a wrap_with_set_grad_enabled region. Otherwise libpipe.export_program,
    # which exports under no_grad.
    grad_mode: bool = False


MODELS = {
    # seed_models: markers, a parameter read by two stages, aliases, a tuple, two markers in a row.
    "example_code": Fixture(seed_models.ExampleCode, pair, batch=seed_models.BATCH),
    "multi_mlp": Fixture(seed_models.MultiMLP, pair, batch=seed_models.BATCH),
    "param_alias": Fixture(seed_models.ModelWithParamAlias, pair, batch=seed_models.BATCH),
    "tuple_output": Fixture(seed_models.TupleOutput, pair, batch=seed_models.BATCH),
    "repeated_marker": Fixture(seed_models.RepeatedMarker, pair, batch=seed_models.BATCH),
    # split_models
    "nograd_layers": Fixture(split_models.NoGradLayers, features(64), batch=8),
    "nested": Fixture(split_models.NestedContainers, features(16)),
    "device_constant": Fixture(split_models.DeviceConstant, features(16)),
    # The cache buffer has 4 rows and is written through narrow(0, 0, batch): batch <= 4.
    "state_across_cut": Fixture(
        split_models.StateAcrossCut, features(8), dynamic_shapes={"x": {0: Dim("batch", min=1, max=4)}}
    ),
    "crossing_values": Fixture(split_models.CrossingValues, features(32)),
    "inside_autocast": Fixture(split_models.InsideAutocast, features(32)),
    "tiny_llama": Fixture(split_models.TinyLlama, tokens),
    "resnet18": Fixture(resnet18, features(3, 64, 64)),
    "gpt2": Fixture(hf_gpt2, tokens),
    "hf_llama": Fixture(hf_llama, tokens),
    "hf_qwen2": Fixture(hf_qwen2, tokens),
    "hf_mistral": Fixture(hf_mistral, tokens),
    # The same, exported in grad mode.
    "hf_llama_grad": Fixture(hf_llama, tokens, grad_mode=True),
    "hf_qwen2_grad": Fixture(hf_qwen2, tokens, grad_mode=True),
    "hf_mistral_grad": Fixture(hf_mistral, tokens, grad_mode=True),
    "gpt2_grad": Fixture(hf_gpt2, tokens, grad_mode=True),
    "nograd_layers_grad": Fixture(split_models.NoGradLayers, features(64), batch=8, grad_mode=True),
    "multi_mlp_grad": Fixture(seed_models.MultiMLP, pair, batch=seed_models.BATCH, grad_mode=True),
    "bf16_autocast": Fixture(Bf16Autocast, features(32)),
    "hf_llama_dyn": Fixture(
        hf_llama,
        tokens,
        other_inputs=lambda: tokens(OTHER_BATCH, OTHER_SEQ),
        # Dim.DYNAMIC, not a named Dim("seq"): with a named Dim, export 2.11 fails on a guard it
        # cannot prove from HF's mask code ("Not all values of seq ... satisfy the generated guard
        # min(16*L['input_ids'].size()[1], 32*L['input_ids'].size()[1]) == (16*...)"). The program's
        # sequence range is then [2, inf): 1 would have been specialized.
        dynamic_shapes={"input_ids": {1: Dim.DYNAMIC}},
    ),
}


def save_atomically(tensors, path):
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def eager(model, inputs):
    """The reference: a fresh copy of the model (so state written in place by one call does not
    reach the next), in eval mode, without grad."""
    with torch.no_grad():
        return flatten(copy.deepcopy(model)(**inputs))


def export_in_grad_mode(model, inputs, dynamic_shapes, path):
    """torch.export.export and torch.export.save as a user calls them, grad mode on; the batch dynamic."""
    batch = Dim("batch", min=1)
    shapes = {name: {0: batch, **dynamic_shapes.get(name, {})} for name in inputs}
    assert torch.is_grad_enabled()
    program = torch.export.export(model, tuple(inputs.values()), dynamic_shapes=shapes)
    tmp = f"{path[: -len('.pt2')]}.{os.getpid()}.tmp.pt2"  # torch.export.save wants the suffix
    torch.export.save(program, tmp)
    os.replace(tmp, path)


def generate(out_dir, only=()):
    unknown = set(only) - set(MODELS)
    if unknown:
        sys.exit(f"exported_models.py: no model named {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    os.makedirs(out_dir, exist_ok=True)
    for name, fx in MODELS.items():
        if only and name not in only:
            continue
        start = time.monotonic()
        torch.manual_seed(0)
        model = fx.build().eval()
        pristine = copy.deepcopy(model)  # export leaves the weights alone, but eager calls may not
        inputs = fx.inputs(fx.batch)
        other = fx.other_inputs() if fx.other_inputs else fx.inputs(OTHER_BATCH)
        out = os.path.join(out_dir, name)
        if fx.grad_mode:
            export_in_grad_mode(model, inputs, fx.dynamic_shapes, f"{out}.pt2")
        else:
            export_program(model, tuple(inputs.values()), dynamic_shapes=fx.dynamic_shapes, path=f"{out}.pt2")
        save_atomically(inputs, f"{out}.inputs.safetensors")
        save_atomically(eager(pristine, inputs), f"{out}.expected.safetensors")
        save_atomically(other, f"{out}.b3.inputs.safetensors")
        save_atomically(eager(pristine, other), f"{out}.b3.expected.safetensors")
        with open(f"{out}.state_dict.txt.tmp", "w") as f:
            f.write("\n".join(pristine.state_dict().keys()) + "\n")
        os.replace(f"{out}.state_dict.txt.tmp", f"{out}.state_dict.txt")
        print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: exported_models.py OUT_DIR [NAME...]")
    generate(sys.argv[1], sys.argv[2:])
