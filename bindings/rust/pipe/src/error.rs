use std::fmt;

use pipe_sys as sys;

/// Why a call failed: the `PIPE_ERR_*` code of `pipe.h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// An argument is out of range or otherwise not acceptable.
    InvalidArgument,
    /// A file does not exist or cannot be opened.
    NotFound,
    /// A file is not in the expected format.
    InvalidFormat,
    /// The model cannot be split as asked.
    Split,
    /// Inputs do not fit the model (count, dtype, shape).
    Input,
    /// A stage raised while running.
    Execution,
    /// Reading or writing a file failed after it was opened.
    Io,
    /// Memory could not be allocated.
    OutOfMemory,
    /// This build or device cannot do it.
    Unsupported,
    /// A bug in libpipe.
    Internal,
    /// [`crate::Request::wait`]: the call is still running.
    Timeout,
    /// The call was cancelled (or its session destroyed).
    Cancelled,
    /// The call missed its deadline ([`crate::RunOptions::timeout`]).
    DeadlineExceeded,
    /// A code this binding does not know (a newer libpipe).
    Unknown(i32),
}

impl Status {
    /// The status for a `pipe_status` code; `None` for `PIPE_OK`.
    pub fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::PIPE_OK => return None,
            sys::PIPE_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::PIPE_ERR_NOT_FOUND => Status::NotFound,
            sys::PIPE_ERR_INVALID_FORMAT => Status::InvalidFormat,
            sys::PIPE_ERR_SPLIT => Status::Split,
            sys::PIPE_ERR_INPUT => Status::Input,
            sys::PIPE_ERR_EXECUTION => Status::Execution,
            sys::PIPE_ERR_IO => Status::Io,
            sys::PIPE_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::PIPE_ERR_UNSUPPORTED => Status::Unsupported,
            sys::PIPE_ERR_INTERNAL => Status::Internal,
            sys::PIPE_ERR_TIMEOUT => Status::Timeout,
            sys::PIPE_ERR_CANCELLED => Status::Cancelled,
            sys::PIPE_ERR_DEADLINE_EXCEEDED => Status::DeadlineExceeded,
            other => Status::Unknown(other),
        })
    }

    /// The `pipe_status` code.
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::PIPE_ERR_INVALID_ARGUMENT,
            Status::NotFound => sys::PIPE_ERR_NOT_FOUND,
            Status::InvalidFormat => sys::PIPE_ERR_INVALID_FORMAT,
            Status::Split => sys::PIPE_ERR_SPLIT,
            Status::Input => sys::PIPE_ERR_INPUT,
            Status::Execution => sys::PIPE_ERR_EXECUTION,
            Status::Io => sys::PIPE_ERR_IO,
            Status::OutOfMemory => sys::PIPE_ERR_OUT_OF_MEMORY,
            Status::Unsupported => sys::PIPE_ERR_UNSUPPORTED,
            Status::Internal => sys::PIPE_ERR_INTERNAL,
            Status::Timeout => sys::PIPE_ERR_TIMEOUT,
            Status::Cancelled => sys::PIPE_ERR_CANCELLED,
            Status::DeadlineExceeded => sys::PIPE_ERR_DEADLINE_EXCEEDED,
            Status::Unknown(code) => code,
        }
    }

    /// The code's name as libpipe spells it ("PIPE_ERR_INPUT", ...).
    pub fn name(self) -> &'static str {
        // SAFETY: pipe_status_string is global, never fails and returns a static string.
        let s = unsafe { std::ffi::CStr::from_ptr(sys::pipe_status_string(self.code())) };
        s.to_str().unwrap_or("PIPE_ERR_UNKNOWN")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed libpipe call: its status and the message libpipe left for it (what was wrong and
/// what to do), or a message from this binding for errors it finds before calling libpipe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

/// The result of a fallible libpipe call.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    /// The error of a call that just returned `code` on this thread (the message is read with
    /// pipe_last_error before any other libpipe call can replace it).
    pub(crate) fn last(code: i32) -> Error {
        let status = Status::from_code(code).unwrap_or(Status::Internal);
        // SAFETY: pipe_last_error is global; the string stays valid until this thread's next
        // libpipe call, and it is copied before that.
        let message = unsafe { crate::copy_cstr(sys::pipe_last_error()) };
        Error { status, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.message, self.status.name())
    }
}

impl std::error::Error for Error {}

/// `Ok(())` for PIPE_OK, else the error with this thread's last message.
pub(crate) fn check(code: sys::pipe_status) -> Result<()> {
    if code == sys::PIPE_OK {
        Ok(())
    } else {
        Err(Error::last(code))
    }
}
