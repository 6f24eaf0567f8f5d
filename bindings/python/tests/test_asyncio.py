"""asyncio: `await session.run_async(...)`, `await request` and Request.fileno(). The calls run on
the gated model: a call with n = key stays in its stage until the test opens the gate, so "held",
"cancelled while held" and "past its deadline while held" are states the test brings about before
it looks at the one outcome it expects. No verdict depends on how long anything takes."""

import asyncio
import os
import selectors
import time

import pytest
from conftest import WAIT_LIMIT_S, assert_close, held_session

import libpipe
from libpipe import Status


def run(coroutine):
    """Runs a test's coroutine on a fresh event loop; the bound only ends a hung test."""
    return asyncio.run(asyncio.wait_for(coroutine, WAIT_LIMIT_S))


async def until(condition, what):
    """Waits, yielding to the event loop, until condition() is true: for a state the test
    brought about. The bound only ends a hung test."""
    give_up = time.monotonic() + WAIT_LIMIT_S
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not {what} after {WAIT_LIMIT_S} s")
        await asyncio.sleep(0.002)


def thread_count():
    return len(os.listdir("/proc/self/task"))


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_run_async_gives_the_outputs(gated_session, gated_inputs, gated_expected):
    async def main():
        return await gated_session.run_async(gated_inputs["x"], n=0)

    assert_close(run(main())["output"], gated_expected)


def test_await_a_submitted_request(gated_session, gated_inputs, gated_expected):
    async def main():
        request = gated_session.submit(gated_inputs["x"], n=0)
        first = await request
        again = await request  # the outcome stays, as for wait()
        return request, first, again

    request, first, again = run(main())
    assert_close(first["output"], gated_expected)
    assert again is first
    assert request.done() and request.wait() is first


def test_run_async_outputs_follow_the_inputs(gated_session, gated_inputs, gated_expected):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(gated_inputs["x"])

    async def main():
        return (
            await gated_session.run_async(x, n=0),
            await gated_session.run_async(gated_inputs["x"], n=0, output_type="torch"),
        )

    from_torch, asked = run(main())
    assert isinstance(from_torch["output"], torch.Tensor) and isinstance(asked["output"], torch.Tensor)
    assert_close(from_torch["output"].numpy(), gated_expected)
    assert_close(asked["output"].numpy(), gated_expected)


def test_many_calls_on_one_loop_park_no_thread(gate, gated_plan, gated_inputs, gated_expected):
    calls = 32
    x = gated_inputs["x"]
    key = gate.new_key()
    # One micro-batch per call and room for all of them: every call is admitted at once (a full
    # pipeline would make submit wait for room on the loop's thread, see run_async).
    with held_session(gated_plan, gate, microbatches=1, max_inflight=calls) as session:

        async def main():
            # A first call starts whatever the session starts on first use (the stages' intra-op
            # threads), so that what is counted next is only what the held calls add.
            assert_close((await session.run_async(x, n=0))["output"], gated_expected)
            before = thread_count()
            tasks = [asyncio.create_task(session.run_async(x, n=key)) for _ in range(calls)]
            # All submitted and held: the first in stage 0 at the gate, the others queued behind it.
            await until(
                lambda: gate.count(key, "stage0") == 1 and session.stats()[0]["queue_depth"] == calls - 1,
                f"{calls} calls held",
            )
            held = thread_count()
            assert not any(t.done() for t in tasks)
            gate.open(key)
            return before, held, await asyncio.gather(*tasks)

        before, held, results = run(main())
    # A thread per waiting call would add `calls` (a pool of waiting threads, its size); the
    # session's own threads all run since the first call. Two spare for a library's own.
    assert held - before <= 2, f"{before} threads before the {calls} calls, {held} while they were held"
    assert len(results) == calls
    for out in results:
        assert_close(out["output"], gated_expected)


