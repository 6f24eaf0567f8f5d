"""The C ABI's Gloo transport, through dist_driver (dist_driver.c): a session whose store picks its
own port (127.0.0.1:0, reported through the log callback) and whose stages live in `pipe worker`
processes (or in processes calling pipe_worker_run) takes requests of different batch sizes and
sequence lengths, one after another and all at once, and equals eager PyTorch; a worker killed or
stopped while it holds a call (the gated model, tests/gate) fails the calls with
PIPE_ERR_COMMUNICATION within comm_timeout_ms, the session reports itself broken, is destroyed
promptly, and a new one with fresh workers works; wrong store addresses fail clearly on both
sides."""

import re
import time

import libpipe  # noqa: F401  (registers the pipe::split op, so the models load in PyTorch)
import pytest
import torch
from disthelp import (
    COMM_MS,
    DRIVER,
    FAIL_WITHIN_S,
    MARGIN_S,
    PIPE,
    RUN_TIMEOUT_S,
    SANITIZED,
    Tree,
    gate,
    gated_model,
    seed,
    split_fixture,
)
from safetensors.torch import load_file, save_file
from storeport import ANY_PORT, refused_port

assert DRIVER, "PIPE_DIST_DRIVER must name the dist_driver executable"

LLAMA_SPLIT = ["--split-at", "layers.0:end", "--split-at", "layers.1:end"]
HF_LLAMA_SPLIT = ["--split-at", "model.layers.0:end", "--split-at", "model.layers.1:end"]


def driver(*args, workers="cli", world=2, comm_ms=COMM_MS, split=(), model=None, extra=()):
    opts = [
        "--pipe",
        PIPE if workers == "cli" else "self",
        "--world-size",
        world,
        "--comm-timeout-ms",
        comm_ms,
        "--margin-ms",
        int(MARGIN_S * 1000),
    ]
    if model:
        opts += ["--model", model]
    for s in split:
        opts.append(s)
    return Tree([DRIVER, *opts, *extra, *args], name="dist_driver")


def finish(tree, timeout=RUN_TIMEOUT_S):
    tree.wait(timeout)
    tree.assert_no_leftovers()
    return tree


def fields(stdout):
    out = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def close(got, want, tol):
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


def reference(model_path, inputs):
    """The whole TorchScript model run by PyTorch in this process (the unsplit model)."""
    model = torch.jit.load(model_path).eval()
    with torch.no_grad():
        out = model(**inputs)
    if isinstance(out, torch.Tensor):
        return {"output": out.contiguous()}
    return {f"output.{i}": t.contiguous() for i, t in enumerate(out)}


# ---- many shapes through one session ----


def token_inputs(shapes):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 256, shape, generator=g)} for shape in shapes]


def dense_inputs(batches, width=512):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(b, width, generator=g), "y": torch.randn(b, width, generator=g)} for b in batches]


LLAMA_SHAPES = [(4, 12), (1, 5), (3, 7), (8, 20), (2, 1), (5, 33)]
SHAPE_CASES = {
    # name: (model, fixture stem path, split, world, inputs, tolerance)
    "tiny_llama-3p": (
        split_fixture("tiny_llama.pt"),
        split_fixture("tiny_llama"),
        LLAMA_SPLIT,
        3,
        lambda: token_inputs(LLAMA_SHAPES),
        1e-4,
    ),
    "tiny_llama-2p": (
        split_fixture("tiny_llama.pt"),
        split_fixture("tiny_llama"),
        LLAMA_SPLIT,
        2,
        lambda: token_inputs(LLAMA_SHAPES),
        1e-4,
    ),
    "hf_llama-3p": (
        split_fixture("hf_llama.pt"),
        split_fixture("hf_llama"),
        HF_LLAMA_SPLIT,
        3,
        lambda: token_inputs(LLAMA_SHAPES),
        1e-4,
    ),
    "hf_llama-2p": (
        split_fixture("hf_llama.pt"),
        split_fixture("hf_llama"),
        HF_LLAMA_SPLIT,
        2,
        lambda: token_inputs(LLAMA_SHAPES),
        1e-4,
    ),
    "example_code-2p": (
        seed("example_code.traced.pt"),
        seed("example_code"),
        [],
        2,
        lambda: dense_inputs([16, 1, 3, 7, 32]),
        1e-5,
    ),
    "multi_mlp-3p": (seed("multi_mlp.traced.pt"), seed("multi_mlp"), [], 3, lambda: dense_inputs([16, 1, 5, 9]), 1e-5),
}


