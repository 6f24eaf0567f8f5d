use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use pipe_sys as sys;

use crate::error::{check, Result};

/// Severity of a log message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Debug,
    Info,
    Warning,
    Error,
}

impl LogLevel {
    fn code(self) -> i32 {
        match self {
            LogLevel::Debug => sys::PIPE_LOG_DEBUG,
            LogLevel::Info => sys::PIPE_LOG_INFO,
            LogLevel::Warning => sys::PIPE_LOG_WARNING,
            LogLevel::Error => sys::PIPE_LOG_ERROR,
        }
    }

    fn from_code(code: i32) -> LogLevel {
        match code {
            sys::PIPE_LOG_DEBUG => LogLevel::Debug,
            sys::PIPE_LOG_INFO => LogLevel::Info,
            sys::PIPE_LOG_WARNING => LogLevel::Warning,
            _ => LogLevel::Error,
        }
    }
}

type Callback = dyn Fn(LogLevel, &str) + Send + Sync + 'static;

unsafe extern "C" fn trampoline(user_data: *mut c_void, level: i32, message: *const c_char) {
    // SAFETY: user_data is the leaked Box<Box<Callback>> installed by set_log_callback, never
    // freed; message is valid during this call.
    let f = &*(user_data as *const Box<Callback>);
    let msg = if message.is_null() { "".into() } else { CStr::from_ptr(message).to_string_lossy() };
    // A panic must not unwind into libpipe's C++ worker threads.
    let _ = catch_unwind(AssertUnwindSafe(|| f(LogLevel::from_code(level), &msg)));
}

/// Send libpipe's log messages at `min_level` and above to `f` instead of stderr. `f` may be
/// called from libpipe's worker threads, concurrently, and must not call back into libpipe.
///
/// The closure is leaked on purpose: libpipe may still be calling the previous callback on
/// another thread when a new one is installed, so a callback is never freed. Install loggers
/// once (or rarely), not per request.
pub fn set_log_callback<F>(f: F, min_level: LogLevel) -> Result<()>
where
    F: Fn(LogLevel, &str) + Send + Sync + 'static,
{
    let boxed: Box<Box<Callback>> = Box::new(Box::new(f));
    let user_data = Box::into_raw(boxed) as *mut c_void;
    // SAFETY: global; the trampoline matches pipe_log_fn and user_data lives forever.
    let result = check(unsafe { sys::pipe_set_log_callback(Some(trampoline), user_data, min_level.code()) });
    if result.is_err() {
        // Not installed, so libpipe never saw it: free it.
        drop(unsafe { Box::from_raw(user_data as *mut Box<Callback>) });
    }
    result
}

/// Restore the default logger (warnings and errors to stderr).
pub fn reset_log_callback() -> Result<()> {
    // SAFETY: global.
    check(unsafe { sys::pipe_set_log_callback(None, std::ptr::null_mut(), sys::PIPE_LOG_WARNING) })
}
