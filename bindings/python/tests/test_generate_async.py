"""Generation with asyncio: `async for` over a Generation and `await generation`, the event loop
watching each generation's descriptor (no thread per generation). Held sequences come from the
gated decoder (a prompt whose first token is 119 + key is held in stage 1 until the test opens
gate `key`), so that "held", "cancelled while held" and "closed while awaited" are states the test
brings about before it looks at the one outcome it expects."""

import asyncio
import os
import time

import pytest
from conftest import WAIT_LIMIT_S, gated_generator

import libpipe


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


def open_fds(gate):
    """{descriptor: what it is}, so that a difference says what stayed open. The gate operator's
    files are left out: a stage thread held at the gate may still be creating one (the test does
    not wait for the stage, only for the sequence, which a cancel ends without it)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if not target.startswith(gate.gate.dir):
            fds[fd] = target
    return fds


async def collect(generation):
    return [token async for token in generation]


def test_async_for_gives_the_greedy_tokens(tiny_generator, decoder_expected):
    n = decoder_expected["max_new_tokens"]

    async def main():
        generations = [tiny_generator.generate(p, max_new_tokens=n) for p in decoder_expected["prompts"]]
        return await asyncio.gather(*(collect(g) for g in generations)), generations

    results, generations = run(main())
    assert results == decoder_expected["greedy"]
    assert all(g.finish_reason == "length" for g in generations)


def test_await_a_generation(tiny_generator, decoder_expected):
    n = decoder_expected["max_new_tokens"]

    async def main():
        generation = tiny_generator.generate(decoder_expected["prompts"][0], max_new_tokens=n)
        first = await generation
        again = await generation  # the outcome stays, as for wait()
        return generation, first, again

    generation, first, again = run(main())
    assert first == again == generation.wait() == decoder_expected["greedy"][0]


def test_many_generations_on_one_loop_park_no_thread(gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    prompts, greedy = decoder_expected["prompts"], decoder_expected["greedy"]
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        count = 4 * generator.info.slots  # within max_queued's default (4 x slots) beside the held one
        key = decoder_gate.new_key()

        async def main():
            # A first generation starts whatever starts on first use (the stages' intra-op threads).
            assert await generator.generate(prompts[0], max_new_tokens=n) == greedy[0]
            before = thread_count()
            held = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
            tasks = [asyncio.create_task(collect(held))]
            await until(lambda: decoder_gate.gate.count(key, "stage1") == 1, "the first held")
            tasks += [
                asyncio.create_task(collect(generator.generate(prompts[i % len(prompts)], max_new_tokens=n)))
                for i in range(count)
            ]
            # Every task is awaiting its generation's descriptor: nothing can come while the gate is shut.
            await asyncio.sleep(0)
            await until(lambda: generator.stats()["slots_in_use"] == generator.info.slots, "the slots taken")
            held_threads = thread_count()
            assert not any(t.done() for t in tasks)
            decoder_gate.open(key)
            return before, held_threads, await asyncio.gather(*tasks)

        before, held_threads, results = run(main())
    # A thread per generation would add `count`. Two spare for a library's own.
    assert held_threads - before <= 2, f"{before} threads before, {held_threads} while {count} generations waited"
    assert len(results[0]) == n
    assert results[1:] == [greedy[i % len(greedy)] for i in range(count)]


@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
def test_cancelling_the_task_cancels_the_generation(how, gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()

        async def main():
            fds = open_fds(decoder_gate)
            generation = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
            task = asyncio.create_task(collect(generation))
            await until(lambda: decoder_gate.gate.count(key, "stage1") == 1, "held in stage 1")
            if how == "task.cancel":
                await asyncio.sleep(0)  # the task awaits the descriptor
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                # The gate stays shut, so only the timeout can end this wait (its length decides
                # nothing); wait_for then cancels the task.
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(task, 0.05)
            assert task.cancelled()
            decoder_gate.open(key)
            # The sequence was cancelled (not only the task): its held step's token is dropped.
            with pytest.raises(libpipe.CancelledError):
                await generation
            assert generation.finish_reason == "cancelled" and generation.tokens == []
            # Its end was read, so it is freed with its descriptor; the loop watches nothing.
            assert open_fds(decoder_gate) == fds
            return await generator.generate(decoder_expected["prompts"][0], max_new_tokens=n)

        assert run(main()) == decoder_expected["greedy"][0]


def test_closing_a_generation_a_task_awaits(gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()

        async def main():
            fds = open_fds(decoder_gate)
            generation = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
            task = asyncio.create_task(collect(generation))
            await until(lambda: decoder_gate.gate.count(key, "stage1") == 1, "held in stage 1")
            await asyncio.sleep(0)  # the task awaits the descriptor
            # The loop still watches the descriptor, so it is closed once the loop lets go of it.
            generation.close()
            decoder_gate.open(key)
            with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
                await task
            assert generation.closed and open_fds(decoder_gate) == fds
            return await generator.generate(decoder_expected["prompts"][0], max_new_tokens=n)

        assert run(main()) == decoder_expected["greedy"][0]
