"""Splitting real models by module path and by policy, end to end through `pipe`: every split
equals eager PyTorch, and every way a split can be wrong is refused with a message that says
what to change."""

import json
import os

import pytest
import torch
from conftest import MODELS, SANITIZED, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file


def fixture(name):
    return os.path.join(MODELS, "split", name)


def state_dict_keys(name):
    with open(fixture(f"{name}.state_dict.txt")) as f:
        return {line.strip() for line in f if line.strip()}


def plan_of(name, *split):
    result = pipe("split", fixture(f"{name}.pt"), *split, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_runs_like_eager(tmp_path, name, *split, microbatches=2, tol=1e-5):
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        fixture(f"{name}.pt"),
        *split,
        "--input",
        fixture(f"{name}.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        microbatches,
    )
    assert result.returncode == 0, result.stderr
    got, want = load_file(out), load_file(fixture(f"{name}.expected.safetensors"))
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol)


CASES = [
    # The no_grad case PyTorch's splitter trips on; at layers.1:begin the buffer is read by both stages.
    ("nograd_layers", ["--split-at", "layers.0:end"], 2, 1e-5),
    ("nograd_layers", ["--split-at", "layers.1:begin"], 2, 1e-5),
    ("nograd_scripted", ["--split-at", "layers.0:end"], 2, 1e-5),
    ("nograd_scripted", ["--split-at", "layers.1:begin"], 2, 1e-5),
    ("tiny_llama", ["--split-at", "layers.0:end", "--split-at", "layers.1:end"], 3, 1e-4),
    ("resnet18", ["--split-at", "layer1:end", "--split-at", "layer2:end", "--split-at", "layer3:end"], 4, 1e-4),
    ("resnet18", ["--stages", "3", "--policy", "params"], 3, 1e-4),
    ("gpt2", ["--split-at", "transformer.h.1:end"], 2, 1e-4),
    ("gpt2", ["--stages", "3", "--policy", "time"], 3, 1e-4),
    ("hf_llama", ["--split-at", "model.layers.0:end"], 2, 1e-4),
    ("control_flow", [], 3, 1e-5),
    ("crossing_values", [], 2, 1e-5),
    ("device_constant", [], 2, 1e-5),
    ("nested_traced", ["--split-at", "stack.1.0:begin", "--split-at", "heads.a:end"], 3, 1e-5),
    ("nested_scripted", ["--split-at", "stack.1.0:begin", "--split-at", "heads.a:end"], 3, 1e-5),
]


