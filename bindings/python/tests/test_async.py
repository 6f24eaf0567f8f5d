"""Cancellation, waiting with a timeout and deadlines. The calls run on the gated model: a call with
n = key stays in its stage until the test opens the gate, so "still running" and "past its
deadline" are states the test brings about before it looks at the one outcome it expects."""

import os
import threading
import time

import numpy as np
import pytest
from conftest import QUICK_N, WAIT_LIMIT_S, assert_close, held_session, inside, wait_until

import libpipe
from libpipe import Status


def past(moment):
    """Waits until the clock (the one libpipe's deadlines use, CLOCK_MONOTONIC) is past moment."""
    wait_until(lambda: time.monotonic() > moment, "past the deadline")


def test_wait_timeout_then_cancel(gate, gated_session, gated_inputs, gated_expected):
    x = gated_inputs["x"]
    key = gate.new_key()
    request = gated_session.submit(x, n=key)
    gate.wait(key, "stage0")
    # The gate is closed, so the call cannot finish: the wait can only time out.
    with pytest.raises(libpipe.WaitTimeoutError) as info:
        request.wait(timeout=0.05)
    assert info.value.status is Status.TIMEOUT
    assert "0.05 s" in info.value.message
    assert not request.done()  # the call goes on after a wait timed out
    request.cancel()
    # Still held at the gate, yet the call is over: cancelling does not wait for the stage.
    with pytest.raises(libpipe.CancelledError) as info:
        request.wait(timeout=WAIT_LIMIT_S)
    assert info.value.status is Status.CANCELLED
    assert request.done()
    with pytest.raises(libpipe.CancelledError):
        request.wait()  # the outcome stays
    gate.open(key)
    # The session is still usable, and correct.
    assert_close(gated_session.run(x, n=0)["output"], gated_expected)


def test_cancel_from_another_thread_wakes_a_waiter(gate, gated_session, gated_inputs):
    key = gate.new_key()
    request = gated_session.submit(gated_inputs["x"], n=key)
    outcome = []

    def waiter():
        try:
            request.wait()
            outcome.append("finished")
        except libpipe.Error as e:
            outcome.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: inside(thread, libpipe.Request.wait) or not thread.is_alive(), "waiting")
    # The gate is closed: the waiter is still waiting, whatever the machine's speed.
    assert thread.is_alive() and outcome == []
    # done() does not queue behind the waiter (checked in a thread, so a regression fails
    # instead of hanging: a done() that queued would wait for a call that cannot finish).
    checks = []
    checker = threading.Thread(target=lambda: checks.append(request.done()))
    checker.start()
    checker.join(timeout=WAIT_LIMIT_S)
    assert checks == [False]
    request.cancel()
    thread.join(timeout=WAIT_LIMIT_S)  # the gate is still closed: only the cancel can end the wait
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], libpipe.CancelledError)


def test_run_deadline(gate, gated_session, gated_inputs, gated_expected):
    x = gated_inputs["x"]
    key = gate.new_key()
    timeout = 0.25  # a whole number of milliseconds: libpipe's deadline is exactly this far away
    outcome = []

    def call():
        try:
            outcome.append(gated_session.run(x, n=key, timeout=timeout))
        except libpipe.Error as e:
            outcome.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    gate.wait(key, "stage0")
    # The deadline was set when the call started, before it arrived here; once the clock is past
    # it, the gate opens and the call could finish, but too late.
    past(time.monotonic() + timeout)
    gate.open(key)
    thread.join(timeout=WAIT_LIMIT_S)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], libpipe.DeadlineExceededError), outcome
    assert outcome[0].status is Status.DEADLINE_EXCEEDED
    assert "deadline" in outcome[0].message
    assert_close(gated_session.run(x, n=0, timeout=WAIT_LIMIT_S)["output"], gated_expected)


def test_submit_deadline(gate, gated_session, gated_inputs):
    key = gate.new_key()
    timeout = 0.25
    request = gated_session.submit(gated_inputs["x"], n=key, timeout=timeout)
    past(time.monotonic() + timeout)  # the deadline was set inside submit, before this
    gate.open(key)
    with pytest.raises(libpipe.DeadlineExceededError):
        request.wait(timeout=WAIT_LIMIT_S)


def threads():
    return set(os.listdir("/proc/self/task"))


def test_closing_the_session_cancels_its_requests(gate, gated_plan, gated_inputs):
    key = gate.new_key()
    before = threads()
    with held_session(gated_plan, gate) as session:
        request = session.submit(gated_inputs["x"], n=key)
        gate.wait(key, "stage0")
        # The session's stage threads: while the first is held at the gate, the second waits for
        # work and ends as soon as closing the session has stopped the pipeline.
        workers = threads() - before
        assert len(workers) >= 2
        closer = threading.Thread(target=session.close)
        closer.start()
        wait_until(lambda: workers - threads(), "a stage thread ended")
        # Only now may the held micro-batch go on: it finds the session closing.
        gate.open(key)
        closer.join(timeout=WAIT_LIMIT_S)
        assert not closer.is_alive()
    with pytest.raises(libpipe.CancelledError, match="destroyed"):
        request.wait(timeout=WAIT_LIMIT_S)


def test_closing_a_request_cancels_it(gate, gated_plan, gated_inputs, gated_expected):
    key = gate.new_key()
    # Fixed micro-batching: the next call is cut into 2 however soon the cancelled one leaves.
    with held_session(gated_plan, gate, microbatching="fixed") as session:
        request = session.submit(gated_inputs["x"], n=key)
        gate.wait(key, "stage0")
        request.close()
        with pytest.raises(libpipe.InvalidArgumentError, match="request is closed"):
            request.wait()
        gate.open(key)
        assert_close(session.run(gated_inputs["x"], n=0, timeout=WAIT_LIMIT_S)["output"], gated_expected)
        # Nothing of the cancelled call ran after it was cancelled: its first micro-batch finished
        # stage 0 and went no further, its second never ran. The next call's 2 ran in both.
        assert [s["microbatches"] for s in session.stats()] == [1 + 2, 2]


def test_replicated_zero_d_input(slow_session, slow_inputs, slow_expected):
    # n as a Python int, a numpy scalar and a 0-d array all reach libpipe as a 0-d int64 tensor
    # (slow_loop's output depends on n, so a wrong n shows).
    for n in (QUICK_N, np.int64(QUICK_N), np.array(QUICK_N)):
        assert_close(slow_session.run(slow_inputs["x"], n)["output"], slow_expected)
