"""Stages spread over processes (libpipe >= 0.4): a Gloo session in this process (rank 0, the
driver) whose rank-1 worker is `libpipe.run_worker` in a child Python process; a worker that is
killed or stopped (its heartbeat stops) breaks the session with CommunicationError, whether or not
it holds a call, while one that computes a call for several comm timeouts is only slow; bad stores
and arguments.

The driver's store is given 127.0.0.1:0 and picks a free port itself; the tests learn the port from
libpipe's log ("store listening on HOST:PORT", read with the fixtures' storeport.py, shared with
tests/distributed) and only then tell the worker, which was started beforehand and waits for it.
The calls that a fault must fail are held at the test gate (the gated model, conftest.py) in the
worker's stage, so the fault lands on a worker with work in hand. Time bounds only tell a hang
from a slow run: "within comm_timeout plus a generous margin", which also tells a comm_timeout that
reached libpipe from its one-minute default."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import assert_close, wait_until

import libpipe
from libpipe import Status, _native

# The fixtures folder holds storeport.py (tests/distributed), as it holds gate.py.
sys.path.insert(0, os.environ.get("LIBPIPE_FIXTURES", ""))
from storeport import ANY_PORT, StoreLog, refused_port, wait_for_store  # noqa: E402

MARGIN_S = 30.0  # what a slow machine may add to a comm_timeout
CREATE_TIMEOUT_S = 60.0  # joining and loading, for the sessions that are not about timeouts


@contextlib.contextmanager
def worker_process(tmp_path, rank=1, world_size=2, comm_timeout=CREATE_TIMEOUT_S, env=None):
    """A child Python (the installed package, as the tests use it) that serves `rank` with
    libpipe.run_worker. It prints "ready" once libpipe (and torch) are imported, then reads the
    store address from its stdin (`tell`), so that its start-up never counts against a session's
    comm_timeout; it prints "finished" when run_worker returned, or the error's class and message
    when it raised (exit code 3). Yields the Popen once "ready" was read; killed (if still running)
    on the way out."""
    code = (
        "import sys, libpipe\n"
        "print('ready', flush=True)\n"
        "store = sys.stdin.readline().strip()\n"
        "try:\n"
        f"    libpipe.run_worker({rank}, {world_size}, store, comm_timeout={comm_timeout!r})\n"
        "except libpipe.Error as e:\n"
        "    print(type(e).__name__, e.message, flush=True)\n"
        "    sys.exit(3)\n"
        "print('finished', flush=True)\n"
    )
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONPATH", None)
    stderr = open(tmp_path / f"worker-{rank}.stderr", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        cwd="/",
    )
    try:
        line = proc.stdout.readline()
        assert line == "ready\n", f"the worker did not start: {line!r}; stderr: {worker_stderr(tmp_path, rank)}"
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a stopped process is not killed until continued
                proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        stderr.close()


def tell(worker, store):
    """Gives a waiting worker_process the store address to join."""
    worker.stdin.write(store + "\n")
    worker.stdin.flush()


def worker_stderr(tmp_path, rank=1):
    path = tmp_path / f"worker-{rank}.stderr"
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def finish(proc, timeout=60):
    """The worker's exit code and what it printed after "ready"."""
    rc = proc.wait(timeout=timeout)
    return rc, proc.stdout.read()


def gloo_session(plan, worker, **options):
    """plan.session(transport="tcp", world_size=2, store=ANY_PORT, **options), created in a thread
    of this process; once libpipe reports the address its store got, `worker` is told it. Returns
    the session and that address."""
    created = {}

    def create():
        try:
            created["session"] = plan.session(transport="tcp", world_size=2, store=ANY_PORT, **options)
        except BaseException as e:  # raised below, in the test's thread
            created["error"] = e

    with StoreLog() as log:
        thread = threading.Thread(target=create, daemon=True)
        thread.start()
        store = wait_for_store(log.text, alive=thread.is_alive, what="plan.session")
        tell(worker, store)
        thread.join(CREATE_TIMEOUT_S + MARGIN_S)
    assert not thread.is_alive(), "plan.session hung"
    if "error" in created:
        raise created["error"]
    return created["session"], store


