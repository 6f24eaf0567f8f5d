"""Stages spread over processes (libpipe >= 0.4): a Gloo session in this process (rank 0, the
driver) whose rank-1 worker is `libpipe.run_worker` in a child Python process; a worker that is
killed or stops answering breaks the session with CommunicationError; bad stores and arguments.

Timing bounds are loose on purpose (slow, shared machines): only "within comm_timeout plus a
generous margin", which tells a comm_timeout that reached libpipe from its one-minute default."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import QUICK_N, SLOW_N, assert_close

import libpipe
from libpipe import Status, _native

MARGIN_S = 15.0  # what a slow machine may add to a comm_timeout
CREATE_TIMEOUT_S = 60.0  # joining and loading, for the sessions that are not about timeouts


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_store():
    return f"127.0.0.1:{free_port()}"


@contextlib.contextmanager
def worker_process(store, tmp_path, rank=1, world_size=2, comm_timeout=CREATE_TIMEOUT_S):
    """A child Python (the installed package, as the tests use it) serving `rank` with
    libpipe.run_worker. It prints "ready" once libpipe (and torch) are imported, then
    "finished" when run_worker returned, or the error's class and message when it raised (exit
    code 3). Yields the Popen once "ready" was read; killed (if still running) on the way out."""
    code = (
        "import sys, libpipe\n"
        "print('ready', flush=True)\n"
        "try:\n"
        f"    libpipe.run_worker({rank}, {world_size}, {store!r}, comm_timeout={comm_timeout!r})\n"
        "except libpipe.Error as e:\n"
        "    print(type(e).__name__, e.message, flush=True)\n"
        "    sys.exit(3)\n"
        "print('finished', flush=True)\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    stderr = open(tmp_path / f"worker-{rank}.stderr", "wb")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=env, cwd="/")
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
        stderr.close()


def worker_stderr(tmp_path, rank=1):
    path = tmp_path / f"worker-{rank}.stderr"
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def finish(proc, timeout=60):
    """The worker's exit code and what it printed after "ready"."""
    rc = proc.wait(timeout=timeout)
    return rc, proc.stdout.read()


class Stream:
    """Runs slow calls one after another in a thread until one fails; records when it failed."""

    def __init__(self, session, x, n):
        self.session, self.x, self.n = session, x, n
        self.done = 0
        self.first_done = threading.Event()
        self.error = None
        self.failed_at = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            try:
                self.session.run(self.x, n=self.n)
            except Exception as e:  # the test checks which
                self.error, self.failed_at = e, time.monotonic()
                self.first_done.set()
                return
            self.done += 1
            self.first_done.set()

    def join(self, timeout):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the calls still ran {timeout:g} s later"


# ---- a Gloo session with a worker process ---------------------------------------------------


def test_gloo_session_with_a_worker_process_equals_local(demo_plan, demo_x, demo_expected, tmp_path):
    assert demo_plan.num_stages == 2
    with demo_plan.session(microbatches=4) as local:
        local.check()  # a local session is never broken
        want = local.run(demo_x)["output"]
        want_part = local.run(demo_x[:3])["output"]
    assert_close(want, demo_expected)

    store = local_store()
    with worker_process(store, tmp_path) as worker:
        session = demo_plan.session(microbatches=4, transport="gloo", world_size=2, store=store,
                                    comm_timeout=CREATE_TIMEOUT_S)
        try:
            assert session.num_stages == 2
            assert (session.transport, session.world_size, session.store) == ("gloo", 2, store)
            assert "gloo" in repr(session)
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


# ---- a worker that dies or goes silent ----------------------------------------------------------


def gloo_slow_session(slow_plan, store, comm_timeout):
    return slow_plan.session(microbatches=2, input_specs={"n": "replicate"}, transport="gloo", world_size=2,
                             store=store, comm_timeout=comm_timeout)


def assert_broken(session, x):
    with pytest.raises(libpipe.CommunicationError) as info:
        session.check()
    assert info.value.status is Status.COMMUNICATION
    assert str(info.value).endswith("[PIPE_ERR_COMMUNICATION]")
    # Every later call fails at once with the same status.
    with pytest.raises(libpipe.CommunicationError):
        session.run(x, n=QUICK_N)
    with pytest.raises(libpipe.CommunicationError):
        session.submit(x, n=QUICK_N).wait(timeout=MARGIN_S)
    return info.value


