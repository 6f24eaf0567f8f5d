"""`pipe run` / `pipe bench` with the stages spread over several local processes (Gloo on
loopback): `--processes N` launching its own `pipe worker` children, and `--world-size N --store`
driving workers started by someone else. Drivers are given the store address 127.0.0.1:0 and
report the port their store picked (storeport.py); the tests start workers with it. Outputs equal
eager PyTorch; every refused command is one clear line on stderr; no process is left behind."""

import json
import time

import pytest
import torch
from disthelp import (
    COMM_MS,
    FAIL_WITHIN_S,
    JOIN_MS,
    RUN_TIMEOUT_S,
    assert_error_line,
    assert_one_line_error,
    error_lines,
    run_pipe,
    seed,
    split_fixture,
    start_driver,
    start_worker,
    weights_fixture,
)
from safetensors.torch import load_file
from storeport import ANY_PORT, CLI_LINE, refused_port

LLAMA_SPLIT = ["--split-at", "layers.0:end", "--split-at", "layers.1:end"]
HF_LLAMA_SPLIT = ["--split-at", "model.layers.0:end", "--split-at", "model.layers.1:end"]

# (model, stages, tolerance); the cases below are (model path, inputs, expected, split, stages, tolerance)
SEED = [
    ("example_code.traced", 4, 1e-5),
    ("example_code.scripted", 4, 1e-5),
    ("multi_mlp.traced", 4, 1e-5),
    ("param_alias.scripted", 2, 1e-5),
    ("tuple_output.traced", 2, 1e-5),
]


def seed_case(model, stages, tol):
    stem = model.split(".")[0]
    return (
        seed(f"{model}.pt"),
        seed(f"{stem}.inputs.safetensors"),
        seed(f"{stem}.expected.safetensors"),
        [],
        stages,
        tol,
    )


def split_case(name, split, stages, tol):
    return (
        split_fixture(f"{name}.pt"),
        split_fixture(f"{name}.inputs.safetensors"),
        split_fixture(f"{name}.expected.safetensors"),
        split,
        stages,
        tol,
    )


CASES = {}
for model, stages, tol in SEED:
    for procs in (2, 3):
        if procs <= stages:
            CASES[f"{model}-{procs}p"] = (seed_case(model, stages, tol), procs)
for procs in (2, 3):
    CASES[f"tiny_llama-{procs}p"] = (split_case("tiny_llama", LLAMA_SPLIT, 3, 1e-4), procs)
    CASES[f"hf_llama-{procs}p"] = (split_case("hf_llama", HF_LLAMA_SPLIT, 3, 1e-4), procs)
# Values of every kind (int, float, bool, tuple, list, None) crossing a process boundary, and
# a scripted model with control flow in each stage.
CASES["crossing_values-2p"] = (split_case("crossing_values", [], 2, 1e-5), 2)
CASES["control_flow-3p"] = (split_case("control_flow", [], 3, 1e-5), 3)


