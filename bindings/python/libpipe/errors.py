"""libpipe's errors: every failed call raises `libpipe.Error` (or a subclass), carrying the C ABI's
status code as `.status` (a `Status`) and its message as `.message`.

    try:
        model.split(split_at=["blok.2:begin"])
    except libpipe.SplitError as e:
        print(e.status.name, e.message)   # SPLIT  cannot split model: ... nearest module paths: blocks.2, ...

Pure Python: the native module raises these through `from_status`.
"""

import enum

from ._header import constants as _constants

_STATUS = {value: (c_name, doc) for value, _, c_name, doc in _constants.STATUS}


class _StatusBase(enum.IntEnum):
    @property
    def c_name(self):
        """The name pipe_status_string() gives ("PIPE_OK", "PIPE_ERR_SPLIT", ...)."""
        return _STATUS[self.value][0]

    @property
    def description(self):
        """What the code means, as pipe.h's comment on it says."""
        return _STATUS[self.value][1]


# The members are generated from pipe.h: PIPE_OK -> Status.OK, PIPE_ERR_SPLIT -> Status.SPLIT, ...
Status = _StatusBase(
    "Status",
    [(name, value) for value, name, _, _ in _constants.STATUS],
    module=__name__,
    qualname="Status",
)
Status.__doc__ = """The status codes of pipe.h (PIPE_OK == 0), with their C names (`c_name`) and what
they mean (`description`)."""


class Error(Exception):
    """A libpipe call failed. `status` says what kind of failure (a `Status`, or the raw int for a
    code this binding does not know), `message` what was wrong and what to do."""

    status = Status.INTERNAL

    def __init__(self, status, message):
        super().__init__(message)
        try:
            self.status = Status(status)
        except ValueError:
            self.status = int(status)
        self.message = message

    def __str__(self):
        name = self.status.c_name if isinstance(self.status, Status) else f"status {self.status}"
        return f"{self.message} [{name}]"

    def __reduce__(self):
        return (from_status, (int(self.status), self.message))


class InvalidArgumentError(Error, ValueError):
    """An argument is missing, out of range or otherwise not acceptable (PIPE_ERR_INVALID_ARGUMENT);
    also raised for a handle used after close()."""


class NotFoundError(Error):
    """A file (model, checkpoint) does not exist or cannot be opened (PIPE_ERR_NOT_FOUND)."""


class InvalidFormatError(Error):
    """A file is not in the expected format (PIPE_ERR_INVALID_FORMAT)."""


class SplitError(Error):
    """The model cannot be cut as asked (PIPE_ERR_SPLIT); the message names the offending split
    point or marker and the nearest valid module paths."""


class InputError(Error, ValueError):
    """Inputs do not fit the model: wrong count, dtype, device or shape (PIPE_ERR_INPUT)."""


class ExecutionError(Error):
    """A stage raised while running (PIPE_ERR_EXECUTION); the message names the stage."""


class IOFailedError(Error):
    """Reading or writing a file failed after it was opened (PIPE_ERR_IO)."""


class OutOfMemoryError(Error, MemoryError):
    """Memory could not be allocated (PIPE_ERR_OUT_OF_MEMORY)."""


class UnsupportedError(Error):
    """This build or device cannot do what was asked (PIPE_ERR_UNSUPPORTED)."""


class InternalError(Error):
    """A bug in libpipe (PIPE_ERR_INTERNAL); please report it with the message."""


class WaitTimeoutError(Error):
    """Request.wait(timeout) returned before the call finished (PIPE_ERR_TIMEOUT). The call goes
    on: wait again, cancel it, or close the request."""


class CancelledError(Error):
    """The call was cancelled, or its session closed while it ran (PIPE_ERR_CANCELLED)."""


class DeadlineExceededError(Error):
    """The call did not finish within its `timeout` (PIPE_ERR_DEADLINE_EXCEEDED)."""


class CommunicationError(Error):
    """Talking to another process failed (PIPE_ERR_COMMUNICATION, libpipe >= 0.4): a worker died,
    sent no heartbeat for the session's comm_timeout (killed, stopped, or its host hangs; the
    message names its rank), could not be reached, or the store address is wrong. A session that raised it is broken for good (Session.check() raises it
    again): close it, start its workers again and create a new one."""


class BusyError(Error):
    """Generator.generate() found the generator's queue of sequences waiting for a cache slot full
    (its max_queued; PIPE_ERR_BUSY, libpipe >= 0.8). Nothing was started: retry once a generation
    finished (an HTTP server answers 503)."""


# The exception class of each failure status, by its name in Status. Hand-written, as the classes
# are: the binding parity test (tests/conformance/check_binding_parity.py) fails when pipe.h has a
# status code that is missing here.
_BY_NAME = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "INVALID_FORMAT": InvalidFormatError,
    "SPLIT": SplitError,
    "INPUT": InputError,
    "EXECUTION": ExecutionError,
    "IO": IOFailedError,
    "OUT_OF_MEMORY": OutOfMemoryError,
    "UNSUPPORTED": UnsupportedError,
    "INTERNAL": InternalError,
    "TIMEOUT": WaitTimeoutError,
    "CANCELLED": CancelledError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "COMMUNICATION": CommunicationError,
    "BUSY": BusyError,
}
_BY_STATUS = {status: _BY_NAME[status.name] for status in Status if status.name in _BY_NAME}


def from_status(status, message):
    """The exception for a failed call's status code and message (used by the native module)."""
    try:
        cls = _BY_STATUS.get(Status(status), Error)
    except ValueError:
        cls = Error
    return cls(status, message)
