"""Faults while a multi-process `pipe bench` holds work in a worker: a worker killed, a worker
stopped, the driver killed or stopped. Every request carries a gate key (tests/gate): the test opens the gates
of the stages before the victim's and waits until the victim's stage holds a micro-batch, so the
fault always lands on a process with work in hand, whatever the machine's load. The survivors
report a communication error within the comm timeout (plus a margin for slow machines), nothing
hangs, and no process is left behind."""

import os
import signal
import time

import pytest
from disthelp import (
    COMM_MS,
    FAIL_WITHIN_S,
    JOIN_MS,
    SANITIZED,
    assert_error_line,
    assert_one_line_error,
    cmdline,
    descendants,
    gate,
    gated_inputs,
    gated_model,
    pipe_tree,
    start_driver,
    start_worker,
    wait_held,
    wait_stopped,
    wait_until,
)


def bench(stages, inputs, *extra, name="pipe bench"):
    """`pipe bench` of the gated model: its warm-up calls are held at the gates the test opens."""
    return pipe_tree(
        "bench",
        gated_model(stages),
        "--input",
        inputs,
        "--requests",
        4,
        "--concurrency",
        2,
        "--microbatches",
        2,
        *extra,
        name=name,
        env=gate().child_env(),
    )


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


def hold_in(key, stage, *trees):
    """Lets call `key` through the stages before `stage` and waits until `stage` holds it."""
    for before in range(stage):
        gate().open(key, f"stage{before}")
    wait_held(key, f"stage{stage}", *trees)


def fault(pid, sig, key):
    """Sends `sig`; once it took effect, opens every gate of `key`: the survivors may finish what
    they hold (the victim cannot), so only the fault decides what happens next."""
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        wait_stopped(pid)
    gate().open(key)


# Each rank r hosts stage r: the gated model has as many stages as there are processes.
FAULT_RUNS = [(procs, victim, sig) for sig in ("SIGKILL", "SIGSTOP") for procs, victim in ((2, 1), (3, 1), (3, 2))]


# Under the sanitizers: the middle one of three killed, the last one stopped.
@pytest.mark.parametrize("procs,victim,sig", [(3, 1, "SIGKILL"), (3, 2, "SIGSTOP")] if SANITIZED else FAULT_RUNS)
def test_worker_fault_while_it_holds_work_fails_the_driver(tmp_path, procs, victim, sig):
    key = gate().new_key()
    tree = bench(
        procs, gated_inputs(tmp_path / "in.safetensors", key), "--processes", procs, "--comm-timeout-ms", COMM_MS
    )
    workers = worker_children(tree, procs - 1)
    hold_in(key, victim, tree)
    signum = getattr(signal, sig)
    faulted_at = time.monotonic()
    try:
        fault(workers[victim], signum, key)
        tree.wait(FAIL_WITHIN_S)  # kills the tree and fails if the driver hangs
        took = time.monotonic() - faulted_at
    finally:
        if signum == signal.SIGSTOP:
            for s in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(workers[victim], s)
                except OSError:
                    pass
    assert_error_line(tree, "communication", lower=True)
    if signum == signal.SIGSTOP:  # only its heartbeat tells a stopped worker from a slow one
        assert_error_line(tree, f"worker rank {victim} sent no heartbeat for {COMM_MS} ms")
    assert took < FAIL_WITHIN_S, f"took {took:.1f} s"
    tree.assert_no_leftovers()


def test_driver_killed_while_workers_hold_work_fails_the_workers(tmp_path):
    # A killed driver is noticed at once: the generous JOIN_MS only lets the workers join.
    key = gate().new_key()
    env = gate().child_env()
    driver, store = start_driver(
        "bench",
        gated_model(3),
        "--input",
        gated_inputs(tmp_path / "in.safetensors", key),
        "--requests",
        4,
        "--world-size",
        3,
        "--comm-timeout-ms",
        JOIN_MS,
        env=env,
        name="pipe bench",
    )
    workers = [start_worker(rank, 3, store, comm_ms=JOIN_MS, env=env) for rank in (1, 2)]
    hold_in(key, 1, driver, *workers)
    fault(driver.proc.pid, signal.SIGKILL, key)
    driver.wait(30)
    for w in workers:
        w.wait(FAIL_WITHIN_S)  # fails the test if a worker hangs
        line = assert_one_line_error(w)
        assert "communication" in line.lower(), line
        w.assert_no_leftovers()


def test_external_worker_killed_while_it_holds_work_fails_the_driver(tmp_path):
    key = gate().new_key()
    env = gate().child_env()
    driver, store = start_driver(
        "bench",
        gated_model(3),
        "--input",
        gated_inputs(tmp_path / "in.safetensors", key),
        "--requests",
        4,
        "--world-size",
        3,
        "--comm-timeout-ms",
        JOIN_MS,
        env=env,
        name="pipe bench",
    )
    workers = [start_worker(rank, 3, store, comm_ms=JOIN_MS, env=env) for rank in (1, 2)]
    hold_in(key, 2, driver, *workers)
    fault(workers[1].proc.pid, signal.SIGKILL, key)  # rank 2
    driver.wait(FAIL_WITHIN_S)
    assert_error_line(driver, "communication", lower=True)
    # The broken session closes its connections: the other worker ends with a communication error.
    workers[0].wait(FAIL_WITHIN_S)
    line = assert_one_line_error(workers[0])
    assert "communication" in line.lower(), line


def test_driver_of_local_workers_killed_leaves_no_workers(tmp_path):
    # `pipe bench --processes 3` killed outright: its `pipe worker` children notice that the
    # driver went away and exit by themselves.
    key = gate().new_key()
    tree = bench(3, gated_inputs(tmp_path / "in.safetensors", key), "--processes", 3, "--comm-timeout-ms", COMM_MS)
    worker_children(tree, 2)
    hold_in(key, 1, tree)
    fault(tree.proc.pid, signal.SIGKILL, key)
    tree.wait(30)
    tree.assert_no_leftovers()


def test_driver_stopped_while_workers_wait_for_work_fails_the_workers(tmp_path):
    # A stopped driver keeps its connections open and the workers hold nothing: only the store's
    # silence to their heartbeats tells them that it is gone.
    key = gate().new_key()
    env = gate().child_env()
    driver, store = start_driver(
        "bench",
        gated_model(3),
        "--input",
        gated_inputs(tmp_path / "in.safetensors", key),
        "--requests",
        4,
        "--world-size",
        3,
        "--comm-timeout-ms",
        JOIN_MS,
        env=env,
        name="pipe bench",
    )
    workers = [start_worker(rank, 3, store, comm_ms=COMM_MS, env=env) for rank in (1, 2)]
    wait_held(key, "stage0", driver, *workers)  # stage 0 is the driver's: the workers are idle
    os.kill(driver.proc.pid, signal.SIGSTOP)
    try:
        wait_stopped(driver.proc.pid)
        lines = []
        for w in workers:
            w.wait(FAIL_WITHIN_S)  # fails the test if a worker hangs
            lines.append(assert_one_line_error(w, "lost its session", "[PIPE_ERR_COMMUNICATION]"))
            w.assert_no_leftovers()
        # The first to notice names the silent store; the other may learn it from that one's
        # closed connections instead.
        assert any("store did not answer a heartbeat" in line for line in lines), lines
    finally:
        for s in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(driver.proc.pid, s)
            except OSError:
                pass
        driver.wait(30)
