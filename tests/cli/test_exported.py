"""torch.export programs (`.pt2`) through `pipe`, end to end: every fixture of
tests/models/exported_models.py split by markers, by module path and by each policy runs like eager
PyTorch (batch 4 cut 2 + 2 and batch 3 cut unevenly 2 + 1, so the programs' dynamic batch is
exercised); the plans and the split errors are those of the TorchScript twins; bad archives, models
nativert cannot run and wrong inputs are refused with one line that says why; saved stages are
ordinary exported programs (torch.export.load reads them, each holds its own weights, chained by
the plan they give the model's output); checkpoints fill the program's weights, tied heads included.

References are independent of the code under test: the fixtures' eager outputs, eager PyTorch on
models rebuilt here from exported_models' builders, torch.export.load of the saved stages, and the
TorchScript twins' plans and messages.

Where the exported plan legitimately differs from the TorchScript one:
- a tied or aliased tensor is one tensor in an exported program, named by torch.export after its
  last name (gpt2's head and embedding are `lm_head.weight`, param_alias's pair `mm_param1`), where
  TorchScript names it after its first (`transformer.wte.weight`, `mm_param0`); plans are compared
  with each tie group mapped to one name, the groups taken from the eager model;
- the exported graph has other nodes than the TorchScript one (torch.export folds the int / float /
  bool crossing_values sends into constants, keeps an autocast block as one node, traces
  tuple_output to fewer nodes), so the number of places a policy can cut, and where `params`
  cuts for crossing_values at 4 stages, differ; those plans are not compared;
- `params` counts an aliased weight once, so param_alias's 2-stage cut lands elsewhere than with
  TorchScript's two names for it.
Non-persistent buffers (HF Llama's rotary inv_freq) are buffers of the stage in both plans.
"""

import copy
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import MODELS, PIPE, SANITIZED, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file, save_file

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "models"))
import exported_models  # noqa: E402  (the fixtures' own model builders)
import seed_models  # noqa: E402
from split_models import flatten  # noqa: E402

from libpipe import export_program, pipe_split, save_checkpoint  # noqa: E402  (also registers pipe::split for torch.export.load)

TOL = 1e-5
SPLIT = ["--split-at", "model.layers.0:end"]  # hf_llama's two stages


def fixture(name):
    return os.path.join(MODELS, "exported", name)


def inputs_of(name, variant=""):
    return fixture(f"{name}{variant}.inputs.safetensors")


def expected_of(name, variant=""):
    return load_file(fixture(f"{name}{variant}.expected.safetensors"))


def assert_outputs_equal(got, want, tol=TOL):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol)


def run(tmp_path, model, *args, inputs, microbatches=2):
    out = tmp_path / "out.safetensors"
    if out.exists():
        out.unlink()
    result = pipe("run", model, *args, "--input", inputs, "--output", out, "--microbatches", microbatches)
    return result, out


def stages_word(n):
    return f"as {n} stage{'s' if n != 1 else ''} "


def assert_runs_like_eager(tmp_path, name, *split, stages, variant="", microbatches=2, tol=TOL):
    result, out = run(
        tmp_path, fixture(f"{name}.pt2"), *split, inputs=inputs_of(name, variant), microbatches=microbatches
    )
    assert result.returncode == 0, result.stderr
    # The split happened: a one-stage run would equal eager as well.
    assert stages_word(stages) in result.stdout, result.stdout
    assert_outputs_equal(load_file(out), expected_of(name, variant), tol)