def test_killed_worker_fails_the_calls_and_breaks_the_session(slow_plan, slow_inputs, slow_expected, tmp_path):
    comm_timeout = 10.0
    x = slow_inputs["x"]
    store = local_store()
    with worker_process(store, tmp_path) as worker:
        # comm_timeout also bounds joining; the worker has imported libpipe already ("ready").
        session = gloo_slow_session(slow_plan, store, comm_timeout)
        try:
            assert_close(session.run(x, n=QUICK_N)["output"], slow_expected)
            stream = Stream(session, x, 4 * SLOW_N)  # calls of a few seconds, back to back
            try:
                assert stream.first_done.wait(CREATE_TIMEOUT_S) and stream.error is None, stream.error
                time.sleep(0.5)  # well inside the next call
                killed_at = time.monotonic()
                worker.kill()
                stream.join(comm_timeout + MARGIN_S)
            finally:
                if stream.thread.is_alive():
                    session.close()  # fails the running call, so the thread ends
            assert isinstance(stream.error, libpipe.CommunicationError), repr(stream.error)
            assert stream.error.status is Status.COMMUNICATION
            assert stream.failed_at - killed_at < comm_timeout + MARGIN_S
            assert "rank 1" in stream.error.message, stream.error.message
            assert "rank 1" in assert_broken(session, x).message
        finally:
            closing = time.monotonic()
            session.close()
            assert time.monotonic() - closing < comm_timeout + MARGIN_S
        assert worker.wait(timeout=60) == -signal.SIGKILL


def test_silent_worker_fails_the_calls_after_comm_timeout(slow_plan, slow_inputs, tmp_path):
    # A stopped worker keeps its connections open: only comm_timeout (here far below libpipe's
    # one-minute default) tells it from a slow one. Once the broken session is closed, the worker,
    # continued, finds its driver gone and run_worker raises CommunicationError there.
    comm_timeout = 5.0
    x = slow_inputs["x"]
    store = local_store()
    with worker_process(store, tmp_path) as worker:
        session = gloo_slow_session(slow_plan, store, comm_timeout)
        try:
            stream = Stream(session, x, 4 * SLOW_N)
            try:
                assert stream.first_done.wait(CREATE_TIMEOUT_S) and stream.error is None, stream.error
                time.sleep(0.5)
                stopped_at = time.monotonic()
                worker.send_signal(signal.SIGSTOP)
                stream.join(comm_timeout + MARGIN_S)
            finally:
                if stream.thread.is_alive():
                    session.close()
            assert isinstance(stream.error, libpipe.CommunicationError), repr(stream.error)
            assert stream.failed_at - stopped_at < comm_timeout + MARGIN_S
            assert_broken(session, x)
        finally:
            closing = time.monotonic()
            session.close()
            assert time.monotonic() - closing < comm_timeout + MARGIN_S
            worker.send_signal(signal.SIGCONT)
        rc, printed = finish(worker)
        assert rc == 3 and printed.startswith("CommunicationError "), (rc, printed, worker_stderr(tmp_path))


# ---- bad stores and arguments ----------------------------------------------------------------------


def test_worker_without_a_store_names_the_address():
    store = local_store()  # nothing listens there
    handler = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    with pytest.raises(libpipe.CommunicationError) as info:
        libpipe.run_worker(1, 2, store, comm_timeout=0.5)
    assert time.monotonic() - started < 0.5 + MARGIN_S
    assert signal.getsignal(signal.SIGINT) is handler  # put back as it was
    e = info.value
    assert e.status is Status.COMMUNICATION
    assert isinstance(e, libpipe.Error)
    assert store in e.message, e.message


def test_ctrl_c_ends_a_waiting_worker(tmp_path):
    # run_worker blocks in C with the GIL released, where Python's SIGINT handler would only set a
    # flag; with Python's default handler in place it gives SIGINT its default action instead.
    with worker_process(local_store(), tmp_path, comm_timeout=300.0) as worker:  # no driver comes
        time.sleep(1.0)  # inside run_worker by now (if not, KeyboardInterrupt ends it the same way)
        worker.send_signal(signal.SIGINT)
        assert worker.wait(timeout=MARGIN_S) == -signal.SIGINT  # not 300 s later


def test_driver_without_workers_names_the_missing_rank(demo_plan):
    store = local_store()
    started = time.monotonic()
    with pytest.raises(libpipe.CommunicationError) as info:
        demo_plan.session(transport="gloo", world_size=2, store=store, comm_timeout=1.0)
    assert time.monotonic() - started < 1.0 + MARGIN_S
    assert "rank 1" in info.value.message, info.value.message