# Workers are `pipe worker` processes ("cli"), or this driver's own processes calling
# pipe_worker_run ("self").
SHAPE_RUNS = [(case, "cli") for case in SHAPE_CASES] + [("tiny_llama-3p", "self"), ("example_code-2p", "self")]
if SANITIZED:  # a decoder over three `pipe worker` processes, and dense inputs over the driver's own
    SHAPE_RUNS = [("tiny_llama-3p", "cli"), ("example_code-2p", "self")]


@pytest.mark.parametrize("case,workers", SHAPE_RUNS)
def test_one_session_many_batch_sizes_and_sequence_lengths(tmp_path, case, workers):
    model, stem, split, world, make_inputs, tol = SHAPE_CASES[case]
    # The reference path is the unsplit TorchScript model; it equals the generator's eager output.
    close(reference(model, load_file(f"{stem}.inputs.safetensors")), load_file(f"{stem}.expected.safetensors"), tol)
    inputs = make_inputs()
    paths = []
    for i, inp in enumerate(inputs):
        paths.append(tmp_path / f"in.{i}.safetensors")
        save_file(inp, paths[-1])
    tree = finish(
        driver("run", tmp_path, *paths, workers=workers, world=world, model=model, split=split, comm_ms=60000)
    )
    assert tree.returncode == 0, tree.stderr
    # The workers joined at the address the store reported through the log callback: its own port.
    assert re.fullmatch(r"127\.0\.0\.1:[1-9][0-9]*", fields(tree.stdout)["store"]), tree.stdout
    for i, inp in enumerate(inputs):
        want = reference(model, inp)
        for kind in ("seq", "async"):
            close(load_file(tmp_path / f"{kind}.{i}.safetensors"), want, tol)


# ---- a worker killed or stopped while it holds a call ----


# The gated model has one stage per process: rank r hosts stage r, where its calls are held.
FAULT_RUNS = [
    ("kill", "cli", 2, 1),
    ("kill", "cli", 3, 1),
    ("kill", "self", 3, 2),
    ("stop", "self", 2, 1),
    ("stop", "cli", 3, 2),
]


# Under the sanitizers: a killed worker in the middle of three, and a stopped one.
@pytest.mark.parametrize(
    "mode,workers,world,rank",
    [FAULT_RUNS[1], FAULT_RUNS[4]] if SANITIZED else FAULT_RUNS,
)
def test_worker_fault_breaks_the_session_and_a_new_one_works(tmp_path, mode, workers, world, rank):
    gate()  # the gate folder, which dist_driver and its workers share, and the operator here
    model = gated_model(world)
    inputs = seed("gated.inputs.safetensors")  # n = 0: every gate passes
    tree = finish(
        driver(mode, rank, rank, inputs, tmp_path, workers=workers, world=world, model=model),
        # creation twice, the held calls, the fault, destroy, and the workers' exits
        timeout=RUN_TIMEOUT_S + 4 * FAIL_WITHIN_S,
    )
    assert tree.returncode == 0, tree.stderr
    report = fields(tree.stdout)
    assert float(report["failed_after_ms"]) < FAIL_WITHIN_S * 1000
    assert float(report["destroy_ms"]) < FAIL_WITHIN_S * 1000
    assert report["message"], tree.stdout
    if mode == "stop":  # only its heartbeat tells a stopped worker from a slow one
        assert f"worker rank {rank} sent no heartbeat" in report["message"], report["message"]
    want = reference(model, load_file(inputs))
    close(load_file(tmp_path / "before.safetensors"), want, 1e-5)
    close(load_file(tmp_path / "after.safetensors"), want, 1e-5)


# ---- session creation that cannot work ----


