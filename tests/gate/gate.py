"""The test side of the gate protocol (see gate_op.cpp), for Python tests.

    gate = Gate()                  # once per process, before loading a gated model
    key = gate.new_key()           # one per call the test wants to hold; pass it as input n
    gate.wait(key, "stage0")       # until a micro-batch is held in stage 0
    gate.open(key, "stage0")       # let stage 0 go (no stage: every stage)

`wait` only waits for a state the test itself brings about; its bound exists to end a broken
test, never to decide a verdict. Child processes (CLI workers) inherit the gate folder through
LIBPIPE_TEST_GATE_DIR; they load the operator with LD_PRELOAD=<Gate.library> (see `child_env`).
"""

import atexit
import ctypes
import itertools
import os
import shutil
import tempfile
import time

WAIT_LIMIT_S = 300


def _library():
    """LIBPIPE_TEST_GATE_LIB (ctest sets it), else the copy beside this file (the bindings' fixtures)."""
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libpipe_test_gate.so")
    return os.environ.get("LIBPIPE_TEST_GATE_LIB") or (beside if os.path.exists(beside) else "")


class Gate:
    library = _library()

    def __init__(self, load=True):
        if not self.library:
            raise RuntimeError("no gate library: set LIBPIPE_TEST_GATE_LIB (ctest sets it)")
        if load:
            ctypes.CDLL(self.library, mode=ctypes.RTLD_GLOBAL)
        self.dir = os.environ.get("LIBPIPE_TEST_GATE_DIR")
        if not self.dir:  # this process's own folder, gone when it exits
            self.dir = tempfile.mkdtemp(prefix="libpipe-gate-")
            atexit.register(shutil.rmtree, self.dir, True)
        os.environ["LIBPIPE_TEST_GATE_DIR"] = self.dir
        self._keys = itertools.count(1)

    def new_key(self):
        return next(self._keys)

    def count(self, key, stage, what="arrived"):
        prefix = f"gate-{key}.{stage}.{what}."
        return sum(name.startswith(prefix) for name in os.listdir(self.dir))

    def wait(self, key, stage, what="arrived", count=1):
        give_up = time.monotonic() + WAIT_LIMIT_S
        while self.count(key, stage, what) < count:
            if time.monotonic() > give_up:
                raise AssertionError(
                    f"gate {key} ({stage}): {self.count(key, stage, what)} micro-batches {what}, " f"waited for {count}"
                )
            time.sleep(0.002)

    def open(self, key, stage=None):
        name = f"gate-{key}.open" if stage is None else f"gate-{key}.{stage}.open"
        open(os.path.join(self.dir, name), "w").close()

    def child_env(self, env=None):
        """The environment for a child process (a `pipe` CLI worker) that runs gated stages."""
        env = dict(os.environ if env is None else env)
        env["LIBPIPE_TEST_GATE_DIR"] = self.dir
        env["LD_PRELOAD"] = " ".join(p for p in (env.get("LD_PRELOAD", ""), self.library) if p)
        # Sanitizer builds: the preloaded library comes before the sanitizer's runtime.
        env["ASAN_OPTIONS"] = ":".join(p for p in (env.get("ASAN_OPTIONS", ""), "verify_asan_link_order=0") if p)
        return env
