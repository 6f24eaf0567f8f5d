"""Helpers for the distributed tests: where the tools and fixtures are, drivers whose store
reports the port it picked (storeport.py), the gated models that let a test know a worker holds
work (tests/gate), and process trees that are watched while they run and never outlive a test.

Every process a test starts goes through `Tree` (a new session, stdout/stderr to files so that a
worker which inherits them cannot keep a pipe open): the tree remembers every descendant it has
seen, and `kill_all_trees()` (run by conftest.py after each test) kills whatever is left."""

import os
import signal
import subprocess
import tempfile
import threading
import time
import warnings

from gate import Gate
from storeport import ANY_PORT, CLI_LINE, wait_for_store

PIPE = os.environ["PIPE_CLI"]
MODELS = os.environ["PIPE_TEST_MODELS"]
DRIVER = os.environ.get("PIPE_DIST_DRIVER", "")

# Short communication timeouts keep the tests of a stopped worker quick (only the comm timeout
# tells it from a slow one). Sessions whose faults are noticed at once, or whose workers the test
# starts after the driver reported its store, get JOIN_MS, which a loaded machine never runs out
# of. The margins are generous because the test machines have two slow cores: a time bound only
# tells a hang from a slow run and never decides a verdict otherwise.
COMM_MS = int(os.environ.get("PIPE_DIST_COMM_TIMEOUT_MS", "4000"))
JOIN_MS = int(os.environ.get("PIPE_DIST_JOIN_TIMEOUT_MS", "60000"))
MARGIN_S = float(os.environ.get("PIPE_DIST_MARGIN_S", "30"))
FAIL_WITHIN_S = COMM_MS / 1000 + MARGIN_S  # a failure must be reported within this
RUN_TIMEOUT_S = 300  # a normal command must finish within this (else it hung)
# Under the sanitizers (tests/distributed/CMakeLists.txt sets LIBPIPE_SANITIZED) every process is several times
# slower: the fault and shape matrices run a representative few there (each suite says which).
SANITIZED = os.environ.get("LIBPIPE_SANITIZED") == "1"


def seed(name):
    return os.path.join(MODELS, name)


def split_fixture(name):
    return os.path.join(MODELS, "split", name)


def weights_fixture(name):
    return os.path.join(MODELS, "weights", name)


# ---- the gate: calls held in a stage until the test lets them go ----

_GATE = []


def gate():
    """This test process's gate (tests/gate), created on first use; child processes get it
    through `gate().child_env()`. The operator library is loaded here too, so that the gated
    models load in this process's PyTorch (for the reference outputs)."""
    if not _GATE:
        _GATE.append(Gate())
    return _GATE[0]


def gated_model(stages):
    """A gated TorchScript model of `stages` stages (2 or 3): forward(x [B, 64], n) where stage k
    waits at gate "stage<k>" for key n (n = 0 passes). 2 is the fixture gated.scripted.pt; the
    3-stage one is made here once, as seed_models.py makes that fixture."""
    if stages == 2:
        return seed("gated.scripted.pt")
    assert stages == 3, stages
    path = os.path.join(_gated_dir(), "gated3.scripted.pt")
    if not os.path.exists(path):
        import torch
        from libpipe import pipe_split

        gate()  # the operator, for scripting

        class Gated3(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w0 = torch.nn.Parameter(torch.randn(64, 64) / 8)
                self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)
                self.w2 = torch.nn.Parameter(torch.randn(64, 64) / 8)

            def forward(self, x, n):
                x = torch.ops.libpipe_test.gate(torch.tanh(x @ self.w0), n, "stage0")
                pipe_split()
                x = torch.ops.libpipe_test.gate(torch.tanh(x @ self.w1), n, "stage1")
                pipe_split()
                return torch.ops.libpipe_test.gate(torch.tanh(x @ self.w2), n, "stage2")

        torch.manual_seed(0)
        with warnings.catch_warnings():  # PyTorch deprecates scripting; libpipe reads TorchScript
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.script(Gated3().eval()).save(path + ".part")
        os.replace(path + ".part", path)
    return path