def gated_gloo_session(gated_plan, worker, comm_timeout):
    return gloo_session(gated_plan, worker, microbatches=2, input_specs={"n": "replicate"}, comm_timeout=comm_timeout)


def hold_in_worker(session, gate, x):
    """Submits a call that is let through stage 0 (here) and held in stage 1 (the worker): once
    this returns, the worker has work in hand."""
    key = gate.new_key()
    request = session.submit(x, n=key)
    gate.open(key, "stage0")
    gate.wait(key, "stage1")
    return key, request


def wait_stopped(proc):
    """Waits until a SIGSTOP sent to proc has taken effect."""

    def stopped():
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "Tt"

    wait_until(stopped, f"process {proc.pid} stopped")


# ---- a Gloo session with a worker process ---------------------------------------------------


def test_gloo_session_with_a_worker_process_equals_local(demo_plan, demo_x, demo_expected, tmp_path):
    assert demo_plan.num_stages == 2
    with demo_plan.session(microbatches=4) as local:
        local.check()  # a local session is never broken
        want = local.run(demo_x)["output"]
        want_part = local.run(demo_x[:3])["output"]
    assert_close(want, demo_expected)

    with worker_process(tmp_path) as worker:
        session, store = gloo_session(demo_plan, worker, microbatches=4, comm_timeout=CREATE_TIMEOUT_S)
        try:
            assert store.startswith("127.0.0.1:") and store != ANY_PORT  # the port the store got
            assert session.num_stages == 2
            assert (session.transport, session.world_size, session.store) == ("tcp", 2, ANY_PORT)  # as given
            assert "tcp" in repr(session)
            assert session.check() is None
            out = session.run(demo_x)
            assert list(out) == ["output"]
            assert_close(out["output"], demo_expected)
            np.testing.assert_array_equal(out["output"], want)  # the same arithmetic, moved
            assert_close(session.run(demo_x[:3])["output"], want_part)  # another batch size
            requests = [session.submit(demo_x) for _ in range(3)]  # several calls at once
            for r in requests:
                assert_close(r.wait(timeout=CREATE_TIMEOUT_S)["output"], demo_expected)
            assert session.check() is None
        finally:
            session.close()
        rc, printed = finish(worker)
        assert rc == 0 and printed == "finished\n", (rc, printed, worker_stderr(tmp_path))


# ---- a worker that dies or goes silent while it holds a call ----------------------------------


def assert_broken(session, x):
    with pytest.raises(libpipe.CommunicationError) as info:
        session.check()
    assert info.value.status is Status.COMMUNICATION
    assert str(info.value).endswith("[PIPE_ERR_COMMUNICATION]")
    # Every later call fails at once with the same status.
    with pytest.raises(libpipe.CommunicationError):
        session.run(x, n=0)
    with pytest.raises(libpipe.CommunicationError):
        session.submit(x, n=0).wait(timeout=MARGIN_S)
    return info.value


def test_killed_worker_fails_the_calls_and_breaks_the_session(gated_plan, gated_inputs, gated_expected, gate, tmp_path):
    # A killed worker is noticed at once, so comm_timeout only has to let it join.
    x = gated_inputs["x"]
    with worker_process(tmp_path, env=gate.child_env()) as worker:
        session, _ = gated_gloo_session(gated_plan, worker, CREATE_TIMEOUT_S)
        try:
            assert_close(session.run(x, n=0)["output"], gated_expected)
            key, request = hold_in_worker(session, gate, x)
            killed_at = time.monotonic()
            worker.kill()
            gate.open(key)  # stage 0 here may finish what it holds; the worker cannot
            with pytest.raises(libpipe.CommunicationError) as info:
                request.wait(timeout=MARGIN_S)
            assert time.monotonic() - killed_at < MARGIN_S
            assert info.value.status is Status.COMMUNICATION
            assert "rank 1" in info.value.message, info.value.message
            assert "rank 1" in assert_broken(session, x).message
        finally:
            closing = time.monotonic()
            session.close()
            assert time.monotonic() - closing < MARGIN_S
        assert worker.wait(timeout=60) == -signal.SIGKILL


