"""Exporting a model as a torch.export program (`.pt2`) that libpipe can split and run.

libpipe's second front-end loads the archives `torch.export.save` writes, cuts them by module path
(`--split-at model.layers.1:begin`, from each node's nn_module_stack) or at `pipe_split()`
markers (kept as `pipe.split.default` nodes), and runs each stage with LibTorch's native runtime
for exported programs (nativert), with no Python at run time. An arbitrary ExportedProgram is not
always runnable there; `export_program` makes one that is, or says why it cannot:

    import libpipe
    ep = libpipe.export_program(model, (input_ids,), path="model.pt2")
    # pipe run model.pt2 --split-at model.layers.1:begin --input in.safetensors --output out.safetensors

What it does, and why:
- eval mode and `torch.no_grad()`: inference only. Under grad mode, a `@torch.no_grad()` method
  (Hugging Face Llama's rotary embedding) becomes a `wrap_with_set_grad_enabled` higher-order node,
  which libpipe inlines when it loads the program; under no_grad it is plain ATen nodes already.
- No `run_decompositions()`: the graph stays at the level torch.export records, so in-place
  writes (a cache written with `copy_`) stay in place, pipe_split() markers survive, and the nodes
  keep the module paths the split points name.
- Dim 0 of every tensor argument is one shared dynamic dimension `batch` with min 1
  (`dynamic_batch=True`): libpipe cuts each call into micro-batches, which may be uneven and as
  small as one row. (`Dim.AUTO` would give min 2, and an example batch of 1 would make export
  specialize the program to one row, so that is refused.) Other dynamic dimensions, e.g. the
  sequence length, come from `dynamic_shapes`.
- Outputs must be a tensor, or tuples / lists / dicts of tensors: nativert cannot rebuild other
  pytree types (a Hugging Face `ModelOutput` fails to load with "Unknown pytree node type"), and
  libpipe names outputs `output`, `output.0`, `output.<key>`.
"""

import inspect
import os

import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

__all__ = ["export_program"]

# Containers libpipe (and nativert) can take apart: the outputs' pytree node types.
_OUTPUT_CONTAINERS = (tuple, list, dict)


def export_program(model, example_args, example_kwargs=None, *, dynamic_batch=True, dynamic_shapes=None, path=None):
    """Exports `model` (an nn.Module) for libpipe with torch.export and returns the ExportedProgram;
    with `path`, also saves it there with torch.export.save (a `.pt2` archive for `pipe` and
    `libpipe.Model.load`).

    example_args / example_kwargs: an example call of `model.forward`, with a batch of at least 2
        rows when dynamic_batch is true.
    dynamic_batch: make dim 0 of every tensor argument one shared dynamic dimension `batch`
        (min 1). Give an argument without a batch dimension as `dynamic_shapes={"arg": None}`.
    dynamic_shapes: more dynamic dimensions, in torch.export's form keyed by argument name, e.g.
        `{"input_ids": {1: Dim.DYNAMIC}}` for the sequence length; merged with the batch dimension
        (an entry for dim 0 replaces it; `None` for a dimension or a whole argument makes it
        static). A named `Dim("seq")` fails on Hugging Face models in torch 2.11 (export cannot
        prove a guard of their mask code: "Constraints violated (seq)!"); Dim.DYNAMIC works.

    Raises ValueError for what libpipe cannot run: an example batch of 1 with dynamic_batch,
    tensor arguments whose dim 0 differ, and outputs that are not tensors or tuples / lists /
    dicts of tensors.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export_program exports an nn.Module, not {type(model).__name__}")
    if not isinstance(example_args, tuple):
        example_args = (example_args,) if isinstance(example_args, torch.Tensor) else tuple(example_args)
    example_kwargs = dict(example_kwargs or {})
    model.eval()

    named = _arguments_by_name(model, example_args, example_kwargs)
    shapes = _dynamic_shapes(named, dynamic_batch, dynamic_shapes or {})

    with torch.no_grad():
        program = torch.export.export(model, example_args, example_kwargs, dynamic_shapes=shapes)

    _check_outputs(program)
    if path is not None:
        _save_atomically(program, path)
    return program


def _arguments_by_name(model, args, kwargs):
    """{name: value} of the example call, in forward's parameter order (torch.export keys
    dynamic_shapes by these names)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"the example arguments do not fit {type(model).__name__}.forward: {e}") from None
    return dict(bound.arguments)


