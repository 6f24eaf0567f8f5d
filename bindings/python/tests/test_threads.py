"""One session used from many Python threads at once, and the GIL released while libpipe works."""
import threading
import time

import numpy as np
import pytest
import torch
from conftest import SLOW_N

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


def test_gil_is_released_during_run(slow_session, slow_inputs):
    # While one thread is inside a multi-second run, this thread keeps running Python code. If
    # the run held the GIL, this loop could not come back from sleep until the run returned, so
    # it would count at most a couple of ticks in all.
    entered, finished = threading.Event(), threading.Event()
    outcome = []

    def call():
        entered.set()
        try:
            slow_session.run(slow_inputs["x"], n=SLOW_N, timeout=1.0)
            outcome.append("finished")
        except libpipe.Error as e:
            outcome.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=call)
    thread.start()
    assert entered.wait(timeout=60)
    ticks = 0
    while not finished.is_set():
        time.sleep(0.005)
        ticks += 1
    thread.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], libpipe.DeadlineExceededError)
    assert ticks >= 10, f"only {ticks} ticks while libpipe ran: the GIL was held"


def test_gil_is_released_while_waiting(slow_session, slow_inputs):
    request = slow_session.submit(slow_inputs["x"], n=SLOW_N)
    done = threading.Event()

    def waiter():
        try:
            request.wait()
        except libpipe.CancelledError:
            pass
        finally:
            done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    ticks = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # progress here while the other thread waits in libpipe
        time.sleep(0.005)
        ticks += 1
    assert not done.is_set()
    assert ticks >= 10
    request.cancel()
    thread.join(timeout=60)
    assert done.is_set()