def test_bad_transport_arguments(demo_plan):
    store = local_store()
    with pytest.raises(libpipe.InvalidArgumentError, match="local transport"):
        demo_plan.session(world_size=2)  # libpipe's check: "local" is one process
    for bad in ("tcp", "Gloo", None, 1):
        with pytest.raises(libpipe.InvalidArgumentError) as info:
            demo_plan.session(transport=bad, world_size=2, store=store)
        assert info.value.status is Status.INVALID_ARGUMENT
        assert f"transport must be one of ('local', 'gloo', 'nccl'), not {bad!r}" in info.value.message
    with pytest.raises(libpipe.InvalidArgumentError, match="store"):
        demo_plan.session(transport="gloo", world_size=2)  # no store
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        demo_plan.session(transport="gloo", world_size=2, store="no-port")
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        demo_plan.session(transport="gloo", world_size=2, store=("127.0.0.1", 29500))
    with pytest.raises(libpipe.InvalidArgumentError, match="world_size >= 2"):
        demo_plan.session(transport="gloo", world_size=1, store=store)
    with pytest.raises(libpipe.InvalidArgumentError, match="3 processes"):
        demo_plan.session(transport="gloo", world_size=3, store=store, comm_timeout=1.0)  # 2 stages
    for bad in (0, -1.0):
        with pytest.raises(libpipe.InvalidArgumentError, match="comm_timeout"):
            demo_plan.session(transport="gloo", world_size=2, store=store, comm_timeout=bad)


def test_bad_worker_arguments():
    store = local_store()
    for rank in (0, 2, -1):
        with pytest.raises(libpipe.InvalidArgumentError, match="rank") as info:
            libpipe.run_worker(rank, 2, store, comm_timeout=0.5)
        assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(libpipe.InvalidArgumentError, match="world size"):
        libpipe.run_worker(1, 1, store, comm_timeout=0.5)
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        libpipe.run_worker(1, 2, "no-port", comm_timeout=0.5)
    with pytest.raises(libpipe.InvalidArgumentError, match="HOST:PORT"):
        libpipe.run_worker(1, 2, None)
    with pytest.raises(libpipe.InvalidArgumentError, match="threads_per_stage"):
        libpipe.run_worker(1, 2, store, comm_timeout=0.5, threads_per_stage=-1)
    with pytest.raises(libpipe.InvalidArgumentError, match="comm_timeout"):
        libpipe.run_worker(1, 2, store, comm_timeout=0)


def test_nccl_is_refused_or_waits_for_its_workers(demo_plan):
    # Without NCCL or a usable GPU: UnsupportedError at once. With them, no worker comes.
    with pytest.raises((libpipe.UnsupportedError, libpipe.CommunicationError)):
        demo_plan.session(transport="nccl", world_size=2, store=local_store(), comm_timeout=1.0)


def test_native_options_reach_libpipe(demo_plan):
    # Below the Python checks: the dict keys fill pipe_session_options / pipe_worker_options.
    with demo_plan._handle.use() as plan:
        with pytest.raises(libpipe.InvalidArgumentError, match="transport is 7"):
            _native.pipe_session_create(plan, {"transport": 7})
        with pytest.raises(TypeError, match="store must be a str"):
            _native.pipe_session_create(plan, {"transport": _native.PIPE_TRANSPORT_GLOO, "world_size": 2, "store": 5})
        with pytest.raises(ValueError, match="NUL"):
            _native.pipe_session_create(plan, {"transport": _native.PIPE_TRANSPORT_GLOO, "world_size": 2,
                                               "store": "127.0.0.1:1\0"})
    with pytest.raises(libpipe.InvalidArgumentError, match="store is NULL"):
        _native.pipe_worker_run({"rank": 1, "world_size": 2})
    with pytest.raises(TypeError, match="unknown worker option 'bogus'"):
        _native.pipe_worker_run({"rank": 1, "bogus": 2})
    assert (_native.PIPE_TRANSPORT_LOCAL, _native.PIPE_TRANSPORT_GLOO, _native.PIPE_TRANSPORT_NCCL) == (0, 1, 2)
    assert libpipe.TRANSPORTS == ("local", "gloo", "nccl")


def test_communication_error_maps_from_status_14():
    assert _native.PIPE_ERR_COMMUNICATION == Status.COMMUNICATION == 14
    assert Status.COMMUNICATION.c_name == "PIPE_ERR_COMMUNICATION" == _native.pipe_status_string(14)
    e = libpipe.errors.from_status(14, "rank 1 is gone")
    assert type(e) is libpipe.CommunicationError and e.status is Status.COMMUNICATION
    assert str(e) == "rank 1 is gone [PIPE_ERR_COMMUNICATION]"
    assert "CommunicationError" in libpipe.__all__
