"""A program run on a pseudo-terminal, as a user at a terminal runs it (`pipe chat`'s tests): its stdin,
stdout and stderr are the terminal, which is also its controlling terminal, so Ctrl-C (typed as \\x03)
reaches it as SIGINT and Ctrl-D (\\x04 at the start of a line) is the end of input.

    term = Terminal([PIPE, "chat", ...])
    term.expect("> ")              # waits (bounded) until the output, from where the last expect ended, holds it
    term.type("Hello\\n")
    term.exit_status()             # waits for the program to exit

Every wait is for a state the program's output or exit shows; the bound only ends a broken test.
"""

import os
import pty
import select
import signal
import time

WAIT_LIMIT_S = 300


class Terminal:
    def __init__(self, argv, env=None):
        argv = [str(a) for a in argv]
        pid, fd = pty.fork()
        if pid == 0:  # the child: a new session whose controlling terminal is the pty
            try:
                os.execve(argv[0], argv, env if env is not None else os.environ)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.raw = b""
        self.seen = 0  # where the last expect's match ended, in text()
        self.status = None

    def text(self):
        """Everything written so far, with the terminal's line endings (\\r\\n) as \\n."""
        return self.raw.decode("utf-8", errors="replace").replace("\r\n", "\n")

    def _read(self, timeout):
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            return False
        self.raw += chunk
        return bool(chunk)

    def expect(self, needle):
        """Waits until `needle` appears after the last match; returns the text between them."""
        give_up = time.monotonic() + WAIT_LIMIT_S
        open_ = True
        while True:
            text = self.text()
            at = text.find(needle, self.seen)
            if at >= 0:
                before = text[self.seen : at]
                self.seen = at + len(needle)
                return before
            if not open_ or time.monotonic() > give_up:
                raise AssertionError(f"never saw {needle!r}; the terminal shows:\n{text}")
            open_ = self._read(1.0)

    def type(self, text):
        os.write(self.fd, text.encode())

    def exit_status(self):
        """The program's exit status (128 + N for a signal N), once it exited; reads its last output."""
        give_up = time.monotonic() + WAIT_LIMIT_S
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                self.status = 128 - self.status if self.status < 0 else self.status
                break
            if time.monotonic() > give_up:
                raise AssertionError(f"the program did not exit; the terminal shows:\n{self.text()}")
            self._read(0.2)
        while self._read(0):
            pass
        return self.status

    def close(self):
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except ProcessLookupError:
                pass
            self.status = -1
        os.close(self.fd)
