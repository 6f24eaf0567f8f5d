"""One session used from many Python threads at once, and the GIL released while libpipe works."""

import contextlib
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import WAIT_LIMIT_S, assert_close, inside, wait_until

import libpipe

THREADS = 8
RUNS = 4
M = 4  # micro-batches per call


@pytest.fixture(scope="module")
def eager(demo_path):
    # The same TorchScript model run by PyTorch itself, for references on arbitrary inputs.
    return torch.jit.load(str(demo_path)).eval()


@pytest.mark.parametrize("microbatching", ["fixed", "adaptive"])
def test_eight_threads_share_one_session(demo_plan, demo_x, eager, microbatching):
    # Every thread sends its own inputs, so a micro-batch routed to the wrong call would show.
    # Both ways of cutting calls must give every call its own correct result.
    inputs = [demo_x * (1 + 0.25 * i) - 0.1 * i for i in range(THREADS)]
    with torch.no_grad():
        references = [eager(torch.from_numpy(x)).numpy() for x in inputs]
    start = threading.Barrier(THREADS)
    results, failures = {}, []

    def worker(i):
        try:
            start.wait(timeout=60)
            for r in range(RUNS):
                x = inputs[i] if r % 2 else torch.from_numpy(inputs[i])  # both flavours at once
                results[(i, r)] = np.asarray(session.run(x, timeout=120)["output"])
        except Exception as e:  # reported below, with the thread it came from
            failures.append((i, e))

    with demo_plan.session(microbatches=M, microbatching=microbatching) as session:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        for (i, r), got in results.items():
            np.testing.assert_allclose(got, references[i], rtol=1e-4, atol=1e-4, err_msg=f"thread {i} run {r}")
        assert len(results) == THREADS * RUNS
        calls = THREADS * RUNS
        counts = [s["microbatches"] for s in session.stats()]
        assert len(counts) == 2 and counts[0] == counts[1]  # every micro-batch crosses both stages
        if microbatching == "fixed":
            assert counts[0] == calls * M  # every call cut into M, however busy the pipeline
        else:
            # A call that finds others in flight is cut more coarsely, never into fewer than 1 or
            # more than M (how much coarser depends on how the threads happen to overlap).
            assert calls <= counts[0] <= calls * M


def test_errors_stay_with_their_thread(demo_session, demo_x, demo_expected):
    # libpipe's error message is per thread: failing and succeeding calls interleaved from many
    # threads must each see their own outcome.
    start = threading.Barrier(THREADS)
    outcomes = [None] * THREADS

    def worker(i):
        start.wait(timeout=60)
        try:
            for _ in range(RUNS):
                if i % 2:
                    demo_session.run(demo_x, demo_x)
                else:
                    np.testing.assert_allclose(demo_session.run(demo_x)["output"], demo_expected, rtol=1e-4, atol=1e-4)
            outcomes[i] = "ok"
        except libpipe.InputError as e:
            outcomes[i] = e.message
        except Exception as e:
            outcomes[i] = repr(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, outcome in enumerate(outcomes):
        if i % 2:
            assert "takes 1 input" in outcome
        else:
            assert outcome == "ok"


# How long the fallback opener gives this thread to open a gate by itself. Only a held GIL (or a
# hung machine) keeps it from doing so; then the fallback ends the held call and the test fails.
FALLBACK_S = 120


@contextlib.contextmanager
def fallback_opener(gate, key):
    """Opens gate `key` after FALLBACK_S from a process of its own, which needs no GIL: if libpipe
    held the GIL while a call waits at the gate, this thread could never run to open it."""
    path = os.path.join(gate.dir, f"gate-{key}.open")
    proc = subprocess.Popen(["sh", "-c", f'sleep {FALLBACK_S} && touch "$0"', path], start_new_session=True)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def held_while_this_thread_ran(gate, key, target, inside_libpipe):
    """Runs target() on a thread of its own; the call with `key` stays held at the gate until this
    thread has seen inside_libpipe() (or target finished), then it opens the gate. True if the
    gate was still closed when this thread looked, that is, if this thread ran Python code while
    the other was inside libpipe; False if only the fallback opener could let the call go on."""
    finished = threading.Event()
    errors = []

    def run():
        try:
            target()
        except Exception as e:  # reported below, on this thread
            errors.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=run)
    with fallback_opener(gate, key):
        thread.start()
        wait_until(lambda: finished.is_set() or inside_libpipe(), "inside libpipe")
        held = not os.path.exists(os.path.join(gate.dir, f"gate-{key}.open"))
        gate.open(key)
        thread.join(timeout=WAIT_LIMIT_S)
    assert not thread.is_alive()
    assert errors == []
    return held


def test_gil_is_released_during_run(gate, gated_session, gated_inputs, gated_expected):
    # The call is one C function (pipe_session_run), inside which the call arrives at the gate,
    # and which returns only once the gate opens: this thread sees the arrival while the other
    # is inside, or, if that one held the GIL, only after the fallback opened the gate.
    key = gate.new_key()
    outcome = []

    def call():
        outcome.append(gated_session.run(gated_inputs["x"], n=key))

    held = held_while_this_thread_ran(gate, key, call, lambda: gate.count(key, "stage0") > 0)
    assert held, "this thread could not run while the call was inside libpipe: the GIL was held"
    assert len(outcome) == 1
    assert_close(outcome[0]["output"], gated_expected)


def test_gil_is_released_while_waiting(gate, gated_session, gated_inputs, gated_expected, monkeypatch):
    # Request.wait waits in slices (so that Ctrl-C gets through); one slice longer than the
    # fallback makes the whole wait one C call (pipe_request_wait), which returns only once the
    # gate opens. With switching between threads left to the threads themselves (a switch
    # interval far beyond the test), this thread gets the GIL back from the waiter only when the
    # waiter gives it up: inside that call if libpipe releases it, otherwise only after the
    # fallback has opened the gate and the call has returned.
    monkeypatch.setattr(libpipe.Request, "_POLL_S", 10 * FALLBACK_S)
    key = gate.new_key()
    request = gated_session.submit(gated_inputs["x"], n=key)
    gate.wait(key, "stage0")
    outcome = []
    waiters = []

    def waiter():
        waiters.append(threading.current_thread())
        outcome.append(request.wait())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * FALLBACK_S)
    try:
        held = held_while_this_thread_ran(
            gate, key, waiter, lambda: bool(waiters) and inside(waiters[0], libpipe.Request.wait)
        )
    finally:
        sys.setswitchinterval(interval)
    assert held, "this thread could not run while the waiter was inside libpipe: the GIL was held"
    assert len(outcome) == 1
    assert_close(outcome[0]["output"], gated_expected)