@pytest.mark.parametrize(
    "store,status,needle",
    [
        ("nosuchhost.invalid:1234", "PIPE_ERR_COMMUNICATION", "nosuchhost.invalid"),
        ("192.0.2.1:29500", "PIPE_ERR_COMMUNICATION", "192.0.2.1"),  # TEST-NET-1: not this machine
        ("192.0.2.1:0", "PIPE_ERR_COMMUNICATION", "192.0.2.1"),
        ("127.0.0.1", "PIPE_ERR_INVALID_ARGUMENT", "127.0.0.1"),  # no port
        ("127.0.0.1:notaport", "PIPE_ERR_INVALID_ARGUMENT", "notaport"),
        ("127.0.0.1:65536", "PIPE_ERR_INVALID_ARGUMENT", "65536"),
        ("", "PIPE_ERR_INVALID_ARGUMENT", ""),
    ],
)
def test_session_with_a_wrong_store_address(store, status, needle):
    start = time.monotonic()
    tree = finish(driver("badstore", store, status, model=seed("example_code.traced.pt")), FAIL_WITHIN_S + 60)
    took = time.monotonic() - start
    assert tree.returncode == 0, tree.stderr + tree.stdout
    report = fields(tree.stdout)
    assert report["status"] == status
    assert needle in report["message"], report["message"]
    assert float(report["took_ms"]) < FAIL_WITHIN_S * 1000, took


def test_session_with_more_processes_than_stages():
    tree = finish(
        driver("badstore", ANY_PORT, "PIPE_ERR_INVALID_ARGUMENT", world=5, model=seed("example_code.traced.pt")),
        FAIL_WITHIN_S + 60,
    )
    assert tree.returncode == 0, tree.stderr + tree.stdout


def test_session_whose_workers_never_come():
    tree = finish(driver("noworkers", world=3, model=seed("example_code.traced.pt")), FAIL_WITHIN_S + 60)
    assert tree.returncode == 0, tree.stderr + tree.stdout
    report = fields(tree.stdout)
    assert report["status"] == "PIPE_ERR_COMMUNICATION"
    assert "missing ranks 1, 2" in report["message"], report["message"]
    # How to start them: with the port the store got, which the log callback reported.
    assert f"--store {report['store']}`" in report["message"], report


@pytest.mark.parametrize(
    "store,needle", [("127.0.0.1:{port}", "127.0.0.1:{port}"), ("nosuchhost.invalid:1234", "nosuchhost.invalid")]
)
def test_pipe_worker_run_with_nothing_at_the_store(store, needle):
    with refused_port() as port:  # nothing listens there while the worker tries
        store, needle = store.format(port=port), needle.format(port=port)
        start = time.monotonic()
        tree = finish(
            Tree(
                [DRIVER, "worker", "--rank", 1, "--world-size", 2, "--store", store, "--comm-timeout-ms", COMM_MS],
                name="pipe_worker_run",
            ),
            FAIL_WITHIN_S + 30,
        )
        took = time.monotonic() - start
    assert tree.returncode == 1, tree.stderr
    assert "PIPE_ERR_COMMUNICATION" in tree.stderr and needle in tree.stderr, tree.stderr
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"


@pytest.mark.parametrize("rank,world", [(0, 2), (2, 2), (1, 1), (-1, 3)])
def test_pipe_worker_run_with_a_rank_out_of_range(rank, world):
    # Refused before any store is looked for (nothing is at port 1 to be found anyway).
    tree = finish(
        Tree(
            [
                DRIVER,
                "worker",
                "--rank",
                rank,
                "--world-size",
                world,
                "--store",
                "127.0.0.1:1",
                "--comm-timeout-ms",
                COMM_MS,
            ],
            name="pipe_worker_run",
        ),
        FAIL_WITHIN_S,
    )
    assert tree.returncode == 1, tree.stderr
    assert "PIPE_ERR_INVALID_ARGUMENT" in tree.stderr, tree.stderr


def test_pipe_worker_run_refuses_port_zero():
    # Port 0 lets a driver's store pick a port; a worker needs the port the store got.
    tree = finish(
        Tree(
            [DRIVER, "worker", "--rank", 1, "--world-size", 2, "--store", ANY_PORT, "--comm-timeout-ms", COMM_MS],
            name="pipe_worker_run",
        ),
        FAIL_WITHIN_S,
    )
    assert tree.returncode == 1, tree.stderr
    assert "PIPE_ERR_INVALID_ARGUMENT" in tree.stderr and "port 0" in tree.stderr, tree.stderr