@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
def test_cancelling_the_task_cancels_the_call(how, gate, gated_plan, gated_inputs, gated_expected):
    x = gated_inputs["x"]
    key = gate.new_key()
    # Fixed micro-batching: every call is cut into 2, however soon the cancelled one leaves.
    with held_session(gated_plan, gate, microbatching="fixed") as session:

        async def main():
            assert_close((await session.run_async(x, n=0))["output"], gated_expected)
            fds = open_fds()
            task = asyncio.create_task(session.run_async(x, n=key))
            await until(lambda: gate.count(key, "stage0") == 1, "held in stage 0")
            if how == "task.cancel":
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                # The gate stays closed, so only the timeout can end this wait (its length
                # decides nothing); wait_for then cancels the task.
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(task, 0.05)
            assert task.cancelled()
            # The request was freed: its descriptor is closed, and the loop watches nothing.
            assert open_fds() == fds
            gate.open(key)
            return session.run(x, n=0, timeout=WAIT_LIMIT_S)  # the session goes on

        assert_close(run(main())["output"], gated_expected)
        # The cancelled call's first micro-batch finished stage 0 and went no further; its second
        # never ran. The two other calls ran 2 each in both stages.
        assert gate.count(key, "stage1") == 0
        assert [s["microbatches"] for s in session.stats()] == [2 + 1 + 2, 2 + 2]


def test_deadline_ends_a_held_call_by_itself(gate, gated_session, gated_inputs, gated_expected):
    x = gated_inputs["x"]
    key = gate.new_key()

    async def main():
        with pytest.raises(libpipe.DeadlineExceededError) as info:
            await gated_session.run_async(x, n=key, timeout=0.5)
        # Nobody opened the gate: the deadline fired in libpipe while the call was held there
        # (or, on a machine too busy to bring it there within 0.5 s, before it arrived).
        assert gate.count(key, "stage0", "left") == 0
        return info.value

    error = run(main())
    assert error.status is Status.DEADLINE_EXCEEDED and "deadline" in error.message
    gate.open(key)
    assert_close(gated_session.run(x, n=0, timeout=WAIT_LIMIT_S)["output"], gated_expected)


def test_input_errors_raise_when_the_coroutine_starts(gated_session, gated_inputs):
    x = gated_inputs["x"]
    with pytest.raises(libpipe.InputError) as sync:
        gated_session.run(x)  # n is missing
    coroutine = gated_session.run_async(x)
    # The first step raises: the error is not put off to a later await.
    with pytest.raises(libpipe.InputError) as not_awaited:
        coroutine.send(None)
    assert not_awaited.value.status is sync.value.status is Status.INPUT
    with pytest.raises(libpipe.InputError, match="unknown input"):
        run(gated_session.run_async(x, m=0))


def test_fileno_says_when_the_call_finished(gate, gated_session, gated_inputs, gated_expected):
    key = gate.new_key()
    request = gated_session.submit(gated_inputs["x"], n=key)
    fd = request.fileno()
    assert request.fileno() == fd  # one descriptor per request
    gate.wait(key, "stage0")
    with selectors.DefaultSelector() as selector:
        selector.register(request, selectors.EVENT_READ)
        assert selector.select(timeout=0) == []  # held at the gate: not finished
        gate.open(key)
        ready = selector.select(timeout=WAIT_LIMIT_S)
        assert [k.fileobj for k, _ in ready] == [request]
        assert selector.select(timeout=0) != []  # it stays readable
        selector.unregister(request)
    assert_close(request.wait(0)["output"], gated_expected)
    with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
        request.fileno()  # the outcome is kept; the request and its descriptor are gone


def test_tasks_awaiting_one_request(gate, gated_session, gated_inputs):
    key = gate.new_key()

    async def main():
        request = gated_session.submit(gated_inputs["x"], n=key)
        first = asyncio.create_task(_awaited(request))
        second = asyncio.create_task(_awaited(request))
        # Both tasks take their first step (up to awaiting the request) before this coroutine
        # resumes: the loop runs ready callbacks in the order they were scheduled. A task
        # cancelled before its first step would never have awaited, so it could not cancel.
        await asyncio.sleep(0)
        await until(lambda: gate.count(key, "stage0") == 1, "held in stage 0")
        first.cancel()  # cancels the call, as cancelling an awaited future would
        with pytest.raises(asyncio.CancelledError):
            await first
        # The gate is still closed: only the cancel can have ended the call.
        with pytest.raises(libpipe.CancelledError):
            await second
        with pytest.raises(libpipe.CancelledError):
            request.wait(0)  # the outcome stays
        request.close()

    run(main())


async def _awaited(request):
    return await request