@pytest.mark.parametrize("name,split,stages,tol", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_split_runs_like_eager_with_original_names(tmp_path, name, split, stages, tol):
    extra = ["--input", fixture(f"{name}.inputs.safetensors")] if "time" in split else []
    plan = plan_of(name, *split, *extra)
    assert plan["num_stages"] == stages
    keys = state_dict_keys(name)
    for stage in plan["stages"]:
        assert set(stage["parameters"]) | set(stage["buffers"]) <= keys
    # Under the sanitizers one micro-batch count per case (the cases already cover every path); all three here.
    for mb in (2,) if SANITIZED else (1, 2, 4):
        assert_runs_like_eager(tmp_path, name, *split, microbatches=mb, tol=tol)


def test_buffer_under_no_grad_goes_to_every_stage_that_reads_it():
    plan = plan_of("nograd_layers", "--split-at", "layers.1:begin")
    assert [s["buffers"] for s in plan["stages"]] == [["scaler.scale"], ["scaler.scale"]]
    plan = plan_of("nograd_layers", "--split-at", "layers.0:end")
    assert [s["buffers"] for s in plan["stages"]] == [[], ["scaler.scale"]]


def test_tied_head_reaches_the_last_stage():
    plan = plan_of("tiny_llama", "--split-at", "layers.0:end", "--split-at", "layers.1:end")
    first, last = plan["stages"][0]["parameters"], plan["stages"][-1]["parameters"]
    assert "embed.weight" in first
    assert "lm_head.weight" in last or "embed.weight" in last


def test_crossing_values_of_every_kind_are_reported():
    plan = plan_of("crossing_values")
    assert len(plan["stages"][1]["inputs"]) >= 5  # int, float, bool, tuple, list, optional


def test_policies_report_bytes_times_and_balance():
    for policy in ("uniform", "params", "time"):
        plan = plan_of("gpt2", "--stages", "3", "--policy", policy, "--input", fixture("gpt2.inputs.safetensors"))
        assert plan["method"] == f"policy {policy}"
        assert all(s["estimated_ms"] > 0 and s["param_bytes"] > 0 for s in plan["stages"])
        assert 0 < plan["balance"] <= 1


def test_uniform_shares_layers_equally():
    plan = plan_of("tiny_llama", "--stages", "3", "--policy", "uniform")
    for i, stage in enumerate(plan["stages"]):
        assert any(p.startswith(f"layers.{i}.") for p in stage["parameters"])
        assert not any(p.startswith(f"layers.{j}.") for p in stage["parameters"] for j in range(3) if j != i)


def test_saved_stages_reload_and_chain_to_the_same_result(tmp_path):
    split = ["--split-at", "layers.0:end", "--split-at", "layers.1:end"]
    result = pipe("split", fixture("tiny_llama.pt"), *split, "--save-stages", tmp_path)
    assert result.returncode == 0, result.stderr
    plan = plan_of("tiny_llama", *split)
    inputs = load_file(fixture("tiny_llama.inputs.safetensors"))
    values = {"input_ids": inputs["input_ids"]}
    out = None
    for stage in plan["stages"]:
        module = torch.jit.load(str(tmp_path / f"stage{stage['index']}.pt"))
        assert set(dict(module.named_parameters())) | set(dict(module.named_buffers())) == set(
            stage["parameters"]
        ) | set(stage["buffers"])
        out = module(*[values[i["name"]] for i in stage["inputs"]])
        if stage["index"] + 1 < plan["num_stages"]:
            for o, v in zip(stage["outputs"], out):
                values[o["name"]] = v
    torch.testing.assert_close(
        out, load_file(fixture("tiny_llama.expected.safetensors"))["output"], rtol=1e-4, atol=1e-4
    )


def test_module_called_twice_gives_a_boundary_per_call(tmp_path):
    # scaler runs after each of the two layers: each call is its own boundary.
    plan = plan_of("nograd_layers", "--split-at", "scaler:begin")
    assert plan["num_stages"] == 3
    assert [b["reason"] for b in plan["boundaries"]] == ["scaler:begin (call 0)", "scaler:begin (call 1)"]
    assert_runs_like_eager(tmp_path, "nograd_layers", "--split-at", "scaler:begin")
    # Its second call ends the model, so scaler:end would leave an empty last stage; @0 picks one call.
    assert_refused(pipe("split", fixture("nograd_layers.pt"), "--split-at", "scaler:end"), "empty")
    plan = plan_of("nograd_layers", "--split-at", "scaler@0:end")
    assert plan["num_stages"] == 2
    assert plan["boundaries"][0]["reason"] == "scaler@0:end (call 0)"


def test_inspect_lists_the_module_tree():
    result = pipe("inspect", fixture("resnet18.pt"))
    assert result.returncode == 0, result.stderr
    assert "layer1" in result.stdout and "BasicBlock" in result.stdout
    total = sum(p.numel() for p in torch.jit.load(fixture("resnet18.pt")).parameters())
    assert str(total) in result.stdout.splitlines()[1]


# ---- validation: one line, non-zero exit, the message says what to change ----

assert_refused = assert_one_line_error


@pytest.mark.parametrize(
    "split,needles",
    [
        (["--split-at", "layers.7:end"], ["names module 'layers.7'", "nearest module paths: layers.0"]),
        (["--split-at", "layers.0"], ["has no ':begin' or ':end'"]),
        (["--split-at", "layers.0:middle"], ["neither ':begin' nor ':end'"]),
        (["--split-at", "layers..0:end"], ["empty component"]),
        (["--split-at", "layers.0@x:end"], ["call number"]),
        (["--split-at", "embed:begin"], ["would leave stage 0 empty"]),
        (["--split-at", "lm_head:end"], ["would leave stage after it empty"]),
        (["--split-at", "layers.0@3:end"], ["called 1 time"]),
        (["--stages", "0", "--policy", "uniform"], ["at least 1"]),
        (["--stages", "4", "--policy", "uniform"], ["has 3 layers", "at most 3"]),
        (["--stages", "2", "--policy", "fastest"], ["unknown split policy 'fastest'"]),
        (["--stages", "2", "--policy", "time"], ["example inputs"]),
        (["--stages", "2", "--policy", "uniform", "--split-at", "layers.0:end"], ["not both"]),
    ],
)
def test_bad_splits_are_refused(split, needles):
    assert_refused(pipe("split", fixture("tiny_llama.pt"), *split), *needles)


def test_too_many_stages_for_the_places_to_cut():
    assert_refused(
        pipe("split", fixture("nograd_layers.pt"), "--stages", "9", "--policy", "params"), "cannot make 9 stages"
    )


def test_cut_inside_a_branch_is_refused():
    assert_refused(pipe("split", fixture("call_inside_branch.pt"), "--split-at", "lin1:end"), "inside an if/loop block")


def test_cut_inside_autocast_is_refused():
    assert_refused(
        pipe("split", fixture("inside_autocast.pt"), "--split-at", "lin1:end"), "inside a `with` block", "autocast"
    )


def test_policy_never_cuts_inside_autocast():
    plan = plan_of("inside_autocast", "--stages", "2", "--policy", "uniform")
    assert plan["stages"][0]["parameters"] == ["lin0.weight", "lin0.bias"]
