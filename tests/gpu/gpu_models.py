"""The models of the GPU suite, built fresh for each run: the eager module (the reference, run by
PyTorch itself on the GPU), its TorchScript file, how to cut it, and its inputs. The same models
as the CPU suites (tests/models): the seed models of PyTorch's pipelining tests, the Llama-style
model and Hugging Face's Llama."""

import os
from dataclasses import dataclass, field

import seed_models
import split_models
import torch
from split_models import flatten


@dataclass
class Case:
    path: str  # the TorchScript file
    module: torch.nn.Module  # eager, on the CPU
    inputs: dict  # forward argument name -> CPU tensor
    split: list = field(default_factory=list)  # split points; empty: the pipe_split() markers
    stages: int = 2

    def split_args(self):
        """The SPLIT arguments of the pipe CLI."""
        return [a for p in self.split for a in ("--split-at", p)]

    def eager_on_gpu(self, device="cuda:0"):
        """{output name: CPU tensor} of the eager module run by PyTorch on `device`."""
        module = self.module.to(device)
        try:
            with torch.no_grad():
                out = module(**{k: v.to(device) for k, v in self.inputs.items()})
        finally:
            self.module.to("cpu")
        return {k: v.cpu() for k, v in flatten(out).items()}


def _seed_inputs():
    return {"x": torch.randn(seed_models.BATCH, seed_models.D), "y": torch.randn(seed_models.BATCH, seed_models.D)}


# name -> (builder, form, inputs, split points, stages)
MODELS = {
    "example_code.traced": (seed_models.ExampleCode, "traced", _seed_inputs, [], 4),
    "example_code.scripted": (seed_models.ExampleCode, "scripted", _seed_inputs, [], 4),
    "multi_mlp.traced": (seed_models.MultiMLP, "traced", _seed_inputs, [], 4),
    "param_alias.scripted": (seed_models.ModelWithParamAlias, "scripted", _seed_inputs, [], 2),
    "tuple_output.traced": (seed_models.TupleOutput, "traced", _seed_inputs, [], 2),
    "tiny_llama": (split_models.TinyLlama, "traced", split_models.tokens, ["layers.0:end", "layers.1:end"], 3),
    "hf_llama": (split_models.hf_llama, "traced", split_models.tokens, ["model.layers.0:end"], 2),
}


def build(name, out_dir):
    make, form, make_inputs, split, stages = MODELS[name]
    torch.manual_seed(0)
    module = make().eval()
    inputs = make_inputs()
    with torch.no_grad():
        ts = torch.jit.script(module) if form == "scripted" else torch.jit.trace(module, tuple(inputs.values()))
    path = os.path.join(out_dir, name + ".pt")
    ts.save(path)
    return Case(path, module, inputs, split, stages)


def alternating(stages, first):
    """cpu,cuda:0,cpu,... (first="cpu") or cuda:0,cpu,cuda:0,... (first="cuda:0")."""
    other = "cuda:0" if first == "cpu" else "cpu"
    return ",".join(first if s % 2 == 0 else other for s in range(stages))
