"""Helpers for the distributed tests: where the tools and fixtures are, free loopback ports, and
process trees that are watched while they run and never outlive a test.

Every process a test starts goes through `Tree` (a new session, stdout/stderr to files so that a
worker which inherits them cannot keep a pipe open): the tree remembers every descendant it has
seen, and `kill_all_trees()` (run by conftest.py after each test) kills whatever is left."""
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

PIPE = os.environ["PIPE_CLI"]
MODELS = os.environ["PIPE_TEST_MODELS"]
DRIVER = os.environ.get("PIPE_DIST_DRIVER", "")

# Short communication timeouts keep the failure tests quick; the margins are generous because
# the test machines have two slow cores (tests never assert tight wall-clock bounds).
COMM_MS = int(os.environ.get("PIPE_DIST_COMM_TIMEOUT_MS", "4000"))
MARGIN_S = float(os.environ.get("PIPE_DIST_MARGIN_S", "10"))
FAIL_WITHIN_S = COMM_MS / 1000 + MARGIN_S  # a failure must be reported within this
RUN_TIMEOUT_S = 300  # a normal command must finish within this (else it hung)


def seed(name):
    return os.path.join(MODELS, name)


def split_fixture(name):
    return os.path.join(MODELS, "split", name)


def weights_fixture(name):
    return os.path.join(MODELS, "weights", name)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_store():
    return f"127.0.0.1:{free_port()}"


# ---- /proc ----

def _stat(pid):
    """(state, ppid, session, starttime, utime+stime ticks) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return rest[0], int(rest[1]), int(rest[3]), int(rest[19]), int(rest[11]) + int(rest[12])


def children(pid):
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids += [int(p) for p in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return kids


def descendants(pid):
    out, unvisited = [], [pid]
    while unvisited:
        for kid in children(unvisited.pop()):
            out.append(kid)
            unvisited.append(kid)
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def cpu_ticks(pid):
    st = _stat(pid)
    return st[4] if st else None


def session_members(sid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and st[2] == sid and st[0] != "Z":
                found.append((int(entry), st[3]))
    return found


# ---- process trees ----

_TREES = []


class Tree:
    """A command started in its own session, output to files; its descendants are recorded."""

    def __init__(self, args, name="cmd"):
        self.args = [str(a) for a in args]
        self.name = name
        self._out = tempfile.TemporaryFile(mode="w+")
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.seen = {}  # pid -> starttime
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        _TREES.append(self)

    def _sample(self):
        while not self._stop.is_set():
            self.record()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)

    def record(self):
        for pid in descendants(self.proc.pid):
            st = _stat(pid)
            if st and pid not in self.seen:
                self.seen[pid] = st[3]
        return self.seen

    def wait(self, timeout):
        """Wait for the command; on timeout kill the whole tree and fail the test."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} hung: still running after {timeout:.0f} s: {' '.join(self.args)}\n"
                                 f"stderr:\n{self.stderr}")
        self._stop.set()
        return self

    @property
    def returncode(self):
        return self.proc.returncode

    def _read(self, f):
        f.flush()
        f.seek(0)
        return f.read()

    @property
    def stdout(self):
        return self._read(self._out)

    @property
    def stderr(self):
        return self._read(self._err)

    def leftovers(self):
        """Processes of this tree still alive (zombies do not count)."""
        alive = {}
        for pid, start in self.seen.items():
            st = _stat(pid)
            if st and st[3] == start and st[0] != "Z":
                alive[pid] = start
        for pid, start in session_members(self.proc.pid):
            if pid != self.proc.pid:
                alive[pid] = start
        return alive

    def assert_no_leftovers(self, within=FAIL_WITHIN_S):
        """After the command ended: every process it started ends too (within `within` s)."""
        deadline = time.monotonic() + within
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.leftovers()
        if left:
            described = {pid: " ".join(cmdline(pid)) for pid in left}
            self.kill()
            raise AssertionError(f"{self.name} left processes running {within:.0f} s after it ended: {described}")

    def kill(self):
        self._stop.set()
        for pid in list(self.record()) + [pid for pid, _ in session_members(self.proc.pid)]:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def kill_all_trees():
    while _TREES:
        tree = _TREES.pop()
        if tree.proc.poll() is None or tree.leftovers():
            tree.kill()
        tree._out.close()
        tree._err.close()


def pipe_tree(*args, name="pipe"):
    return Tree([PIPE, *args], name=name)


def run_pipe(*args, timeout=RUN_TIMEOUT_S, leftovers=True):
    """Run `pipe` to the end (killing the tree if it hangs); check it leaves no process behind."""
    tree = pipe_tree(*args).wait(timeout)
    if leftovers:
        tree.assert_no_leftovers()
    return tree


def start_worker(rank, world, store, comm_ms=None, extra=()):
    args = ["worker", "--rank", rank, "--world-size", world, "--store", store]
    if comm_ms is not None:
        args += ["--comm-timeout-ms", comm_ms]
    return pipe_tree(*args, *extra, name=f"pipe worker rank {rank}")


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("pipe: error: ")]


def assert_one_line_error(result, *needles):
    """Non-zero exit, exactly one line on stderr starting 'pipe: error: ', naming each needle."""
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipe: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_error_line(result, *needles, lower=False):
    """Non-zero exit and a 'pipe: error: ' line naming each needle (other processes of the tree
    may write to the same stderr, so other lines are allowed), and no sign of a crash."""
    assert result.returncode != 0, result.stderr
    assert result.returncode > 0, f"killed by signal {-result.returncode}: {result.stderr}"
    for marker in ("terminate called", "Segmentation fault", "core dumped", "Aborted"):
        assert marker not in result.stderr, result.stderr
    for line in error_lines(result.stderr):
        text = line.lower() if lower else line
        if all((n.lower() if lower else n) in text for n in needles):
            return line
    raise AssertionError(f"no 'pipe: error:' line naming {needles}:\n{result.stderr}")


def wait_until(predicate, timeout, what, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_busy(pid, timeout=30, window=1.0):
    """Wait until pid keeps using CPU over a `window` (work is streaming through it). After
    `timeout` s go on anyway: the caller's own checks still hold, the fault only lands later."""
    tick = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_ticks(pid)
        time.sleep(window)
        after = cpu_ticks(pid)
        if before is None or after is None:
            raise AssertionError(f"process {pid} ended while waiting for it to work")
        if (after - before) / tick >= 0.05 * window:
            return True
    return False