_GATED_DIR = []


def _gated_dir():
    if not _GATED_DIR:
        _GATED_DIR.append(tempfile.mkdtemp(prefix="libpipe-dist-models-"))
    return _GATED_DIR[0]


def gated_inputs(path, key):
    """The gated model's inputs (gated.inputs.safetensors) with n = `key`, written to `path`."""
    import torch
    from safetensors.torch import load_file, save_file

    inputs = load_file(seed("gated.inputs.safetensors"))
    inputs["n"] = torch.tensor(key, dtype=torch.int64)
    save_file(inputs, str(path))
    return path


def wait_held(key, stage, *trees):
    """Waits until a micro-batch of call `key` is held at the gate of `stage` (a worker has work
    in hand); fails at once if one of `trees` ended first."""
    g = gate()
    give_up = time.monotonic() + RUN_TIMEOUT_S
    while g.count(key, stage) < 1:
        for tree in trees:
            if tree.proc.poll() is not None:
                raise AssertionError(
                    f"{tree.name} ended ({tree.returncode}) before a call reached {stage}:\n" f"{tree.stderr}"
                )
        if time.monotonic() > give_up:
            raise AssertionError(f"no call reached {stage} within {RUN_TIMEOUT_S} s")
        time.sleep(0.005)


def wait_stopped(pid):
    """Waits until a SIGSTOP sent to pid has taken effect."""

    def stopped():
        st = _stat(pid)
        if st is None:
            raise AssertionError(f"process {pid} ended instead of stopping")
        return st[0] in "Tt"

    wait_until(stopped, RUN_TIMEOUT_S, f"process {pid} to stop", interval=0.005)


def remove_temporaries():
    """The gate's folder and the models made here (conftest.py, once the tests are done)."""
    import shutil

    for path in _GATED_DIR + [g.dir for g in _GATE]:
        shutil.rmtree(path, ignore_errors=True)


# ---- /proc ----


def _stat(pid):
    """(state, ppid, session, starttime, utime+stime ticks) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2 :].split()
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

    def __init__(self, args, name="cmd", env=None):
        self.args = [str(a) for a in args]
        self.name = name
        self._out = tempfile.TemporaryFile(mode="w+")
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            self.args, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
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
            raise AssertionError(
                f"{self.name} hung: still running after {timeout:.0f} s: {' '.join(self.args)}\n"
                f"stderr:\n{self.stderr}"
            )
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


def pipe_tree(*args, name="pipe", env=None):
    return Tree([PIPE, *args], name=name, env=env)


def start_driver(*args, name="pipe driver", env=None):
    """A `pipe run`/`pipe bench` with --world-size N --store 127.0.0.1:0 (added here), and the
    store address it reported once its store listens: the address to give its workers."""
    tree = pipe_tree(*args, "--store", ANY_PORT, name=name, env=env)
    store = wait_for_store(lambda: tree.stderr, alive=lambda: tree.proc.poll() is None, what=name)
    return tree, store


def run_pipe(*args, timeout=RUN_TIMEOUT_S, leftovers=True, env=None):
    """Run `pipe` to the end (killing the tree if it hangs); check it leaves no process behind."""
    tree = pipe_tree(*args, env=env).wait(timeout)
    if leftovers:
        tree.assert_no_leftovers()
    return tree


def start_worker(rank, world, store, comm_ms=None, extra=(), env=None):
    args = ["worker", "--rank", rank, "--world-size", world, "--store", store]
    if comm_ms is not None:
        args += ["--comm-timeout-ms", comm_ms]
    return pipe_tree(*args, *extra, name=f"pipe worker rank {rank}", env=env)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("pipe: error: ")]


def assert_one_line_error(result, *needles, store_line=False):
    """Non-zero exit, exactly one line on stderr starting 'pipe: error: ', naming each needle;
    with `store_line`, after the driver's one documented store line (storeport.CLI_LINE)."""
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    if store_line:
        assert lines and CLI_LINE.match(lines[0]), result.stderr
        lines = lines[1:]
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
