"""The `pipe` command-line contract (see docs/DESIGN.md): split and run on the seed models, outputs
equal to eager PyTorch, and one clear line on stderr with a non-zero exit for every error."""

import json
import os

import pytest
import torch
from conftest import MODELS, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file, save_file


def fixture(name):
    return os.path.join(MODELS, name)


def state_dict_keys(stem):
    with open(fixture(f"{stem}.state_dict.txt")) as f:
        return {line.strip() for line in f if line.strip()}


SEEDS = [
    ("example_code.traced.pt", "example_code", 4),
    ("example_code.scripted.pt", "example_code", 4),
    ("multi_mlp.traced.pt", "multi_mlp", 4),
    ("param_alias.scripted.pt", "param_alias", 2),
]


@pytest.mark.parametrize("model,stem,stages", SEEDS)
def test_split_json_lists_each_stage_with_original_names(model, stem, stages):
    result = pipe("split", fixture(model), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_stages"] == stages
    assert [s["index"] for s in plan["stages"]] == list(range(stages))
    keys = state_dict_keys(stem)
    for stage in plan["stages"]:
        assert set(stage["parameters"]) | set(stage["buffers"]) <= keys
        assert stage["param_bytes"] > 0 or not stage["parameters"]


def test_split_json_shows_the_skip_connection_and_shared_parameter():
    plan = json.loads(pipe("split", fixture("example_code.traced.pt"), "--json").stdout)
    stages = plan["stages"]
    assert "mm_param1" in stages[0]["parameters"] and "mm_param1" in stages[1]["parameters"]
    assert [i["from"] for i in stages[2]["inputs"]] == [1, 0]
    assert [i["from"] for i in stages[1]["inputs"]] == [0]


def test_split_prints_a_readable_plan():
    result = pipe("split", fixture("multi_mlp.traced.pt"))
    assert result.returncode == 0, result.stderr
    assert "4 stages" in result.stdout
    assert "block3.lin1.weight" in result.stdout


@pytest.mark.parametrize("model,stem,stages", SEEDS)
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_run_matches_eager_pytorch(tmp_path, model, stem, stages, microbatches):
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        fixture(model),
        "--input",
        fixture(f"{stem}.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        microbatches,
    )
    assert result.returncode == 0, result.stderr
    got, want = load_file(out), load_file(fixture(f"{stem}.expected.safetensors"))
    assert list(got) == ["output"]
    torch.testing.assert_close(got["output"], want["output"], rtol=1e-5, atol=1e-5)


def test_run_names_tuple_outputs(tmp_path):
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        fixture("tuple_output.traced.pt"),
        "--input",
        fixture("tuple_output.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        4,
    )
    assert result.returncode == 0, result.stderr
    got, want = load_file(out), load_file(fixture("tuple_output.expected.safetensors"))
    assert sorted(got) == ["output.0", "output.1"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["example_code.traced.pt", "example_code.scripted.pt"])
def test_replicated_input_goes_whole_to_every_microbatch(tmp_path, model):
    # y is one row added to every row of x: cut along dimension 0 it would disagree with x's batch.
    x, y = torch.randn(6, 512), torch.randn(1, 512)
    save_file({"x": x, "y": y}, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    args = ("run", fixture(model), "--input", tmp_path / "in.safetensors", "--output", out, "--microbatches", 3)
    assert_one_line_error(pipe(*args), "input 'y' has 1 rows", "must share their batch size")
    result = pipe(*args, "--replicate", "y")
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        want = torch.jit.load(fixture(model))(x, y)
    torch.testing.assert_close(load_file(out)["output"], want, rtol=1e-5, atol=1e-5)


def test_replicate_of_a_name_that_is_not_an_input(tmp_path):
    assert_one_line_error(
        pipe(
            "run",
            fixture("example_code.traced.pt"),
            "--input",
            fixture("example_code.inputs.safetensors"),
            "--output",
            tmp_path / "o.safetensors",
            "--replicate",
            "y,z",
        ),
        "--replicate 'z' is not an input of the model (inputs: x, y)",
    )
    assert not (tmp_path / "o.safetensors").exists()


def test_replicate_does_not_apply_to_generate():
    result = pipe("generate", fixture("example_code.traced.pt"), "--replicate", "x", "--prompt-ids", "1")
    assert result.returncode == 2
    assert_one_line_error(result, "--replicate applies to run and bench")


# ---- errors: one line, non-zero exit, never a crash ----


def test_missing_model(tmp_path):
    assert_one_line_error(pipe("split", tmp_path / "nope.pt"), "nope.pt", "PIPE_ERR_NOT_FOUND")


def test_junk_model(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a zip archive" * 10)
    assert_one_line_error(pipe("split", junk), "not a loadable model archive", "PIPE_ERR_INVALID_FORMAT")


def test_truncated_model(tmp_path):
    data = open(fixture("example_code.traced.pt"), "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    assert_one_line_error(pipe("split", truncated), "zip archive is damaged", "PIPE_ERR_INVALID_FORMAT")


def test_torch_save_file_is_named_as_such(tmp_path):
    saved = tmp_path / "weights.pt"
    torch.save({"w": torch.randn(3)}, saved)
    assert_one_line_error(pipe("split", saved), "torch.save()", "torch.jit.trace", "PIPE_ERR_INVALID_FORMAT")


def test_marker_inside_branch():
    assert_one_line_error(
        pipe("split", fixture("marker_in_branch.scripted.pt")), "inside an if/loop block", "PIPE_ERR_SPLIT"
    )


def test_missing_input_tensor(tmp_path):
    inp = tmp_path / "in.safetensors"
    save_file({"x": torch.randn(4, 512)}, inp)
    assert_one_line_error(
        pipe("run", fixture("example_code.traced.pt"), "--input", inp, "--output", tmp_path / "o.safetensors"),
        "no tensor named 'y'",
        "x, y",
    )


def test_extra_input_tensor(tmp_path):
    inp = tmp_path / "in.safetensors"
    save_file({"x": torch.randn(4, 512), "y": torch.randn(4, 512), "z": torch.randn(1)}, inp)
    assert_one_line_error(
        pipe("run", fixture("example_code.traced.pt"), "--input", inp, "--output", tmp_path / "o.safetensors"),
        "tensor 'z'",
        "not an input",
    )


def test_wrongly_shaped_input(tmp_path):
    inp = tmp_path / "in.safetensors"
    save_file({"x": torch.randn(4, 100), "y": torch.randn(4, 512)}, inp)
    result = pipe("run", fixture("example_code.traced.pt"), "--input", inp, "--output", tmp_path / "o.safetensors")
    assert_one_line_error(result, "stage 0 failed", "PIPE_ERR_EXECUTION")
    assert not (tmp_path / "o.safetensors").exists()


def test_wrongly_typed_input(tmp_path):
    # int64 where the model's weights are float32: the first stage's matmul refuses it, and the
    # message names the stage and quotes the operator.
    inp = tmp_path / "in.safetensors"
    save_file({"x": torch.ones(4, 512, dtype=torch.int64), "y": torch.randn(4, 512)}, inp)
    result = pipe("run", fixture("example_code.traced.pt"), "--input", inp, "--output", tmp_path / "o.safetensors")
    assert_one_line_error(result, "stage 0 failed", "PIPE_ERR_EXECUTION")
    assert not (tmp_path / "o.safetensors").exists()


def test_corrupt_input_file(tmp_path):
    inp = tmp_path / "in.safetensors"
    inp.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert_one_line_error(
        pipe("run", fixture("example_code.traced.pt"), "--input", inp, "--output", tmp_path / "o.safetensors"),
        "malformed safetensors",
        "PIPE_ERR_INVALID_FORMAT",
    )


@pytest.mark.parametrize("value", ["0", "-3"])
def test_non_positive_microbatches(tmp_path, value):
    assert_one_line_error(
        pipe(
            "run",
            fixture("example_code.traced.pt"),
            "--input",
            fixture("example_code.inputs.safetensors"),
            "--output",
            tmp_path / "o.safetensors",
            "--microbatches",
            value,
        ),
        "num_microbatches must be at least 1",
    )


def test_non_numeric_microbatches(tmp_path):
    result = pipe(
        "run",
        fixture("example_code.traced.pt"),
        "--input",
        fixture("example_code.inputs.safetensors"),
        "--output",
        tmp_path / "o.safetensors",
        "--microbatches",
        "four",
    )
    assert result.returncode == 2
    assert "--microbatches expects an integer" in result.stderr


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["split"], ["run", "m.pt"], ["split", "a.pt", "--bogus"]])
def test_usage_errors(args):
    result = pipe(*args)
    assert result.returncode == 2
    assert result.stderr.strip()


def test_output_into_missing_directory(tmp_path):
    assert_one_line_error(
        pipe(
            "run",
            fixture("example_code.traced.pt"),
            "--input",
            fixture("example_code.inputs.safetensors"),
            "--output",
            tmp_path / "missing" / "o.safetensors",
        ),
        "PIPE_ERR_IO",
    )


# ---- observability: trace and bench ----


def test_run_writes_a_chrome_trace_with_one_track_per_stage(tmp_path):
    trace = tmp_path / "trace.json"
    result = pipe(
        "run",
        fixture("example_code.traced.pt"),
        "--input",
        fixture("example_code.inputs.safetensors"),
        "--output",
        tmp_path / "o.safetensors",
        "--microbatches",
        4,
        "--trace",
        trace,
    )
    assert result.returncode == 0, result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2", 3: "stage 3"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 16  # 4 micro-batches through 4 stages
    for s in slices:
        assert s["dur"] > 0 and s["ts"] >= 0


def test_bench_reports_throughput_latency_and_busy_fractions():
    result = pipe(
        "bench",
        fixture("multi_mlp.traced.pt"),
        "--input",
        fixture("multi_mlp.inputs.safetensors"),
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
    assert report["requests"] == 20 and report["stages"] == 4 and report["batch"] == 16
    assert report["samples_per_s"] > 0
    assert report["samples_per_s"] == pytest.approx(report["requests_per_s"] * 16, rel=1e-3)
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert len(report["stage_busy"]) == 4 and all(0 < b <= 1.0 for b in report["stage_busy"])


def test_bench_fixed_microbatching_cuts_every_request_alike():
    # Fixed: every one of the 20 requests is cut into 2 micro-batches at every stage. (Adaptive
    # may cut fewer under load; the C conformance suite checks when.)
    result = pipe(
        "bench",
        fixture("multi_mlp.traced.pt"),
        "--input",
        fixture("multi_mlp.inputs.safetensors"),
        "--microbatches",
        2,
        "--requests",
        20,
        "--concurrency",
        2,
        "--microbatching",
        "fixed",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["microbatching"] == "fixed"
    assert report["stage_microbatches"] == [40, 40, 40, 40]


def test_bad_microbatching_mode(tmp_path):
    result = pipe(
        "run",
        fixture("example_code.traced.pt"),
        "--input",
        fixture("example_code.inputs.safetensors"),
        "--output",
        tmp_path / "o.safetensors",
        "--microbatching",
        "sometimes",
    )
    assert result.returncode == 2
    assert "--microbatching is adaptive or fixed, got 'sometimes'" in result.stderr


def test_bench_text_and_errors():
    result = pipe(
        "bench", fixture("multi_mlp.traced.pt"), "--input", fixture("multi_mlp.inputs.safetensors"), "--requests", 4
    )
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout and "stage 3: busy" in result.stdout
    assert (
        pipe(
            "bench", fixture("multi_mlp.traced.pt"), "--input", fixture("multi_mlp.inputs.safetensors"), "--requests", 0
        ).returncode
        == 2
    )
    assert pipe("bench", fixture("multi_mlp.traced.pt")).returncode == 2
    bad = pipe(
        "bench",
        fixture("multi_mlp.traced.pt"),
        "--input",
        fixture("example_code.inputs.safetensors"),
        "--threads-per-stage",
        "-1",
    )
    assert bad.returncode == 1 and "threads_per_stage" in bad.stderr
