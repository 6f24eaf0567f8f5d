"""Faults while requests stream through a multi-process `pipe bench`: a worker killed, a worker
stopped, the driver killed. The survivors report a communication error within the comm timeout
(plus a margin for slow machines), nothing hangs, and no process is left behind."""
import os
import signal
import time

import pytest
from disthelp import (COMM_MS, FAIL_WITHIN_S, assert_error_line, assert_one_line_error, cmdline, descendants,
                      free_store, pipe_tree, seed, start_worker, wait_busy, wait_until)

# Far more requests than the test waits for: the bench is still streaming when the fault lands.
ENDLESS = ["--requests", 10_000_000, "--concurrency", 2, "--microbatches", 2]


def bench(*extra):
    return pipe_tree("bench", seed("multi_mlp.traced.pt"), "--input", seed("multi_mlp.inputs.safetensors"),
                     *ENDLESS, "--comm-timeout-ms", COMM_MS, *extra, name="pipe bench")


def worker_children(tree, count):
    """The `pipe worker` processes under `tree`, by rank, once `count` of them run."""
    def found():
        workers = {}
        for pid in descendants(tree.proc.pid):
            args = cmdline(pid)
            if "worker" in args and "--rank" in args:
                workers[int(args[args.index("--rank") + 1])] = pid
        if tree.proc.poll() is not None:
            raise AssertionError(f"bench ended early ({tree.returncode}): {tree.stderr}")
        return workers if len(workers) == count else None

    return wait_until(found, 120, f"{count} worker processes")


@pytest.mark.parametrize("procs,victim", [(2, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_worker_fault_while_streaming_fails_the_driver(procs, victim, sig):
    tree = bench("--processes", procs)
    workers = worker_children(tree, procs - 1)
    time.sleep(2)  # past joining and loading
    wait_busy(workers[victim])  # requests stream through it
    assert tree.proc.poll() is None, tree.stderr
    killed_at = time.monotonic()
    os.kill(workers[victim], getattr(signal, sig))
    try:
        tree.wait(FAIL_WITHIN_S)  # kills the tree and fails if the driver hangs
        took = time.monotonic() - killed_at
    finally:
        if sig == "SIGSTOP":
            for s in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(workers[victim], s)
                except OSError:
                    pass
    assert_error_line(tree, "communication", lower=True)
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"
    tree.assert_no_leftovers()


def test_driver_killed_while_streaming_fails_the_workers():
    store = free_store()
    workers = [start_worker(rank, 3, store, comm_ms=COMM_MS) for rank in (1, 2)]
    driver = bench("--world-size", 3, "--store", store)
    time.sleep(2)
    for w in workers:
        wait_busy(w.proc.pid)
    assert driver.proc.poll() is None, driver.stderr
    os.kill(driver.proc.pid, signal.SIGKILL)
    driver.wait(30)
    for w in workers:
        w.wait(FAIL_WITHIN_S)  # fails the test if a worker hangs
        line = assert_one_line_error(w)
        assert "communication" in line.lower(), line
        w.assert_no_leftovers()


def test_external_worker_killed_while_streaming_fails_the_driver():
    store = free_store()
    workers = [start_worker(rank, 3, store, comm_ms=COMM_MS) for rank in (1, 2)]
    driver = bench("--world-size", 3, "--store", store)
    time.sleep(2)
    wait_busy(workers[1].proc.pid)
    os.kill(workers[1].proc.pid, signal.SIGKILL)
    driver.wait(FAIL_WITHIN_S)
    assert_error_line(driver, "communication", lower=True)
    # The broken session closes its connections: the other worker ends with a communication error.
    workers[0].wait(FAIL_WITHIN_S)
    line = assert_one_line_error(workers[0])
    assert "communication" in line.lower(), line


def test_driver_of_local_workers_killed_leaves_no_workers():
    # `pipe bench --processes 3` killed outright: its `pipe worker` children notice that the
    # driver went away and exit by themselves.
    tree = bench("--processes", 3)
    workers = worker_children(tree, 2)
    time.sleep(2)
    wait_busy(workers[1])
    os.kill(tree.proc.pid, signal.SIGKILL)
    tree.wait(30)
    tree.assert_no_leftovers()