def _dynamic_shapes(named, dynamic_batch, extra):
    unknown = set(extra) - set(named)
    if unknown:
        raise ValueError(
            f"dynamic_shapes names {sorted(unknown)}, which are not arguments of this call "
            f"(the arguments are {list(named)})"
        )
    if not dynamic_batch:
        # torch.export's own form: only the arguments the caller named.
        return {name: extra.get(name) for name in named} if extra else None

    # One Dim object for every argument: torch.export then knows the batch sizes are equal, and
    # a mismatch is a clear error here instead of a constraint violation inside export.
    batch = Dim("batch", min=1)
    shapes, batch_sizes = {}, {}
    for name, value in named.items():
        if name in extra and extra[name] is None:
            shapes[name] = None  # the caller made it static
            continue
        shapes[name] = _merge(name, value, extra.get(name), batch, batch_sizes)

    sizes = set(batch_sizes.values())
    if len(sizes) > 1:
        listed = ", ".join(f"{n}: {s}" for n, s in batch_sizes.items())
        raise ValueError(
            f"with dynamic_batch=True, dim 0 of every tensor argument is the batch, but the example "
            f"arguments differ there ({listed}); give the arguments without a batch dimension as "
            f"dynamic_shapes={{name: None}}, or pass dynamic_batch=False and your own dynamic_shapes"
        )
    if sizes == {1}:
        raise ValueError(
            "the example batch has 1 row: torch.export would specialize the program to batch 1 and "
            "libpipe could not cut it into micro-batches; give an example batch of at least 2 rows "
            "(or pass dynamic_batch=False for a fixed-size program)"
        )
    return shapes


def _merge(name, value, extra, batch, batch_sizes):
    """The dynamic_shapes entry of one argument: {0: batch} for each tensor with a dim 0, merged
    with the caller's entry, following the argument's structure (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if extra is not None and not isinstance(extra, dict):
            extra = dict(enumerate(extra))  # torch.export's other form: one entry per dimension
        spec = {0: batch} if value.dim() > 0 else {}
        spec.update(extra or {})
        if spec.get(0) is batch:
            batch_sizes[name] = value.shape[0]
        spec = {dim: d for dim, d in spec.items() if d is not None}
        return spec or None
    if isinstance(value, (tuple, list)):
        parts = extra if isinstance(extra, (tuple, list)) else [None] * len(value)
        merged = [_merge(f"{name}[{i}]", v, e, batch, batch_sizes) for i, (v, e) in enumerate(zip(value, parts))]
        return type(value)(merged) if isinstance(value, tuple) else merged
    if isinstance(value, dict):
        parts = extra if isinstance(extra, dict) else {}
        return {k: _merge(f"{name}[{k!r}]", v, parts.get(k), batch, batch_sizes) for k, v in value.items()}
    return extra  # ints, floats, None: torch.export's own rules


def _check_outputs(program):
    """Refuses outputs libpipe cannot name or nativert cannot rebuild."""
    out_spec = program.call_spec.out_spec
    bad = _foreign_container(out_spec)
    if bad is not None:
        what = f"{bad.__module__}.{bad.__qualname__}"
        hint = ""
        if any(c.__name__ == "ModelOutput" for c in bad.__mro__):
            hint = " (a Hugging Face ModelOutput: return .logits or a tuple/dict of tensors)"
        raise ValueError(
            f"the model returns a {what}{hint}; libpipe runs models whose output is a tensor or "
            "tuples / lists / dicts of tensors: wrap the model so that forward returns one"
        )
    output = next(n for n in program.graph.nodes if n.op == "output")
    for leaf in pytree.tree_leaves(output.args[0]):
        value = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"the model returns a {type(value).__name__} ({value!r}) among its outputs; libpipe "
                "runs models whose outputs are all tensors: return it as a tensor, or drop it"
            )


def _foreign_container(spec):
    """The first pytree node type in `spec` that is not a tensor leaf, tuple, list or dict."""
    if spec.is_leaf():
        return None
    if spec.type not in _OUTPUT_CONTAINERS:
        return spec.type
    for child in spec.children():
        found = _foreign_container(child)
        if found is not None:
            return found
    return None


def _save_atomically(program, path):
    """torch.export.save to a temporary name beside `path`, then a rename: a reader never sees a
    half-written archive."""
    path = os.fspath(path)
    # Ends in .pt2, as torch.export.save expects; hidden, so that nothing globbing *.pt2 takes it.
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp.pt2")
    try:
        torch.export.save(program, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