def assert_outputs_equal(out, expected, tol):
    got, want = load_file(out), load_file(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


def stage_count(model, split):
    result = run_pipe("split", model, *split, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["num_stages"]


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_run_over_processes_matches_eager(tmp_path, case):
    (model, inputs, expected, split, stages, tol), procs = CASES[case]
    assert stage_count(model, split) == stages
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run", model, *split, "--input", inputs, "--output", out, "--microbatches", 2, "--processes", procs
    )
    assert result.returncode == 0, result.stderr
    assert not error_lines(result.stderr), result.stderr  # its workers ended well too
    assert_outputs_equal(out, expected, tol)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_run_over_as_many_processes_as_stages(tmp_path, microbatches):
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        microbatches,
        "--processes",
        4,
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(out, seed("multi_mlp.expected.safetensors"), 1e-5)


def test_run_over_processes_on_a_given_store(tmp_path):
    # Port 0: the store picks one, and the local workers are started with the port it got.
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        seed("example_code.traced.pt"),
        "--input",
        seed("example_code.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        2,
        "--processes",
        3,
        "--store",
        ANY_PORT,
        "--comm-timeout-ms",
        30000,
    )
    assert result.returncode == 0, result.stderr
    assert "store listening" not in result.stderr, result.stderr  # the workers are its own
    assert_outputs_equal(out, seed("example_code.expected.safetensors"), 1e-5)


@pytest.mark.parametrize("procs", [2, 3])
def test_bench_over_processes_reports_throughput(procs):
    result = run_pipe(
        "bench",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--microbatches",
        2,
        "--requests",
        20,
        "--concurrency",
        2,
        "--processes",
        procs,
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == 20 and report["stages"] == 4 and report["batch"] == 16
    assert report["samples_per_s"] > 0
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]


def test_bench_over_processes_text():
    result = run_pipe(
        "bench",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--requests",
        6,
        "--processes",
        2,
    )
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout


# ---- workers started by someone else: `pipe worker` + `pipe run --world-size N --store` ----


def test_run_drives_workers_started_separately(tmp_path):
    out = tmp_path / "out.safetensors"
    driver, store = start_driver(
        "run",
        split_fixture("tiny_llama.pt"),
        *LLAMA_SPLIT,
        "--input",
        split_fixture("tiny_llama.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        2,
        "--world-size",
        3,
        "--comm-timeout-ms",
        JOIN_MS,
        name="pipe run",
    )
    # The documented line, once, before the driver waited for anyone: these workers joined from it.
    assert CLI_LINE.match(driver.stderr.splitlines()[0]), driver.stderr
    assert store.startswith("127.0.0.1:") and not store.endswith(":0"), store
    workers = [start_worker(rank, 3, store, comm_ms=JOIN_MS) for rank in (1, 2)]
    driver.wait(RUN_TIMEOUT_S)
    assert driver.returncode == 0, driver.stderr
    assert [line for line in driver.stderr.splitlines() if "store listening" in line] == [
        f"pipe: store listening on {store} (start workers with --store {store})"
    ], driver.stderr
    for w in workers:
        w.wait(FAIL_WITHIN_S)  # the session is destroyed: each worker exits 0
        assert w.returncode == 0, w.stderr
        assert not error_lines(w.stderr), w.stderr
    assert_outputs_equal(out, split_fixture("tiny_llama.expected.safetensors"), 1e-4)


def test_bench_drives_workers_started_separately():
    driver, store = start_driver(
        "bench",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--requests",
        10,
        "--concurrency",
        2,
        "--world-size",
        2,
        "--json",
        "--comm-timeout-ms",
        JOIN_MS,
        name="pipe bench",
    )
    workers = [start_worker(1, 2, store, comm_ms=JOIN_MS)]
    driver.wait(RUN_TIMEOUT_S)
    assert driver.returncode == 0, driver.stderr
    assert json.loads(driver.stdout)["requests"] == 10
    for w in workers:
        w.wait(FAIL_WITHIN_S)
        assert w.returncode == 0, w.stderr


def test_worker_threads_option(tmp_path):
    out = tmp_path / "out.safetensors"
    driver, store = start_driver(
        "run",
        seed("example_code.traced.pt"),
        "--input",
        seed("example_code.inputs.safetensors"),
        "--output",
        out,
        "--world-size",
        2,
        "--comm-timeout-ms",
        JOIN_MS,
        name="pipe run",
    )
    workers = [start_worker(1, 2, store, comm_ms=JOIN_MS, extra=("--threads", 1))]
    driver.wait(RUN_TIMEOUT_S)
    assert driver.returncode == 0, driver.stderr
    workers[0].wait(FAIL_WITHIN_S)
    assert workers[0].returncode == 0, workers[0].stderr
    assert_outputs_equal(out, seed("example_code.expected.safetensors"), 1e-5)


# ---- weights from a checkpoint, read by each process for its own stages ----


@pytest.mark.parametrize(
    "weights,procs",
    [
        ("sharded/llama.safetensors.index.json", 3),
        ("sharded/llama.safetensors.index.json", 2),
        ("prefixed.safetensors", 3),
    ],
)
def test_skeleton_with_checkpoint_over_processes(tmp_path, weights, procs):
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        weights_fixture("llama.skeleton.pt"),
        *LLAMA_SPLIT,
        "--weights",
        weights_fixture(weights),
        "--input",
        weights_fixture("llama.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        2,
        "--processes",
        procs,
    )
    assert result.returncode == 0, result.stderr
    assert_outputs_equal(out, weights_fixture("llama.expected.safetensors"), 1e-5)


def test_checkpoint_error_in_a_workers_stage_reaches_the_driver(tmp_path):
    # layers.1.mlp.up_proj.weight belongs to stage 1, which lives in worker rank 1.
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        weights_fixture("llama.skeleton.pt"),
        *LLAMA_SPLIT,
        "--weights",
        weights_fixture("missing/llama.safetensors.index.json"),
        "--input",
        weights_fixture("llama.inputs.safetensors"),
        "--output",
        out,
        "--processes",
        3,
        "--comm-timeout-ms",
        30000,
    )
    assert_error_line(result, "layers.1.mlp.up_proj.weight")
    assert not out.exists()


# ---- argument errors: one line, non-zero exit, no process left ----


def run_args(tmp_path, model="example_code.traced"):
    stem = model.split(".")[0]
    return [
        "run",
        seed(f"{model}.pt"),
        "--input",
        seed(f"{stem}.inputs.safetensors"),
        "--output",
        tmp_path / "out.safetensors",
    ]


def bench_args(model="example_code.traced"):
    stem = model.split(".")[0]
    return ["bench", seed(f"{model}.pt"), "--input", seed(f"{stem}.inputs.safetensors"), "--requests", 2]


@pytest.mark.parametrize("command", ["run", "bench"])
def test_zero_processes(tmp_path, command):
    args = run_args(tmp_path) if command == "run" else bench_args()
    line = assert_one_line_error(run_pipe(*args, "--processes", 0))
    assert "processes" in line.lower()


@pytest.mark.parametrize("command", ["run", "bench"])
def test_more_processes_than_stages(tmp_path, command):
    args = run_args(tmp_path) if command == "run" else bench_args()
    result = run_pipe(*args, "--processes", 5)  # example_code has 4 stages
    line = assert_one_line_error(result).lower()
    assert "process" in line and "stage" in line, line
    assert not (tmp_path / "out.safetensors").exists()


def test_more_processes_than_stages_with_a_split(tmp_path):
    result = run_pipe(
        "run",
        split_fixture("tiny_llama.pt"),
        "--split-at",
        "layers.0:end",
        "--input",
        split_fixture("tiny_llama.inputs.safetensors"),
        "--output",
        tmp_path / "o.safetensors",
        "--processes",
        3,
    )
    line = assert_one_line_error(result).lower()
    assert "process" in line and "stage" in line, line


@pytest.mark.parametrize("command", ["run", "bench"])
def test_world_size_without_store(tmp_path, command):
    args = run_args(tmp_path) if command == "run" else bench_args()
    assert_one_line_error(run_pipe(*args, "--world-size", 2, timeout=FAIL_WITHIN_S + 30), "--store")


@pytest.mark.parametrize("value", ["two", "-1"])
def test_bad_process_count(tmp_path, value):
    result = run_pipe(*run_args(tmp_path), "--processes", value)
    assert_one_line_error(result)


@pytest.mark.parametrize(
    "args",
    [
        ["--world-size", 2, "--store", "127.0.0.1:1"],  # no --rank
        ["--rank", 1, "--store", "127.0.0.1:1"],  # no --world-size
        ["--rank", 1, "--world-size", 2],  # no --store
        ["--rank", 2, "--world-size", 2, "--store", "127.0.0.1:1"],  # rank out of range
        ["--rank", 0, "--world-size", 2, "--store", "127.0.0.1:1"],  # rank 0 is the driver
        ["--rank", 1, "--world-size", 2, "--store", "127.0.0.1:1", "--comm-timeout-ms", "soon"],
    ],
)
def test_worker_argument_errors(args):
    # Refused at once, without waiting for any store.
    result = run_pipe("worker", *args, timeout=FAIL_WITHIN_S)
    assert_one_line_error(result)


def test_worker_refuses_port_zero():
    # Port 0 is the driver's way to let its store pick a port; a worker needs the port it got.
    result = run_pipe("worker", "--rank", 1, "--world-size", 2, "--store", ANY_PORT, timeout=FAIL_WITHIN_S)
    line = assert_one_line_error(result, "127.0.0.1:0", "port 0", "PIPE_ERR_INVALID_ARGUMENT")
    assert "the port the driver reported" in line, line


# ---- a wrong store address: one clear line, quickly ----


@pytest.mark.parametrize("command", ["run", "bench"])
@pytest.mark.parametrize(
    "store,needle",
    [
        ("nosuchhost.invalid:1234", "nosuchhost.invalid"),
        ("192.0.2.1:29500", "192.0.2.1"),  # TEST-NET-1: not this machine
        ("192.0.2.1:0", "192.0.2.1"),
    ],
)
def test_driver_with_a_wrong_store_address(tmp_path, command, store, needle):
    args = run_args(tmp_path) if command == "run" else bench_args()
    start = time.monotonic()
    result = run_pipe(
        *args, "--world-size", 2, "--store", store, "--comm-timeout-ms", COMM_MS, timeout=FAIL_WITHIN_S + 30
    )
    took = time.monotonic() - start
    assert_one_line_error(result, needle)
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"


def test_processes_with_a_wrong_store_address(tmp_path):
    result = run_pipe(
        *run_args(tmp_path),
        "--processes",
        2,
        "--store",
        "nosuchhost.invalid:1234",
        "--comm-timeout-ms",
        COMM_MS,
        timeout=FAIL_WITHIN_S + 30,
    )
    assert_error_line(result, "nosuchhost.invalid")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "store,needle", [("127.0.0.1:{port}", "127.0.0.1:{port}"), ("nosuchhost.invalid:1234", "nosuchhost.invalid")]
)
def test_worker_with_nothing_at_the_store_address(store, needle):
    with refused_port() as port:  # nothing listens there while the worker tries
        store, needle = store.format(port=port), needle.format(port=port)
        start = time.monotonic()
        result = run_pipe(
            "worker",
            "--rank",
            1,
            "--world-size",
            2,
            "--store",
            store,
            "--comm-timeout-ms",
            COMM_MS,
            timeout=FAIL_WITHIN_S + 30,
        )
        took = time.monotonic() - start
    assert_one_line_error(result, needle)
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"