def plan_of(model, *split):
    result = pipe("split", model, *split, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def pipe_all(commands, jobs=2, timeout=300):
    """Independent `pipe` commands, `jobs` at a time (the machine has two cores); their results in order."""
    results, running, pending = [None] * len(commands), [], list(enumerate(commands))
    while pending or running:
        while pending and len(running) < jobs:
            i, args = pending.pop(0)
            proc = subprocess.Popen([PIPE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running.append((i, args, proc))
        i, args, proc = running.pop(0)
        out, err = proc.communicate(timeout=timeout)
        results[i] = subprocess.CompletedProcess(args, proc.returncode, out, err)
    return results


def run_both(args_a, args_b):
    return pipe_all([args_a, args_b])


def assert_all_run_like_eager(tmp_path, name, cases, tol=TOL):
    """Runs `name`.pt2 once per case (split args, stages, inputs variant, micro-batches), two at a
    time, and checks each against the fixture's eager output; reports every case that differs."""
    commands, outs = [], []
    for i, (split, _, variant, microbatches) in enumerate(cases):
        outs.append(tmp_path / f"out{i}.safetensors")
        commands.append(
            ["run", fixture(f"{name}.pt2"), *split, "--input", inputs_of(name, variant)]
            + ["--output", outs[-1], "--microbatches", microbatches]
        )
    failures = []
    for (split, stages, variant, microbatches), result, out in zip(cases, pipe_all(commands), outs):
        case = f"{name} {' '.join(map(str, split))} inputs{variant or '.b4'} --microbatches {microbatches}"
        try:
            assert result.returncode == 0, result.stderr
            # The split happened: a one-stage run would equal eager as well.
            assert stages_word(stages) in result.stdout, result.stdout
            assert_outputs_equal(load_file(out), expected_of(name, variant), tol)
        except AssertionError as e:
            failures.append(f"{case}: {e}")
    assert not failures, "\n".join(failures)


# Under the sanitizers (conftest.SANITIZED) the model matrices below run on a few models that reach every
# code path (markers, module paths, each policy, tuples and dicts, HF decoders, processes).
UNDER_SANITIZERS = {"example_code", "tuple_output", "hf_llama"}


def sampled(names):
    return [n for n in names if n in UNDER_SANITIZERS] if SANITIZED else list(names)


# ---- 1. every runnable fixture runs like eager ----

MARKER_STAGES = {
    "example_code": 4,
    "multi_mlp": 4,
    "param_alias": 2,
    "tuple_output": 2,
    "device_constant": 2,
    "crossing_values": 2,
    "multi_mlp_grad": 4,  # exported in grad mode, as users call torch.export.export
}


@pytest.mark.parametrize("name", sampled(MARKER_STAGES))
def test_markers_run_like_eager(tmp_path, name):
    # Batch 4 cut 2 + 2, batch 3 cut 2 + 1, and (two of them) batch 3 in micro-batches of one row.
    runs = [("", 2), (".b3", 2)] + ([(".b3", 3)] if name in ("example_code", "crossing_values") else [])
    cases = [([], MARKER_STAGES[name], v, mb) for v, mb in runs]
    assert_all_run_like_eager(tmp_path, name, cases)


# (model, split, stages), run on the batch-3 inputs cut 2 + 1.
PATH_SPLITS = [
    ("example_code", ["--split-at", "lin1:begin", "--split-at", "lin2:begin"], 3),
    ("multi_mlp", ["--split-at", "block1:begin", "--split-at", "block2:begin", "--split-at", "block3:begin"], 4),
    # The aliased module's second call is recorded under its second name.
    ("param_alias", ["--split-at", "lin1:begin"], 2),
    ("tuple_output", ["--split-at", "lin:end"], 2),
    ("nograd_layers", ["--split-at", "layers.0:end"], 2),
    ("nograd_layers", ["--split-at", "layers.1:begin"], 2),
    ("nograd_layers", ["--split-at", "scaler:begin"], 3),
    ("nograd_layers", ["--split-at", "scaler@0:end"], 2),
    ("nested", ["--split-at", "stack.1.0:begin", "--split-at", "heads.a:end"], 3),
    ("device_constant", ["--split-at", "lin0:end"], 2),
    ("crossing_values", ["--split-at", "lin:end"], 2),
    ("tiny_llama", ["--split-at", "layers.0:end", "--split-at", "layers.1:end"], 3),
    ("resnet18", ["--split-at", "layer1:end", "--split-at", "layer2:end", "--split-at", "layer3:end"], 4),
    ("gpt2", ["--split-at", "transformer.h.1:end"], 2),
    ("gpt2", ["--split-at", "transformer.h.0:end", "--split-at", "transformer.h.1:end"], 3),
    ("hf_llama", ["--split-at", "model.layers.0:end"], 2),
    ("hf_qwen2", ["--split-at", "model.layers.1:begin"], 2),
    ("hf_mistral", ["--split-at", "model.layers.1:begin"], 2),
    # Exported in grad mode: their no_grad methods are wrap_with_set_grad_enabled regions, inlined at load
    # (HF's rotary embeddings; nograd_layers' scaler, cut at its own boundaries).
    ("hf_llama_grad", ["--split-at", "model.layers.0:end"], 2),
    ("hf_qwen2_grad", ["--split-at", "model.layers.1:begin"], 2),
    ("hf_mistral_grad", ["--split-at", "model.layers.1:begin"], 2),
    ("gpt2_grad", ["--split-at", "transformer.h.0:end", "--split-at", "transformer.h.1:end"], 3),
    ("nograd_layers_grad", ["--split-at", "layers.0:end"], 2),
    ("nograd_layers_grad", ["--split-at", "scaler:begin"], 3),
    ("nograd_layers_grad", ["--split-at", "scaler@0:end"], 2),
    # A disabled autocast region, inlined: cut before it and inside it.
    ("inside_autocast", ["--split-at", "lin0:end"], 2),
    ("inside_autocast", ["--split-at", "lin1:end"], 2),
]


def split_id(value):
    return " ".join(value) if isinstance(value, list) else str(value)


@pytest.mark.parametrize("name", sampled(sorted({name for name, _, _ in PATH_SPLITS})))
def test_module_path_splits_run_like_eager(tmp_path, name):
    cases = [(split, stages, ".b3", 2) for n, split, stages in PATH_SPLITS if n == name]
    assert_all_run_like_eager(tmp_path, name, cases)


def test_dynamic_sequence_length_at_both_lengths(tmp_path):
    # hf_llama_dyn's main inputs are 4 x 12, its .b3 inputs 3 x 7: one program, both shapes.
    assert load_file(inputs_of("hf_llama_dyn", ".b3"))["input_ids"].shape == (3, 7)
    split = ["--split-at", "model.layers.0:end"]
    cases = [(split, 2, "", 2), (split, 2, ".b3", 2), (split, 2, ".b3", 3)]
    assert_all_run_like_eager(tmp_path, "hf_llama_dyn", cases)


# The most stages (up to 4) each model has places for: (uniform, params and time).
MOST_STAGES = {
    "example_code": (2, 4),
    "multi_mlp": (4, 4),
    "param_alias": (2, 4),
    "tuple_output": (3, 3),
    "nograd_layers": (2, 4),
    "nested": (2, 3),
    "device_constant": (2, 4),
    "crossing_values": (2, 4),
    "tiny_llama": (3, 4),
    "resnet18": (4, 4),
    "gpt2": (3, 4),
    "hf_llama": (2, 4),
    "hf_qwen2": (2, 4),
    "hf_llama_dyn": (2, 4),
    "hf_mistral": (2, 4),
    "hf_llama_grad": (2, 4),
    "hf_qwen2_grad": (2, 4),
    "hf_mistral_grad": (2, 4),
    "gpt2_grad": (3, 4),
    "inside_autocast": (3, 3),
}


def policy_cases(name):
    """(policy, stages): one stage, and the most stages each policy can make, except time at 3
    (a different cut from params' 4); multi_mlp sweeps 2 to 4 stages with each. The marker models'
    one-stage runs are left out: their batch of 4 runs by markers."""
    uniform, other = MOST_STAGES[name]
    cases = [("uniform", uniform), ("params", other), ("time", min(3, other))]
    if name not in MARKER_STAGES:  # the marker models run their batch of 4 above
        cases.insert(0, ("params", 1))
    if name == "multi_mlp":
        cases += [(p, n) for p in ("uniform", "params", "time") for n in (2, 3, 4) if (p, n) not in cases]
    return cases


@pytest.mark.parametrize("name", sampled(MOST_STAGES))
def test_policies_run_like_eager(tmp_path, name):
    # One stage on the main inputs; more on the batch of 3 cut 2 + 1 (the time policy measures on it).
    cases = [(["--stages", n, "--policy", policy], n, "" if n == 1 else ".b3", 2) for policy, n in policy_cases(name)]
    assert_all_run_like_eager(tmp_path, name, cases)


def test_policies_stop_at_the_places_to_cut():
    for name in ("hf_llama", "tuple_output"):
        uniform, other = MOST_STAGES[name]
        assert_one_line_error(
            pipe("split", fixture(f"{name}.pt2"), "--stages", uniform + 1, "--policy", "uniform"),
            f"cannot make {uniform + 1} stages with policy uniform",
            f"at most {uniform}",
            "PIPE_ERR_SPLIT",
        )
    assert_one_line_error(
        pipe("split", fixture("tuple_output.pt2"), "--stages", 4, "--policy", "params"),
        "cannot make 4 stages",
        "only 3 places",
        "PIPE_ERR_SPLIT",
    )


PROCESS_RUNS = [
    ("example_code", [], 4, "", 2),
    ("hf_llama", ["--split-at", "model.layers.0:end"], 2, ".b3", 2),
    ("gpt2", ["--split-at", "transformer.h.0:end", "--split-at", "transformer.h.1:end"], 3, ".b3", 2),
    ("multi_mlp", [], 4, ".b3", 4),
    ("hf_llama_grad", ["--split-at", "model.layers.0:end"], 2, ".b3", 2),
]


@pytest.mark.parametrize(
    "name,split,stages,variant,processes", [r for r in PROCESS_RUNS if r[0] in sampled([r[0]])], ids=split_id
)
def test_stages_in_several_processes_run_like_eager(tmp_path, name, split, stages, variant, processes):
    assert_runs_like_eager(tmp_path, name, *split, "--processes", processes, stages=stages, variant=variant)


class WritesAnActivationInPlace(torch.nn.Module):
    """Stage 1 applies relu_ to stage 0's output, which stage 2 reads again: in the exported graph (and
    the trace) the later read is of the in-place op's result, so stage 2 gets it from stage 1."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        a = self.l1(x)
        pipe_split()
        b = self.l2(a)
        a.relu_()
        pipe_split()
        return self.l3(b) + a


@pytest.mark.parametrize("processes", [1, 3])
def test_an_activation_written_in_place_reaches_later_stages_written(tmp_path, processes):
    torch.manual_seed(0)
    model, x = WritesAnActivationInPlace().eval(), torch.randn(4, 8)
    with torch.no_grad():
        want = model(x)
    export_program(model, (x,), path=tmp_path / "m.pt2")
    torch.jit.save(torch.jit.trace(model, (x,)), tmp_path / "m.pt")
    inputs = write_inputs(tmp_path, x=x)
    for path in (tmp_path / "m.pt2", tmp_path / "m.pt"):
        result, out = run(tmp_path, path, "--processes", processes, inputs=inputs)
        assert result.returncode == 0, result.stderr
        assert stages_word(3) in result.stdout
        torch.testing.assert_close(load_file(out)["output"], want, rtol=TOL, atol=TOL)


def test_state_written_in_place_carries_over_micro_batches(tmp_path):
    # state_across_cut counts its calls in a buffer and writes a cache through a view of the
    # batch's size. Cut before the writes, each micro-batch is one call of the stateful stage: the
    # result is eager PyTorch called on the micro-batches in order, from the initial state.
    # The reference is computed here, so first check that rebuilding the fixture's model gives its
    # weights: bit for bit, since both come from the same seeded generator with no arithmetic that
    # depends on threads. (Its output is not bit-exact across processes: another thread count
    # rounds differently; what crosses processes is compared within TOL.)
    torch.manual_seed(0)  # exported_models' seed for every fixture
    model = exported_models.MODELS["state_across_cut"].build().eval()
    saved = torch.export.load(fixture("state_across_cut.pt2")).state_dict
    rebuilt = model.state_dict()
    assert sorted(saved) == sorted(k for k in rebuilt if k in saved) and saved
    for name, tensor in saved.items():
        torch.testing.assert_close(rebuilt[name], tensor, rtol=0, atol=0, msg=f"weight {name}")
    x = load_file(inputs_of("state_across_cut"))["x"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected_of("state_across_cut")["output"], rtol=TOL, atol=TOL)
    for microbatches in (1, 2):
        torch.manual_seed(0)
        model = exported_models.MODELS["state_across_cut"].build().eval()
        with torch.no_grad():
            want = torch.cat([model(part) for part in x.tensor_split(microbatches)])
        result, out = run(
            tmp_path,
            fixture("state_across_cut.pt2"),
            "--split-at",
            "store.proj:end",
            inputs=inputs_of("state_across_cut"),
            microbatches=microbatches,
        )
        assert result.returncode == 0, result.stderr
        torch.testing.assert_close(load_file(out)["output"], want, rtol=TOL, atol=TOL)


def test_an_autocast_region_that_is_on_computes_in_its_dtypes(tmp_path):
    # nativert cannot run wrap_with_autocast: libpipe inlines the region with autocast's casts made explicit
    # (bf16_autocast: its linear in bfloat16, the cat after it promoted to float32). Every split computes what
    # eager code under torch.autocast computes: close to it within bfloat16's rounding (eager ran in another
    # process, under other threads), and, on average, much closer to it than the same model without autocast is,
    # which a region run without the casts would equal.
    name = "bf16_autocast"
    runs = [
        ["--split-at", "lin0:end"],
        ["--split-at", "lin1:end"],
        ["--stages", 2, "--policy", "uniform"],
        ["--stages", 2, "--policy", "params"],
        ["--stages", 2, "--policy", "time"],
        ["--split-at", "lin0:end", "--processes", 2],
    ]
    program = torch.export.load(fixture(f"{name}.pt2"))
    weights = {k: v.float() for k, v in program.state_dict.items()}
    for variant in ("",) if SANITIZED else ("", ".b3"):
        x = load_file(inputs_of(name, variant))["x"]
        want = expected_of(name, variant)["output"]
        with torch.no_grad():
            h = torch.nn.functional.linear(x, weights["lin0.weight"], weights["lin0.bias"])
            without = torch.cat([torch.nn.functional.linear(h, weights["lin1.weight"], weights["lin1.bias"]), h], -1)
        assert (without - want).abs().mean() > 0, "the fixture's autocast changes nothing"
        for split in runs:
            for microbatches in (2,) if SANITIZED else (1, 2):
                result, out = run(
                    tmp_path, fixture(f"{name}.pt2"), *split, inputs=inputs_of(name, variant), microbatches=microbatches
                )
                assert result.returncode == 0, result.stderr
                assert stages_word(2) in result.stdout, result.stdout
                got = load_file(out)["output"]
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                assert (got - want).abs().mean() < 0.25 * (without - want).abs().mean(), (split, microbatches)


def test_the_regions_are_gone_from_the_saved_stages(tmp_path):
    # The saved stages of a grad-mode export are programs without higher-order operators (they run like eager
    # chained by their plan: SAVED below).
    def hops(path):
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith("models/model.json"))
            return re.findall(r'"torch\.ops\.higher_order\.(\w+)"', z.read(name).decode())

    assert hops(fixture("hf_llama_grad.pt2")) == ["wrap_with_set_grad_enabled"]
    result = pipe("split", fixture("hf_llama_grad.pt2"), *SPLIT, "--save-stages", tmp_path)
    assert result.returncode == 0, result.stderr
    stages = sorted(tmp_path.glob("*.pt2"))
    assert len(stages) == 2 and all(hops(s) == [] for s in stages), stages


# ---- 2. the same plan as the TorchScript twin ----

TWINS = {
    "example_code": "example_code.traced.pt",
    "multi_mlp": "multi_mlp.traced.pt",
    "param_alias": "param_alias.scripted.pt",
    "tuple_output": "tuple_output.traced.pt",
    "nograd_layers": "split/nograd_layers.pt",
    "nested": "split/nested_traced.pt",
    "device_constant": "split/device_constant.pt",
    "crossing_values": "split/crossing_values.pt",
    "state_across_cut": "split/state_across_cut.pt",
    "tiny_llama": "split/tiny_llama.pt",
    "resnet18": "split/resnet18.pt",
    "gpt2": "split/gpt2.pt",
    "hf_llama": "split/hf_llama.pt",
}

BUILDERS = {
    "example_code": seed_models.ExampleCode,
    "multi_mlp": seed_models.MultiMLP,
    "param_alias": seed_models.ModelWithParamAlias,
    "tuple_output": seed_models.TupleOutput,
}


@functools.lru_cache(maxsize=None)
def tie_names(name):
    """name -> one name for every name of a tensor that the eager model shares under several
    names (a tied head, an aliased parameter); the others map to themselves."""
    build = BUILDERS.get(name) or exported_models.MODELS[name].build
    torch.manual_seed(0)
    model = build()
    groups = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for leaf, t in getattr(module, kind).items():
                if t is not None:
                    groups.setdefault(id(t), set()).add(f"{prefix}.{leaf}" if prefix else leaf)
    return {n: min(g) for g in groups.values() for n in g}


def canonical_stages(plan, name):
    names = tie_names(name)
    return [
        ({names.get(p, p) for p in s["parameters"]}, {names.get(b, b) for b in s["buffers"]}) for s in plan["stages"]
    ]


# Compared at the policies' most stages, except where the graphs differ (module docstring).
POLICY_TWINS = (
    "example_code",
    "multi_mlp",
    "tuple_output",
    "nograd_layers",
    "nested",
    "device_constant",
    "tiny_llama",
    "resnet18",
    "gpt2",
    "hf_llama",
)


def plan_splits(name):
    splits = [[]] if name in MARKER_STAGES else []
    splits += [split for n, split, _ in PATH_SPLITS if n == name]
    if name == "state_across_cut":
        splits.append(["--split-at", "store.proj:end"])
    if name in POLICY_TWINS:
        uniform, other = MOST_STAGES[name]
        splits += [["--stages", uniform, "--policy", "uniform"], ["--stages", other, "--policy", "params"]]
    return splits


@pytest.mark.parametrize("name", sampled(TWINS))
def test_plans_equal_the_torchscript_twins(name):
    splits = plan_splits(name)
    commands = []
    for split in splits:
        commands += [["split", os.path.join(MODELS, TWINS[name]), *split, "--json"]]
        commands += [["split", fixture(f"{name}.pt2"), *split, "--json"]]
    results = pipe_all(commands)
    failures = []
    for split, ts, ex in zip(splits, results[::2], results[1::2]):
        try:
            assert ts.returncode == 0, ts.stderr
            assert ex.returncode == 0, ex.stderr
            ts_plan, ex_plan = json.loads(ts.stdout), json.loads(ex.stdout)
            assert ex_plan["num_stages"] == ts_plan["num_stages"]
            assert ex_plan["num_stages"] > 1
            assert canonical_stages(ex_plan, name) == canonical_stages(ts_plan, name)
            if name != "param_alias":  # TorchScript counts an alias's bytes under each of its names
                assert [s["param_bytes"] for s in ex_plan["stages"]] == [s["param_bytes"] for s in ts_plan["stages"]]
        except AssertionError as e:
            failures.append(f"{name} {' '.join(map(str, split)) or '(markers)'}: {e}")
    assert not failures, "\n".join(failures)


def test_tied_and_aliased_names_are_the_last_ones():
    # What the canonical comparison above maps: the exported plan names a tie by its last name.
    ex = plan_of(fixture("gpt2.pt2"), "--split-at", "transformer.h.1:end")
    ts = plan_of(os.path.join(MODELS, "split/gpt2.pt"), "--split-at", "transformer.h.1:end")
    for ex_stage, ts_stage in zip(ex["stages"], ts["stages"]):
        assert "lm_head.weight" in ex_stage["parameters"] and "transformer.wte.weight" not in ex_stage["parameters"]
        assert "transformer.wte.weight" in ts_stage["parameters"]
    ex = plan_of(fixture("param_alias.pt2"))
    assert [s["parameters"] for s in ex["stages"]] == [["mm_param1", "lin1.weight", "lin1.bias"]] * 2


# ---- 3. the same messages for the same mistakes ----


def normalized(message):
    return re.sub(r"\S+\.py:\d+", "<where>", message)


SAME_MISTAKES = [
    (
        "hf_llama",
        ["--split-at", "model.layers.9:end"],
        ["names module 'model.layers.9'", "nearest module paths: model.layers.0, model.layers.1, model.layers"],
    ),
    ("tiny_llama", ["--split-at", "layers.7:end"], ["names module 'layers.7'", "nearest module paths: layers.0"]),
    ("hf_llama", ["--split-at", "model.layers.0"], ["has no ':begin' or ':end'"]),
    ("hf_llama", ["--split-at", "model.embed_tokens:begin"], ["would leave stage 0 empty"]),
    ("hf_llama", ["--split-at", "lm_head:end"], ["would leave stage after it empty"]),
    ("tiny_llama", ["--split-at", "layers.0@3:end"], ["called 1 time"]),
    ("nograd_layers", ["--split-at", "scaler:end"], ["would leave stage after it empty"]),
    ("hf_llama", ["--stages", "3", "--policy", "uniform"], ["cannot make 3 stages", "model.layers has 2 layers"]),
    ("tiny_llama", ["--stages", "4", "--policy", "uniform"], ["cannot make 4 stages", "layers has 3 layers"]),
    ("hf_llama", ["--stages", "2", "--policy", "time"], ["example inputs"]),
    ("state_across_cut", ["--split-at", "head:begin"], ["'store.cache' is updated in place", "stages 0 and 1"]),
]


@pytest.mark.parametrize("name,split,needles", SAME_MISTAKES, ids=split_id)
def test_same_mistake_same_message_as_torchscript(name, split, needles):
    ts, ex = run_both(["split", os.path.join(MODELS, TWINS[name]), *split], ["split", fixture(f"{name}.pt2"), *split])
    assert_one_line_error(ex, *needles, "PIPE_ERR_")
    assert_one_line_error(ts, *needles)
    assert normalized(ex.stderr) == normalized(ts.stderr)


def test_too_many_stages_for_params_reads_alike():
    # The graphs differ in how many places they have (22 for the program, 23 for TorchScript), not in the message.
    pattern = (
        r"cannot make 40 stages: the model has only (\d+) places to put stage boundaries between \(ask for at most \1\)"
    )
    ts, ex = run_both(
        ["split", os.path.join(MODELS, TWINS["tiny_llama"]), "--stages", 40, "--policy", "params"],
        ["split", fixture("tiny_llama.pt2"), "--stages", 40, "--policy", "params"],
    )
    for result in (ts, ex):
        assert_one_line_error(result, "PIPE_ERR_SPLIT")
        assert re.search(pattern, result.stderr), result.stderr


def test_repeated_marker_is_refused_naming_both_markers(tmp_path):
    lines, first = inspect.getsourcelines(seed_models.RepeatedMarker.forward)
    markers = [first + i for i, line in enumerate(lines) if "pipe_split()" in line]
    assert len(markers) == 2
    ts, ex = run_both(
        ["split", os.path.join(MODELS, "repeated_marker.traced.pt")], ["split", fixture("repeated_marker.pt2")]
    )
    assert_one_line_error(ex, "stage 1 would be empty", *(f"seed_models.py:{n}" for n in markers), "PIPE_ERR_SPLIT")
    assert normalized(ex.stderr) == normalized(ts.stderr)
    result, out = run(tmp_path, fixture("repeated_marker.pt2"), inputs=inputs_of("repeated_marker"))
    assert_one_line_error(result, "stage 1 would be empty", "PIPE_ERR_SPLIT")
    assert not out.exists()


# ---- 4. archives libpipe cannot run ----


def rewrite_archive(src, dst, drop=(), edit=None):
    """A copy of the .pt2 `src` without the records in `drop`, with edit[record](bytes) applied;
    record names are relative to the archive's top folder."""
    edit = edit or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for entry in zin.namelist():
            record = entry.split("/", 1)[1]
            if record in drop:
                continue
            data = zin.read(entry)
            zout.writestr(entry, edit[record](data) if record in edit else data)
    return dst


def weight_record(src, fqn):
    with zipfile.ZipFile(src) as z:
        top = z.namelist()[0].split("/")[0]
        config = json.loads(z.read(f"{top}/data/weights/model_weights_config.json"))["config"]
    return "data/weights/" + config[fqn]["path_name"]


def test_truncated_program(tmp_path):
    data = open(fixture("example_code.pt2"), "rb").read()
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(data[: len(data) // 2])
    assert_one_line_error(pipe("split", truncated), "zip archive is damaged", "PIPE_ERR_INVALID_FORMAT")


def test_compiled_package_is_not_a_program(tmp_path):
    # What an AOTInductor package looks like to a reader: archive_format, compiled code, no models/.
    package = tmp_path / "compiled.pt2"
    with zipfile.ZipFile(package, "w") as z:
        z.writestr("compiled/archive_format", "pt2")
        z.writestr("compiled/archive_version", "0")
        z.writestr("compiled/data/aotinductor/model/model.so", b"\x7fELF")
    assert_one_line_error(
        pipe("split", package), "compiled code", "torch.export.save", "ExportedProgram", "PIPE_ERR_INVALID_FORMAT"
    )


def test_program_json_that_is_not_json(tmp_path):
    bad = rewrite_archive(
        fixture("example_code.pt2"), tmp_path / "bad.pt2", edit={"models/model.json": lambda _: b"not json {"}
    )
    assert_one_line_error(pipe("split", bad), "models/model.json is not valid JSON", "PIPE_ERR_INVALID_FORMAT")


def test_program_of_another_schema(tmp_path):
    def schema_7(data):
        program = json.loads(data)
        program["schema_version"]["major"] = 7
        return json.dumps(program).encode()

    old = rewrite_archive(fixture("example_code.pt2"), tmp_path / "old.pt2", edit={"models/model.json": schema_7})
    assert_one_line_error(pipe("split", old), "schema 7", "schema 8", "PIPE_ERR_INVALID_FORMAT")


def edit_program(change):
    """An edit for rewrite_archive: `change(program)` applied to models/model.json's JSON."""

    def edit(data):
        program = json.loads(data)
        change(program)
        return json.dumps(program).encode()

    return {"models/model.json": edit}


def _drop_nodes(p):
    del p["graph_module"]["graph"]["nodes"]


def _empty_input_spec(p):
    p["graph_module"]["signature"]["input_specs"][0] = {}


def _input_without_arg(p):
    del p["graph_module"]["graph"]["nodes"][0]["inputs"][0]["arg"]


def _dtype_as_text(p):
    p["graph_module"]["graph"]["tensor_values"]["x"]["dtype"] = "float32"  # an input's: the schema has a number


@pytest.mark.parametrize(
    "change,needle",
    [
        (_drop_nodes, "has no graph nodes list"),
        (_empty_input_spec, "signature entry that is not one kind with its fields"),
        (_input_without_arg, "node input without an argument"),
        (_dtype_as_text, "is not a torch.export program as written by torch.export.save"),
    ],
    ids=["no_nodes", "empty_input_spec", "input_without_arg", "dtype_as_text"],
)
def test_program_json_of_another_shape_is_refused(tmp_path, change, needle):
    # Hand-made or damaged programs: refused with the file named, never read out of bounds.
    bad = rewrite_archive(fixture("example_code.pt2"), tmp_path / "bad.pt2", edit=edit_program(change))
    assert_one_line_error(pipe("split", bad), "models/model.json", needle, "PIPE_ERR_INVALID_FORMAT")


def _region(p):
    """hf_llama_grad's set_grad_enabled call (its rotary embedding)."""
    return next(n for n in p["graph_module"]["graph"]["nodes"] if n["target"].endswith("wrap_with_set_grad_enabled"))


def _another_higher_order_op(p):
    _region(p)["target"] = "torch.ops.higher_order.invoke_subgraph"


def _an_operand_too_few(p):
    _region(p)["inputs"].pop()


def _a_result_too_few(p):
    _region(p)["inputs"][1]["arg"]["as_graph"]["graph"]["outputs"].pop()


@pytest.mark.parametrize(
    "change,needles",
    [
        (_another_higher_order_op, ["higher-order operator invoke_subgraph", "cannot run", "PIPE_ERR_UNSUPPORTED"]),
        (_an_operand_too_few, ["wrap_with_set_grad_enabled region", "passes 1 operands", "PIPE_ERR_INVALID_FORMAT"]),
        (_a_result_too_few, ["wrap_with_set_grad_enabled region", "has 2 outputs", "PIPE_ERR_INVALID_FORMAT"]),
    ],
    ids=["another_op", "operand_missing", "result_missing"],
)
def test_a_region_that_cannot_be_inlined_is_refused_at_load(tmp_path, change, needles):
    # Before any stage is built, naming the region and the model code it came from.
    bad = rewrite_archive(fixture("hf_llama_grad.pt2"), tmp_path / "bad.pt2", edit=edit_program(change))
    assert_one_line_error(pipe("split", bad), "cannot load model", "modeling_llama.py", *needles)


def _weights_config_edit(fqn, change):
    def edit(data):
        config = json.loads(data)
        change(config["config"][fqn]["tensor_meta"])
        return json.dumps(config).encode()

    return {"data/weights/model_weights_config.json": edit}


def _huge_stride(meta):
    meta["strides"][0] = {"as_int": 2**62}


def _negative_size(meta):
    meta["sizes"][0] = {"as_int": -3}


@pytest.mark.parametrize(
    "change,needle",
    [(_huge_stride, "overflow"), (_negative_size, "negative size or stride")],
    ids=["huge_stride", "negative_size"],
)
def test_weight_metadata_outside_its_record_is_refused(tmp_path, change, needle):
    bad = rewrite_archive(
        fixture("example_code.pt2"), tmp_path / "bad.pt2", edit=_weights_config_edit("lin2.weight", change)
    )
    result, out = run(tmp_path, bad, inputs=inputs_of("example_code"))
    assert_one_line_error(result, "tensor 'lin2.weight' (stage 3)", needle, "PIPE_ERR_INVALID_FORMAT")
    assert not out.exists()


def test_program_without_a_weight_takes_it_from_a_checkpoint(tmp_path):
    record = weight_record(fixture("example_code.pt2"), "lin2.weight")
    with zipfile.ZipFile(fixture("example_code.pt2")) as z:
        top = z.namelist()[0].split("/")[0]
        lin2 = torch.frombuffer(bytearray(z.read(f"{top}/{record}")), dtype=torch.float32).reshape(512, 512)
    bare = rewrite_archive(fixture("example_code.pt2"), tmp_path / "bare.pt2", drop=(record,))
    result, out = run(tmp_path, bare, inputs=inputs_of("example_code"))
    assert_one_line_error(
        result, "tensor 'lin2.weight' (stage 3) has no data", "--weights", "PIPE_ERR_INVALID_ARGUMENT"
    )
    save_file({"lin2.weight": lin2.clone()}, tmp_path / "lin2.safetensors")
    result, out = run(tmp_path, bare, "--weights", tmp_path / "lin2.safetensors", inputs=inputs_of("example_code"))
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), expected_of("example_code"))


def test_short_weight_record_names_the_tensor(tmp_path):
    record = weight_record(fixture("example_code.pt2"), "lin2.weight")
    short = rewrite_archive(fixture("example_code.pt2"), tmp_path / "short.pt2", edit={record: lambda d: d[:100]})
    result, _ = run(tmp_path, short, inputs=inputs_of("example_code"))
    assert_one_line_error(result, "lin2.weight", "PIPE_ERR_INVALID_FORMAT")


class Counter(torch.nn.Module):
    """Writes a buffer in place (as a cache would)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) + self.calls


def tiny_model_output():
    from transformers.modeling_outputs import BaseModelOutput

    class ReturnsModelOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return BaseModelOutput(last_hidden_state=self.lin(x))

    return ReturnsModelOutput()


@pytest.fixture(scope="module")
def exported_here(tmp_path_factory):
    """Programs exported here with plain torch.export: a buffer writer, as libpipe wants it and
    functionalized by run_decompositions(); a model returning a Hugging Face ModelOutput."""
    folder = tmp_path_factory.mktemp("exported_here")
    torch.manual_seed(0)
    counter = Counter().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = copy.deepcopy(counter)(x)  # one call from calls = 0 (export writes the buffer too)
        program = torch.export.export(counter, (x,))
    torch.export.save(program, folder / "counter.pt2")
    torch.export.save(program.run_decompositions(), folder / "decomposed.pt2")
    save_file({"x": x}, folder / "counter.inputs.safetensors")
    save_file({"output": want}, folder / "counter.expected.safetensors")
    with torch.no_grad():
        torch.export.save(torch.export.export(tiny_model_output().eval(), (x,)), folder / "model_output.pt2")
    return folder


def test_functionalized_buffer_write_is_refused(tmp_path, exported_here):
    decomposed = torch.export.load(exported_here / "decomposed.pt2")
    assert [s.kind.name for s in decomposed.graph_signature.output_specs] == ["BUFFER_MUTATION", "USER_OUTPUT"]
    assert_one_line_error(
        pipe("split", exported_here / "decomposed.pt2"),
        "buffer 'calls'",
        "without run_decompositions()",
        "PIPE_ERR_UNSUPPORTED",
    )
    # The same model exported without run_decompositions() keeps the write in place, and runs.
    result, out = run(
        tmp_path, exported_here / "counter.pt2", inputs=exported_here / "counter.inputs.safetensors", microbatches=1
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), load_file(exported_here / "counter.expected.safetensors"))


def test_model_output_return_is_refused_at_load(exported_here):
    with pytest.raises(ValueError, match="ModelOutput"):  # export_program refuses to write it at all
        export_program(tiny_model_output(), (torch.randn(2, 8),))
    assert_one_line_error(
        pipe("split", exported_here / "model_output.pt2"),
        "cannot load model",
        "BaseModelOutput",
        ".logits",
        "tuple, list or dict",
        "PIPE_ERR_UNSUPPORTED",
    )


# ---- 5. inputs the program was not exported for ----


def write_inputs(tmp_path, **tensors):
    path = tmp_path / "in.safetensors"
    save_file(tensors, path)
    return path


WRONG_INPUTS = [
    (
        "example_code",
        lambda: {"x": torch.randn(4, 512, dtype=torch.float64), "y": torch.randn(4, 512)},
        ["input 'x'", "dtype Double", "exported for Float"],
    ),
    (
        "example_code",
        lambda: {"x": torch.randn(4, 512, 1), "y": torch.randn(4, 512)},
        ["input 'x'", "3 dimensions", "takes 2"],
    ),
    (
        "example_code",
        lambda: {"x": torch.randn(4, 100), "y": torch.randn(4, 512)},
        ["input 'x'", "size 100 in dimension 1", "fixed size of 512"],
    ),
    (
        "example_code",
        lambda: {"x": torch.randn(4, 512), "y": torch.randn(3, 512)},
        ["input 'y'", "3 rows", "'x' has 4"],
    ),
    ("state_across_cut", lambda: {"x": torch.randn(5, 8)}, ["input 'x'", "size 5 in dimension 0", "1 to 4"]),
    (
        "hf_llama",
        lambda: {"input_ids": torch.randint(0, 256, (2, 12), dtype=torch.int32)},
        ["input 'input_ids'", "dtype Int", "exported for Long"],
    ),
    (
        "hf_llama",
        lambda: {"input_ids": torch.randint(0, 256, (2, 7))},
        ["input 'input_ids'", "size 7 in dimension 1", "fixed size of 12"],
    ),
    (
        "hf_llama_dyn",
        lambda: {"input_ids": torch.randint(0, 256, (2, 1))},
        ["input 'input_ids'", "size 1 in dimension 1", "2 or more"],
    ),
]


@pytest.mark.parametrize(
    "name,make,needles",
    WRONG_INPUTS,
    ids=["dtype", "rank", "fixed_size", "batch_mismatch", "batch_range", "ids_dtype", "fixed_seq", "seq_range"],
)
def test_wrong_inputs_are_refused_naming_the_input(tmp_path, name, make, needles):
    result, out = run(tmp_path, fixture(f"{name}.pt2"), inputs=write_inputs(tmp_path, **make()), microbatches=1)
    assert_one_line_error(result, *needles, "PIPE_ERR_INPUT")
    assert not out.exists()


def test_time_policy_checks_its_example_inputs(tmp_path):
    inputs = write_inputs(tmp_path, x=torch.randn(4, 512, dtype=torch.float64), y=torch.randn(4, 512))
    assert_one_line_error(
        pipe("split", fixture("example_code.pt2"), "--stages", 2, "--policy", "time", "--input", inputs),
        "input 'x'",
        "(the example inputs)",
        "PIPE_ERR_INPUT",
    )


def test_each_micro_batch_is_checked_against_the_range(tmp_path):
    # 5 rows are more than state_across_cut allows, but its micro-batches of 3 and 2 are not.
    x = torch.randn(5, 8)
    torch.manual_seed(0)
    model = exported_models.MODELS["state_across_cut"].build().eval()
    with torch.no_grad():
        want = torch.cat([model(part) for part in x.tensor_split(2)])
    result, out = run(tmp_path, fixture("state_across_cut.pt2"), inputs=write_inputs(tmp_path, x=x), microbatches=2)
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(load_file(out)["output"], want, rtol=TOL, atol=TOL)


def test_missing_input_name(tmp_path):
    result, _ = run(tmp_path, fixture("example_code.pt2"), inputs=write_inputs(tmp_path, x=torch.randn(4, 512)))
    assert_one_line_error(result, "no tensor named 'y'", "x, y")


# ---- 6. saved stages are exported programs ----

SAVED = [
    ("example_code", []),  # a skip connection from stage 0 to stage 2
    ("crossing_values", []),  # a dict output
    ("gpt2", ["--split-at", "transformer.h.0:end", "--split-at", "transformer.h.1:end"]),  # a tied head
    ("hf_llama", ["--split-at", "model.layers.0:end"]),  # a non-persistent buffer
    ("hf_llama_grad", ["--split-at", "model.layers.0:end"]),  # a set_grad_enabled region, inlined
]


def stage_tensors(program):
    """The names of a loaded program's parameters and buffers, non-persistent ones included (a
    state_dict leaves those out)."""
    names = set(program.state_dict)
    names |= {s.target for s in program.graph_signature.input_specs if s.kind.name == "BUFFER"}
    return names


def chain(folder, plan, values):
    """Runs the saved stages' .module() in order, wired by the plan; returns the last stage's
    output flattened as pipe names outputs."""
    values = dict(values)
    for stage in plan["stages"]:
        program = torch.export.load(str(folder / f"stage{stage['index']}.pt2"))
        with torch.no_grad():
            out = program.module()(*[values[i["name"]] for i in stage["inputs"]])
        if stage["index"] == plan["num_stages"] - 1:
            return flatten(out)
        for o, v in zip(stage["outputs"], out):
            values[o["name"]] = v


@pytest.mark.parametrize("name,split", SAVED, ids=split_id)
def test_saved_stages_load_hold_their_weights_and_chain_to_the_output(tmp_path, name, split):
    result = pipe("split", fixture(f"{name}.pt2"), *split, "--save-stages", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_stages"] > 1
    assert sorted(os.listdir(tmp_path)) == [f"stage{i}.pt2" for i in range(plan["num_stages"])]
    for stage in plan["stages"]:
        program = torch.export.load(str(tmp_path / f"stage{stage['index']}.pt2"))
        assert stage_tensors(program) == set(stage["parameters"]) | set(stage["buffers"])
    for variant in ("", ".b3"):  # the stages keep the dynamic batch
        got = chain(tmp_path, plan, load_file(inputs_of(name, variant)))
        assert_outputs_equal(got, expected_of(name, variant))


def save_stages(folder, name, *split):
    folder.mkdir()
    result = pipe("split", fixture(f"{name}.pt2"), *split, "--save-stages", folder, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def run_stage_with_pipe(tmp_path, folder, stage, values, microbatches=2, replicate=None):
    """`pipe run` of one saved stage on the values its plan entry takes (those named in `replicate`
    given whole to every micro-batch); returns `values` with the values it sends on (pipe writes
    them as output / output.<i>), or its flattened output."""
    inputs = write_inputs(tmp_path, **{i["name"]: values[i["name"]] for i in stage["inputs"]})
    extra = ("--replicate", replicate) if replicate else ()
    result, out = run(tmp_path, folder / f"stage{stage['index']}.pt2", *extra, inputs=inputs, microbatches=microbatches)
    assert result.returncode == 0, result.stderr
    got = load_file(out)
    if stage["outputs"][0]["to"] == "caller":
        return got
    sent = [got["output"]] if list(got) == ["output"] else [got[f"output.{i}"] for i in range(len(got))]
    assert len(sent) == len(stage["outputs"])
    return {**values, **{o["name"]: v for o, v in zip(stage["outputs"], sent)}}


def test_pipe_inspects_and_runs_saved_stages(tmp_path):
    # example_code's stages, each run by pipe on its own, chained by the plan (a skip connection
    # from stage 0 to stage 2), give the model's output.
    plan = save_stages(tmp_path / "stages", "example_code")
    assert plan["num_stages"] == 4
    values = load_file(inputs_of("example_code", ".b3"))
    for stage in plan["stages"]:
        path = tmp_path / "stages" / f"stage{stage['index']}.pt2"
        program = torch.export.load(str(path))
        shown = pipe("inspect", path)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines()[1].split()[2] == str(sum(t.numel() for t in program.state_dict.values()))
        values = run_stage_with_pipe(tmp_path, tmp_path / "stages", stage, values)
    assert_outputs_equal(values, expected_of("example_code", ".b3"))


def test_pipe_runs_the_first_stage_of_a_hf_llama(tmp_path):
    plan = save_stages(tmp_path / "stages", "hf_llama", *SPLIT)
    program = torch.export.load(str(tmp_path / "stages" / "stage0.pt2"))
    ids = load_file(inputs_of("hf_llama", ".b3"))["input_ids"]
    with torch.no_grad():
        want = program.module()(ids)
    got = run_stage_with_pipe(tmp_path, tmp_path / "stages", plan["stages"][0], {"input_ids": ids}, microbatches=1)
    for o, w in zip(plan["stages"][0]["outputs"], want):  # another process, maybe another thread count
        torch.testing.assert_close(got[o["name"]], w, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_pipe_runs_a_middle_stage_that_takes_unbatched_values(tmp_path, microbatches):
    # hf_llama's stage 1 takes the rotary cos / sin ([1, T, D], one for the whole batch) beside the
    # hidden states: --replicate gives them whole to every micro-batch.
    plan = save_stages(tmp_path / "stages", "hf_llama", *SPLIT)
    ids = load_file(inputs_of("hf_llama", ".b3"))["input_ids"]
    program = torch.export.load(str(tmp_path / "stages" / "stage0.pt2"))
    with torch.no_grad():
        values = {o["name"]: v for o, v in zip(plan["stages"][0]["outputs"], program.module()(ids))}
    values["input_ids"] = ids
    stage = plan["stages"][1]
    whole = [i["name"] for i in stage["inputs"] if values[i["name"]].shape[0] != ids.shape[0]]
    assert whole, "the stage takes no unbatched value: the test no longer tests --replicate"
    got = run_stage_with_pipe(
        tmp_path, tmp_path / "stages", stage, values, microbatches=microbatches, replicate=",".join(whole)
    )
    assert_outputs_equal(got, expected_of("hf_llama", ".b3"))


def test_only_the_stage_asked_for_is_saved(tmp_path):
    result = pipe("split", fixture("example_code.pt2"), "--save-stages", tmp_path, "--stage", 2)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["stage2.pt2"]
    program = torch.export.load(str(tmp_path / "stage2.pt2"))
    assert set(program.state_dict) == {"mm_param2"}


def test_saved_stage_keeps_its_module_paths(tmp_path):
    result = pipe("split", fixture("hf_llama.pt2"), "--split-at", "model.layers.0:end", "--save-stages", tmp_path)
    assert result.returncode == 0, result.stderr
    shown = pipe("inspect", tmp_path / "stage1.pt2")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^\s+mlp\s", shown.stdout, re.M), shown.stdout
    plan = plan_of(tmp_path / "stage1.pt2", "--split-at", "model.layers.1.mlp:begin")
    assert plan["num_stages"] == 2


# ---- 7. weights from a checkpoint ----


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """hf_llama with other random weights than the fixture's: one safetensors file, a sharded
    index, and eager outputs on the fixture's inputs."""
    folder = tmp_path_factory.mktemp("llama_checkpoint")
    torch.manual_seed(1234)
    model = exported_models.hf_llama().eval()
    save_checkpoint(model, str(folder / "llama.safetensors"))
    os.makedirs(folder / "sharded")
    index = save_checkpoint(model, str(folder / "sharded" / "llama.safetensors"), max_shard_bytes=100_000)
    assert len(json.load(open(index))["weight_map"]) > 20 and len(os.listdir(folder / "sharded")) > 3
    want = {}
    for variant in ("", ".b3"):
        with torch.no_grad():
            want[variant] = flatten(model(**load_file(inputs_of("hf_llama", variant))))
    return folder, index, want


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_checkpoint_fills_the_programs_weights(tmp_path, llama_checkpoint, sharded):
    folder, index, want = llama_checkpoint
    weights = index if sharded else folder / "llama.safetensors"
    assert (expected_of("hf_llama")["output"] - want[""]["output"]).abs().max() > 0.1  # other weights indeed
    for variant, extra in (("", []), (".b3", ["--processes", 2])):
        result, out = run(
            tmp_path,
            fixture("hf_llama.pt2"),
            *SPLIT,
            "--weights",
            weights,
            *extra,
            inputs=inputs_of("hf_llama", variant),
        )
        assert result.returncode == 0, result.stderr
        assert_outputs_equal(load_file(out), want[variant])


def test_saved_stages_hold_the_checkpoints_weights(tmp_path, llama_checkpoint):
    folder, index, want = llama_checkpoint
    result = pipe("split", fixture("hf_llama.pt2"), *SPLIT, "--weights", index, "--save-stages", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    got = chain(tmp_path, json.loads(result.stdout), load_file(inputs_of("hf_llama")))
    assert_outputs_equal(got, want[""])


def test_checkpoint_of_the_wrong_shape_names_tensor_and_stage(tmp_path, llama_checkpoint):
    folder, _, _ = llama_checkpoint
    tensors = load_file(folder / "llama.safetensors")
    tensors["model.layers.1.post_attention_layernorm.weight"] = torch.ones(65)
    save_file(tensors, tmp_path / "bad.safetensors")
    result, out = run(
        tmp_path,
        fixture("hf_llama.pt2"),
        *SPLIT,
        "--weights",
        tmp_path / "bad.safetensors",
        inputs=inputs_of("hf_llama"),
    )
    assert_one_line_error(
        result, "tensor 'model.layers.1.post_attention_layernorm.weight' (stage 1)", "has shape [65]", "PIPE_ERR_INPUT"
    )
    assert not out.exists()


def test_wrong_shape_message_equals_torchscripts(tmp_path, llama_checkpoint):
    folder, _, _ = llama_checkpoint
    tensors = load_file(folder / "llama.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 65)
    save_file(tensors, tmp_path / "bad.safetensors")
    common = [*SPLIT, "--weights", tmp_path / "bad.safetensors", "--input", inputs_of("hf_llama")]
    ts, ex = run_both(
        ["run", os.path.join(MODELS, TWINS["hf_llama"]), *common, "--output", tmp_path / "ts.safetensors"],
        ["run", fixture("hf_llama.pt2"), *common, "--output", tmp_path / "ex.safetensors"],
    )
    assert_one_line_error(ts, "expects shape [64, 64]", "has shape [64, 65]", "PIPE_ERR_INPUT")
    assert_one_line_error(ex, "PIPE_ERR_INPUT")
    assert ex.stderr == ts.stderr


class TiedLlamaBuilder:
    """A tiny Hugging Face Llama whose head is tied to its embedding (tie_word_embeddings), else
    split_models.hf_llama's config, returning its logits."""

    def __call__(self):
        return exported_models.hf_llama(tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """The tied Llama exported with export_program; a Hugging Face style checkpoint of another
    one (its state_dict without lm_head.weight, as save_pretrained writes a tied head); the
    inputs and that second model's eager output."""
    folder = tmp_path_factory.mktemp("tied_llama")
    build = TiedLlamaBuilder()
    torch.manual_seed(0)
    model = build().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = exported_models.tokens(exported_models.BATCH)["input_ids"]
    export_program(model, (ids,), path=str(folder / "tied.pt2"))
    torch.manual_seed(99)
    other = build().eval()
    state = {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}
    assert "model.embed_tokens.weight" in state and "model.rotary_emb.inv_freq" not in state
    save_file(state, folder / "hf.safetensors")
    save_file({"input_ids": ids}, folder / "in.safetensors")
    with torch.no_grad():
        want = {"output": other(ids).contiguous(), "own": model(ids).contiguous()}
    return folder, want


def test_tied_head_is_one_weight_of_the_program(tied_llama):
    folder, _ = tied_llama
    program = torch.export.load(str(folder / "tied.pt2"))
    params = {s.target for s in program.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= params
    # Both names point at one record of the archive.
    assert weight_record(folder / "tied.pt2", "lm_head.weight") == weight_record(
        folder / "tied.pt2", "model.embed_tokens.weight"
    )
    plan = plan_of(folder / "tied.pt2", *SPLIT)
    first, last = plan["stages"][0]["parameters"], plan["stages"][-1]["parameters"]
    assert "lm_head.weight" in first and "lm_head.weight" in last  # the embedding reads it under the head's name
    assert not any("model.embed_tokens.weight" in s["parameters"] for s in plan["stages"])


def test_hf_checkpoint_without_the_tied_head_loads(tmp_path, tied_llama):
    folder, want = tied_llama
    result, out = run(tmp_path, folder / "tied.pt2", *SPLIT, inputs=folder / "in.safetensors")
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), {"output": want["own"]})
    result, out = run(
        tmp_path, folder / "tied.pt2", *SPLIT, "--weights", folder / "hf.safetensors", inputs=folder / "in.safetensors"
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), {"output": want["output"]})


@pytest.mark.parametrize("name", ["param_alias", "gpt2", "tiny_llama"])
def test_checkpoint_names_a_tie_by_its_first_name(tmp_path, name):
    # save_checkpoint stores a tie once, under its first name (mm_param0, transformer.wte.weight,
    # embed.weight); the program calls it by its last.
    build = BUILDERS.get(name) or exported_models.MODELS[name].build
    torch.manual_seed(7)
    model = build().eval()
    save_checkpoint(model, str(tmp_path / "ckpt.safetensors"))
    stored = set(load_file(tmp_path / "ckpt.safetensors"))
    assert not {"mm_param1", "lm_head.weight"} & stored
    with torch.no_grad():
        want = flatten(model(**load_file(inputs_of(name))))
    assert (want["output"] - expected_of(name)["output"]).abs().max() > 0.01  # other weights than the program's
    result, out = run(
        tmp_path,
        fixture(f"{name}.pt2"),
        "--stages",
        2,
        "--policy",
        "params",
        "--weights",
        tmp_path / "ckpt.safetensors",
        inputs=inputs_of(name),
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), want)


def test_tied_head_from_a_checkpoint_in_several_processes(tmp_path, tied_llama):
    folder, want = tied_llama
    result, out = run(
        tmp_path,
        folder / "tied.pt2",
        *SPLIT,
        "--weights",
        folder / "hf.safetensors",
        "--processes",
        2,
        inputs=folder / "in.safetensors",
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), {"output": want["output"]})


# ---- 8. dtypes are the program's own ----


@pytest.mark.parametrize("dtype,name", [("bf16", "BFloat16"), ("fp16", "Half")])
def test_another_dtype_is_refused_with_advice(tmp_path, dtype, name):
    result, out = run(tmp_path, fixture("multi_mlp.pt2"), "--dtype", dtype, inputs=inputs_of("multi_mlp"))
    torch_name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    assert_one_line_error(
        result,
        "torch.export program in Float",
        f"cannot run it in {name}",
        f"model.to(torch.{torch_name}) before libpipe.export_program",
        "PIPE_ERR_UNSUPPORTED",
    )
    assert not out.exists()


def test_the_programs_own_dtype_runs(tmp_path):
    result, out = run(tmp_path, fixture("multi_mlp.pt2"), "--dtype", "fp32", inputs=inputs_of("multi_mlp"))
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(load_file(out), expected_of("multi_mlp"))


def test_a_bf16_program_runs_in_bf16_only(tmp_path):
    torch.manual_seed(0)
    model = seed_models.MultiMLP().to(torch.bfloat16).eval()
    inputs = {"x": torch.randn(4, seed_models.D).bfloat16(), "y": torch.randn(4, seed_models.D).bfloat16()}
    export_program(model, tuple(inputs.values()), path=str(tmp_path / "bf16.pt2"))
    save_file(inputs, tmp_path / "in.safetensors")
    with torch.no_grad():
        want = torch.cat([model(*part) for part in zip(*(t.tensor_split(2) for t in inputs.values()))])
    for extra in ([], ["--dtype", "bf16"]):
        result, out = run(tmp_path, tmp_path / "bf16.pt2", *extra, inputs=tmp_path / "in.safetensors")
        assert result.returncode == 0, result.stderr
        got = load_file(out)["output"]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    result, _ = run(tmp_path, tmp_path / "bf16.pt2", "--dtype", "fp32", inputs=tmp_path / "in.safetensors")
    assert_one_line_error(result, "program in BFloat16", "cannot run it in Float", "PIPE_ERR_UNSUPPORTED")


# ---- 9. bench ----


def test_bench_reports_throughput_and_latency():
    result = pipe(
        "bench",
        fixture("multi_mlp.pt2"),
        "--input",
        inputs_of("multi_mlp"),
        "--microbatches",
        2,
        "--requests",
        20,
        "--concurrency",
        2,
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    batch = load_file(inputs_of("multi_mlp"))["x"].shape[0]
    assert report["requests"] == 20 and report["stages"] == 4 and report["batch"] == batch
    assert report["samples_per_s"] > 0
    assert report["samples_per_s"] == pytest.approx(report["requests_per_s"] * batch, rel=1e-3)
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]


# ---- findings in the plan and the module tree ----


@pytest.mark.parametrize(
    "name",
    [
        "hf_llama",
        "tiny_llama",
        "gpt2",
        "param_alias",
    ],
)
def test_inspect_counts_each_parameter_once(name):
    torch.manual_seed(0)
    build = BUILDERS.get(name) or exported_models.MODELS[name].build
    total = sum(p.numel() for p in build().parameters())  # parameters() lists a shared tensor once
    shown = pipe("inspect", fixture(f"{name}.pt2"))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[1].split()[2] == str(total)


def test_time_policy_with_one_stage_on_a_stateful_model():
    plan = plan_of(
        fixture("state_across_cut.pt2"), "--stages", 1, "--policy", "time", "--input", inputs_of("state_across_cut")
    )
    assert plan["num_stages"] == 1
