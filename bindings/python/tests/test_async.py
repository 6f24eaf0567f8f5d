"""Cancellation, waiting with a timeout and deadlines, on slow_loop (a call that takes seconds)."""
import threading

import numpy as np
import pytest
from conftest import QUICK_N, SLOW_N, assert_close

import libpipe
from libpipe import Status


def test_wait_timeout_then_cancel(slow_session, slow_inputs, slow_expected):
    x = slow_inputs["x"]
    request = slow_session.submit(x, n=SLOW_N)
    with pytest.raises(libpipe.WaitTimeoutError) as info:
        request.wait(timeout=0.05)
    assert info.value.status is Status.TIMEOUT
    assert "0.05 s" in info.value.message
    assert not request.done()  # the call goes on after a wait timed out
    request.cancel()
    with pytest.raises(libpipe.CancelledError) as info:
        request.wait(timeout=60)
    assert info.value.status is Status.CANCELLED
    assert request.done()
    with pytest.raises(libpipe.CancelledError):
        request.wait()  # the outcome stays
    # The session is still usable, and correct.
    assert_close(slow_session.run(x, n=QUICK_N)["output"], slow_expected)


def test_cancel_from_another_thread_wakes_a_waiter(slow_session, slow_inputs):
    request = slow_session.submit(slow_inputs["x"], n=SLOW_N)
    outcome = []

    def waiter():
        try:
            request.wait()
            outcome.append("finished")
        except libpipe.Error as e:
            outcome.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(timeout=0.3)
    assert thread.is_alive()  # still waiting for the slow call
    # done() does not queue behind the waiter (checked in a thread, so a regression fails
    # instead of hanging).
    checks = []
    checker = threading.Thread(target=lambda: checks.append(request.done()))
    checker.start()
    checker.join(timeout=10)
    assert checks == [False]
    request.cancel()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], libpipe.CancelledError)


def test_run_deadline(slow_session, slow_inputs, slow_expected):
    x = slow_inputs["x"]
    with pytest.raises(libpipe.DeadlineExceededError) as info:
        slow_session.run(x, n=SLOW_N, timeout=0.1)
    assert info.value.status is Status.DEADLINE_EXCEEDED
    assert "deadline" in info.value.message
    assert_close(slow_session.run(x, n=QUICK_N, timeout=60)["output"], slow_expected)


def test_submit_deadline(slow_session, slow_inputs):
    request = slow_session.submit(slow_inputs["x"], n=SLOW_N, timeout=0.1)
    with pytest.raises(libpipe.DeadlineExceededError):
        request.wait(timeout=60)


def test_closing_the_session_cancels_its_requests(slow_plan, slow_inputs):
    session = slow_plan.session(microbatches=2, input_specs={"n": "replicate"})
    request = session.submit(slow_inputs["x"], n=SLOW_N)
    session.close()
    with pytest.raises(libpipe.CancelledError):
        request.wait(timeout=60)


def test_closing_a_request_cancels_it(slow_session, slow_inputs, slow_expected):
    request = slow_session.submit(slow_inputs["x"], n=SLOW_N)
    request.close()
    with pytest.raises(libpipe.InvalidArgumentError, match="request is closed"):
        request.wait()
    # Nothing of the cancelled call is left in the way of the next one.
    assert_close(slow_session.run(slow_inputs["x"], n=QUICK_N, timeout=60)["output"], slow_expected)


def test_replicated_zero_d_input(slow_session, slow_inputs, slow_expected):
    # n as a Python int, a numpy scalar and a 0-d array all reach libpipe as a 0-d int64 tensor.
    for n in (QUICK_N, np.int64(QUICK_N), np.array(QUICK_N)):
        assert_close(slow_session.run(slow_inputs["x"], n)["output"], slow_expected)