def test_driver_whose_workers_never_come(tmp_path):
    start = time.monotonic()
    result = run_pipe(
        *run_args(tmp_path),
        "--world-size",
        3,
        "--store",
        ANY_PORT,
        "--comm-timeout-ms",
        COMM_MS,
        timeout=FAIL_WITHIN_S + 30,
    )
    took = time.monotonic() - start
    line = assert_one_line_error(result, "missing ranks 1, 2", store_line=True)
    store = CLI_LINE.match(result.stderr.splitlines()[0]).group(1)
    assert f"--store {store}`" in line, line  # how to start them, with the port the store got
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"


# ---- workers that do not fit the session ----

# Sessions whose driver gives up on a worker: the comm timeout must outlast a worker's start on a
# loaded machine (the test starts it after the driver reported its store), and is waited out.
GIVE_UP_MS = 20000


def test_worker_with_a_different_world_size(tmp_path):
    driver, store = start_driver(
        *run_args(tmp_path), "--world-size", 2, "--comm-timeout-ms", GIVE_UP_MS, name="pipe run"
    )
    worker = start_worker(1, 3, store, comm_ms=JOIN_MS).wait(RUN_TIMEOUT_S)
    line = assert_one_line_error(worker)
    assert "world size 3" in line.lower() and "has 2" in line, line
    driver.wait(GIVE_UP_MS / 1000 + FAIL_WITHIN_S)
    assert_one_line_error(driver, "missing rank 1", store_line=True)  # its worker never joined
    driver.assert_no_leftovers()