def test_silent_worker_fails_the_calls_after_comm_timeout(gated_plan, gated_inputs, gate, tmp_path):
    # A stopped worker keeps its connections open: only its heartbeat, which stops for comm_timeout
    # (here far below libpipe's one-minute default), tells it from a slow one. Once the broken
    # session is closed, the worker, continued, finds its driver gone, and run_worker raises
    # CommunicationError there.
    comm_timeout = 5.0
    x = gated_inputs["x"]
    with worker_process(tmp_path, env=gate.child_env()) as worker:
        session, _ = gated_gloo_session(gated_plan, worker, comm_timeout)
        try:
            key, request = hold_in_worker(session, gate, x)
            stopped_at = time.monotonic()
            worker.send_signal(signal.SIGSTOP)
            wait_stopped(worker)
            gate.open(key)  # what it holds may go on once it is continued
            with pytest.raises(libpipe.CommunicationError) as info:
                request.wait(timeout=comm_timeout + MARGIN_S)
            assert time.monotonic() - stopped_at < comm_timeout + MARGIN_S
            assert "worker rank 1 sent no heartbeat for 5000 ms" in info.value.message, info.value.message
            assert "worker rank 1 sent no heartbeat" in assert_broken(session, x).message
        finally:
            closing = time.monotonic()
            session.close()
            assert time.monotonic() - closing < comm_timeout + MARGIN_S
            worker.send_signal(signal.SIGCONT)
        rc, printed = finish(worker)
        assert rc == 3 and printed.startswith("CommunicationError "), (rc, printed, worker_stderr(tmp_path))


def test_idle_session_whose_worker_stops_reports_itself_broken(
    gated_plan, gated_inputs, gated_expected, gate, tmp_path
):
    # No call is in flight: the heartbeat alone tells that the worker is gone.
    comm_timeout = 3.0
    x = gated_inputs["x"]
    with worker_process(tmp_path, env=gate.child_env()) as worker:
        session, _ = gated_gloo_session(gated_plan, worker, comm_timeout)
        try:
            assert_close(session.run(x, n=0)["output"], gated_expected)
            assert session.check() is None
            worker.send_signal(signal.SIGSTOP)
            wait_stopped(worker)

            def broken():
                try:
                    session.check()
                    return False
                except libpipe.CommunicationError:
                    return True

            wait_until(broken, "the session broken by its stopped worker")
            error = assert_broken(session, x)
            assert "worker rank 1 sent no heartbeat for 3000 ms" in error.message, error.message
        finally:
            session.close()
            worker.send_signal(signal.SIGCONT)
        rc, printed = finish(worker)
        assert rc == 3 and printed.startswith("CommunicationError "), (rc, printed, worker_stderr(tmp_path))


# ---- a worker that computes for longer than comm_timeout is slow, not dead -------------------------


def test_worker_holding_a_call_for_several_comm_timeouts_finishes_it(
    gated_plan, gated_inputs, gated_expected, gate, tmp_path
):
    # The worker's own comm_timeout is the one-minute default given by worker_process: it beats at
    # the pace that the driver's short comm_timeout asks for.
    comm_timeout = 3.0
    x = gated_inputs["x"]
    with worker_process(tmp_path, env=gate.child_env()) as worker:
        session, _ = gated_gloo_session(gated_plan, worker, comm_timeout)
        try:
            key, request = hold_in_worker(session, gate, x)
            held_since = time.monotonic()
            # The worker's stage sends nothing back for several comm timeouts; its heartbeat goes on.
            wait_until(lambda: time.monotonic() > held_since + 3 * comm_timeout, "3 comm timeouts later")
            assert session.check() is None
            assert not request.done()
            gate.open(key)
            assert_close(request.wait(timeout=MARGIN_S)["output"], gated_expected)
            assert session.check() is None
            assert_close(session.run(x, n=0)["output"], gated_expected)
        finally:
            session.close()
        rc, printed = finish(worker)
        assert rc == 0 and printed == "finished\n", (rc, printed, worker_stderr(tmp_path))


