"""Where a libpipe driver's rendezvous store listens, learnt from the driver itself: the one way
the Python tests get a store port (shared by tests/distributed and the Python binding's tests,
which find this file in their fixtures folder).

No test guesses a free port (binding port 0, closing, and reusing the number races every other
process on the machine). A driver is given the store address HOST:0 instead; its store binds a
free port itself, and libpipe reports the address it got as soon as the store listens, before it
waits for workers, in the INFO log message (pipe.h, the store option)

    store listening on HOST:PORT

which `pipe run` / `pipe bench --world-size N` print on stderr as

    pipe: store listening on HOST:PORT (start workers with --store HOST:PORT)

Usage: `wait_for_store(read)` polls a text source (a child's stderr, or `StoreLog.text` for a
driver in this process) until the address appears; `refused_port()` holds a port where nothing
listens, for tests that need one.
"""

import contextlib
import ctypes
import re
import socket
import sys
import threading
import time

ANY_PORT = "127.0.0.1:0"  # a driver's store address: a free port on the loopback interface
WAIT_LIMIT_S = 300  # ends a broken test; a driver reports its store long before

# HOST is a name, an IPv4 address or a bracketed IPv6 address; the port the store got is never 0.
_LISTENING = re.compile(r"store listening on (\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):([1-9][0-9]*)(?=\s|$)")
CLI_LINE = re.compile(r"^pipe: store listening on (\S+) \(start workers with --store \1\)$")


def reported_store(text):
    """The "HOST:PORT" of the first store-listening report in `text`, or None."""
    found = _LISTENING.search(text)
    return f"{found.group(1)}:{found.group(2)}" if found else None


def wait_for_store(read, alive=None, what="the driver"):
    """Waits until read() (the text a driver has written so far) reports its store; returns
    "HOST:PORT". Fails at once when alive() turns false first (the driver ended without a store),
    quoting what it wrote."""
    give_up = time.monotonic() + WAIT_LIMIT_S
    while True:
        text = read()
        store = reported_store(text)
        if store:
            return store
        if alive is not None and not alive():
            text = read()  # what it wrote before it ended
            store = reported_store(text)
            if store:
                return store
            raise AssertionError(f"{what} ended without reporting a store address:\n{text}")
        if time.monotonic() > give_up:
            raise AssertionError(f"{what} reported no store address within {WAIT_LIMIT_S} s:\n{text}")
        time.sleep(0.01)


@contextlib.contextmanager
def refused_port(host="127.0.0.1"):
    """A port on `host` where nothing listens, for the `with` block: the socket is bound but never
    listens, so connections are refused and no other process can take the port meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p)
_LEVELS = ("debug", "info", "warning", "error")


def _loaded_libpipe():
    """The path of the libpipe this process has loaded (the binding's native module links it)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith("libpipe.so"):
                return path
    raise RuntimeError("libpipe is not loaded in this process yet (load a model first)")


class StoreLog:
    """libpipe's log messages in this process, for a driver running here (the Python binding has
    no log callback of its own): pipe_set_log_callback is pointed at this object for the `with`
    block, at INFO level; warnings and errors still go to stderr as the default logger writes
    them, and the default logger is put back on the way out."""

    def __init__(self):
        self._lib = ctypes.CDLL(_loaded_libpipe())  # the same library: dlopen hands back the loaded one
        self._lib.pipe_set_log_callback.argtypes = [_LOG_FN, ctypes.c_void_p, ctypes.c_int32]
        self._lock = threading.Lock()
        self._messages = []
        self._fn = _LOG_FN(self._receive)  # kept alive while libpipe may call it

    def _receive(self, _user_data, level, message):
        text = message.decode(errors="replace")
        with self._lock:
            self._messages.append(text)
        if level >= 2:
            name = _LEVELS[level] if level < len(_LEVELS) else "log"
            print(f"libpipe {name}: {text}", file=sys.stderr, flush=True)

    def text(self):
        with self._lock:
            return "\n".join(self._messages)

    def __enter__(self):
        if self._lib.pipe_set_log_callback(self._fn, None, 1) != 0:
            raise RuntimeError("pipe_set_log_callback refused the callback")
        return self

    def __exit__(self, *exc):
        self._lib.pipe_set_log_callback(_LOG_FN(), None, 2)  # NULL: the default logger again