def store_client(store):
    """A client of the driver's store (with the session's token, LIBPIPE_TOKEN), to watch the rendezvous:
    libpipe marks each worker rank that joined with the key libpipe/joined/<rank> (runtime/comm/rendezvous.cpp)."""
    from storeclient import StoreClient

    return StoreClient(store, timeout=RUN_TIMEOUT_S)


def test_two_workers_with_the_same_rank(tmp_path):
    driver, store = start_driver(
        *run_args(tmp_path), "--world-size", 3, "--comm-timeout-ms", GIVE_UP_MS, name="pipe run"
    )
    rendezvous = store_client(store)
    first = start_worker(1, 3, store, comm_ms=JOIN_MS)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not rendezvous.check(["libpipe/joined/1"]):  # until the first has claimed rank 1
        assert first.proc.poll() is None and driver.proc.poll() is None, first.stderr + driver.stderr
        assert time.monotonic() < deadline, "rank 1 never joined"
        time.sleep(0.05)
    rendezvous.close()
    second = start_worker(1, 3, store, comm_ms=JOIN_MS).wait(RUN_TIMEOUT_S)
    assert_one_line_error(second, "rank 1 has already joined")
    driver.wait(GIVE_UP_MS / 1000 + FAIL_WITHIN_S)
    assert_one_line_error(driver, "missing rank 2", store_line=True)
    first.wait(FAIL_WITHIN_S)  # its session never started: it ends too, with one line
    assert first.returncode != 0
    assert_one_line_error(first)