# ---- bad stores and arguments ----------------------------------------------------------------------


def test_worker_without_a_store_names_the_address():
    handler = signal.getsignal(signal.SIGINT)
    with refused_port() as port:  # nothing listens there while the worker tries
        store = f"127.0.0.1:{port}"
        started = time.monotonic()
        with pytest.raises(libpipe.CommunicationError) as info:
            libpipe.run_worker(1, 2, store, comm_timeout=0.5)
        assert time.monotonic() - started < 0.5 + MARGIN_S
    assert signal.getsignal(signal.SIGINT) is handler  # put back as it was
    e = info.value
    assert e.status is Status.COMMUNICATION
    assert isinstance(e, libpipe.Error)
    assert store in e.message, e.message


def sigint_caught(proc):
    """Whether proc has a handler for SIGINT (Python's), or SIGINT has its default action."""
    with open(f"/proc/{proc.pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_ends_a_waiting_worker(tmp_path):
    # run_worker blocks in C with the GIL released, where Python's SIGINT handler would only set a
    # flag; with Python's default handler in place it gives SIGINT its default action instead.
    with refused_port() as port, worker_process(tmp_path, comm_timeout=300.0) as worker:  # no driver comes
        assert sigint_caught(worker)  # Python's handler, while it waits for the address
        tell(worker, f"127.0.0.1:{port}")
        wait_until(lambda: not sigint_caught(worker), "run_worker giving SIGINT its default action")
        worker.send_signal(signal.SIGINT)
        assert worker.wait(timeout=MARGIN_S) == -signal.SIGINT  # not 300 s later


def test_driver_without_workers_names_the_missing_rank_and_the_port_its_store_got(demo_plan):
    started = time.monotonic()
    with StoreLog() as log, pytest.raises(libpipe.CommunicationError) as info:
        demo_plan.session(transport="gloo", world_size=2, store=ANY_PORT, comm_timeout=1.0)  # tcp's former name
    assert time.monotonic() - started < 1.0 + MARGIN_S
    store = wait_for_store(log.text)
    assert store != ANY_PORT
    assert "rank 1" in info.value.message, info.value.message
    assert f"--store {store}`" in info.value.message, info.value.message  # how to start it


def test_bad_transport_arguments(demo_plan):
    store = ANY_PORT
    with pytest.raises(libpipe.InvalidArgumentError, match="local transport"):
        demo_plan.session(world_size=2)  # libpipe's check: "local" is one process
    for bad in ("udp", "Gloo", "TCP", None, 1):
        with pytest.raises(libpipe.InvalidArgumentError) as info:
            demo_plan.session(transport=bad, world_size=2, store=store)
        assert info.value.status is Status.INVALID_ARGUMENT
        assert f"transport must be one of ('local', 'tcp', 'nccl'), not {bad!r}" in info.value.message
    with pytest.raises(libpipe.InvalidArgumentError, match="store"):
        demo_plan.session(transport="tcp", world_size=2)  # no store
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        demo_plan.session(transport="tcp", world_size=2, store="no-port")
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        demo_plan.session(transport="tcp", world_size=2, store=("127.0.0.1", 29500))
    with pytest.raises(libpipe.InvalidArgumentError, match="world_size >= 2"):
        demo_plan.session(transport="tcp", world_size=1, store=store)
    with pytest.raises(libpipe.InvalidArgumentError, match="3 processes"):
        demo_plan.session(transport="tcp", world_size=3, store=store, comm_timeout=1.0)  # 2 stages
    for bad in (0, -1.0):
        with pytest.raises(libpipe.InvalidArgumentError, match="comm_timeout"):
            demo_plan.session(transport="tcp", world_size=2, store=store, comm_timeout=bad)


def test_bad_worker_arguments():
    store = "127.0.0.1:1"  # refused before any store is looked for
    for rank in (0, 2, -1):
        with pytest.raises(libpipe.InvalidArgumentError, match="rank") as info:
            libpipe.run_worker(rank, 2, store, comm_timeout=0.5)
        assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(libpipe.InvalidArgumentError, match="world size"):
        libpipe.run_worker(1, 1, store, comm_timeout=0.5)
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        libpipe.run_worker(1, 2, "no-port", comm_timeout=0.5)
    with pytest.raises(libpipe.InvalidArgumentError, match="store"):
        libpipe.run_worker(1, 2, None)  # and no LIBPIPE_STORE
    # Port 0 lets a driver's store pick one; a worker needs the port the store got.
    with pytest.raises(libpipe.InvalidArgumentError, match="port 0, which only the driver may give"):
        libpipe.run_worker(1, 2, ANY_PORT, comm_timeout=0.5)
    with pytest.raises(libpipe.InvalidArgumentError, match="threads_per_stage"):
        libpipe.run_worker(1, 2, store, comm_timeout=0.5, threads_per_stage=-1)
    with pytest.raises(libpipe.InvalidArgumentError, match="comm_timeout"):
        libpipe.run_worker(1, 2, store, comm_timeout=0)


def test_nccl_is_refused_or_waits_for_its_workers(demo_plan):
    # Without NCCL or a usable GPU: UnsupportedError at once. With them, no worker comes.
    with pytest.raises((libpipe.UnsupportedError, libpipe.CommunicationError)):
        demo_plan.session(transport="nccl", world_size=2, store=ANY_PORT, comm_timeout=1.0)


def test_native_options_reach_libpipe(demo_plan):
    # Below the Python checks: the dict keys fill pipe_session_options / pipe_worker_options.
    with demo_plan._handle.use() as plan:
        with pytest.raises(libpipe.InvalidArgumentError, match="transport is 7"):
            _native.pipe_session_create(plan, {"transport": 7})
        with pytest.raises(TypeError, match="store must be a str"):
            _native.pipe_session_create(plan, {"transport": _native.PIPE_TRANSPORT_GLOO, "world_size": 2, "store": 5})
        with pytest.raises(ValueError, match="NUL"):
            _native.pipe_session_create(
                plan, {"transport": _native.PIPE_TRANSPORT_GLOO, "world_size": 2, "store": "127.0.0.1:1\0"}
            )
    with pytest.raises(libpipe.InvalidArgumentError, match="store is NULL"):
        _native.pipe_worker_run({"rank": 1, "world_size": 2})
    with pytest.raises(TypeError, match="unknown worker option 'bogus'"):
        _native.pipe_worker_run({"rank": 1, "bogus": 2})
    assert (_native.PIPE_TRANSPORT_LOCAL, _native.PIPE_TRANSPORT_TCP, _native.PIPE_TRANSPORT_NCCL) == (0, 1, 2)
    assert libpipe.TRANSPORTS == ("local", "tcp", "nccl")


def test_communication_error_maps_from_status_14():
    assert _native.PIPE_ERR_COMMUNICATION == Status.COMMUNICATION == 14
    assert Status.COMMUNICATION.c_name == "PIPE_ERR_COMMUNICATION" == _native.pipe_status_string(14)
    e = libpipe.errors.from_status(14, "rank 1 is gone")
    assert type(e) is libpipe.CommunicationError and e.status is Status.COMMUNICATION
    assert str(e) == "rank 1 is gone [PIPE_ERR_COMMUNICATION]"
    assert "CommunicationError" in libpipe.__all__
