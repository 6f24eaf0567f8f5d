//! Serving stages for a session driven by another process (pipe.h's pipe_worker_run).

use std::time::Duration;

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::session::to_i32;

/// Which session a worker process joins ([`run_worker`]; pipe.h's pipe_worker_options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerOptions {
    rank: usize,
    world_size: usize,
    store: String,
    comm_timeout: Option<Duration>,
    threads_per_stage: usize,
}

impl WorkerOptions {
    /// Rank `rank` (1 .. world_size - 1; rank 0 is the driver, which creates the session) of a
    /// session over `world_size` processes (the driver's [`crate::SessionOptions::world_size`]),
    /// whose driver's store listens at `store`, `"HOST:PORT"`. A driver given port 0 reports the
    /// port its store got ("store listening on HOST:PORT", see [`crate::SessionOptions::store`]);
    /// port 0 is [`Status::InvalidArgument`] here.
    pub fn new(rank: usize, world_size: usize, store: &str) -> WorkerOptions {
        WorkerOptions { rank, world_size, store: store.to_owned(), comm_timeout: None, threads_per_stage: 0 }
    }

    /// How long to keep trying to reach the store, and to wait for the driver's stages, before
    /// failing with [`Status::Communication`]. Default: libpipe's, one minute. Once serving, a
    /// worker waits for work as long as its driver is alive. Rounded up to whole milliseconds;
    /// zero, or more than `i32::MAX` milliseconds, is [`Status::InvalidArgument`].
    pub fn comm_timeout(mut self, timeout: Duration) -> WorkerOptions {
        self.comm_timeout = Some(timeout);
        self
    }

    /// Intra-op threads per stage; 0 (default) takes the driver's setting.
    pub fn threads_per_stage(mut self, n: usize) -> WorkerOptions {
        self.threads_per_stage = n;
        self
    }
}

/// Serve as a worker of the session whose driver (rank 0) creates it with
/// [`crate::SessionOptions`] `transport(Gloo or Nccl)`, `world_size` and `store`: join through
/// the driver's store, receive this rank's stages and run them until the driver drops that
/// session, then return `Ok`. Serves one session; call it again for the next.
///
/// Errors: [`Status::Communication`] when the store cannot be reached within the comm timeout (the
/// message names the address), the rank is taken, the driver's libpipe version differs, or the
/// driver goes away (also when its session broke); [`Status::InvalidArgument`] for a rank, world
/// size or address that is out of range or malformed. Errors in this worker's stages are
/// reported to the driver's calls, not here.
///
/// There is no cancellation: this blocks the calling thread in libpipe until one of the above
/// happens, and libpipe has no call that stops a worker from outside. To stop a worker early,
/// drop the driver's session (this then returns `Ok`) or end the worker's process.
pub fn run_worker(options: &WorkerOptions) -> Result<()> {
    if options.store.is_empty() {
        return Err(Error::new(
            Status::InvalidArgument,
            "no store: give the driver's store address, HOST:PORT with the port its store listens on",
        ));
    }
    let store = crate::cstring("store", &options.store)?;
    let mut raw = crate::defaults::worker_options()?;
    raw.rank = to_i32("rank", options.rank)?;
    raw.world_size = to_i32("world_size", options.world_size)?;
    raw.store = store.as_ptr();
    raw.comm_timeout_ms = crate::session::comm_timeout_ms(options.comm_timeout)?;
    raw.threads_per_stage = to_i32("threads_per_stage", options.threads_per_stage)?;
    // SAFETY: global; `raw` and the store string it points to outlive the call, which only
    // reads them.
    check(unsafe { sys::pipe_worker_run(&raw) })
}

#[cfg(test)]
mod tests {
    use super::*;

    // The options start from pipe_worker_options_init, and only the fields given change.
    #[test]
    fn worker_option_defaults_are_libpipes() {
        let init = crate::defaults::worker_options().unwrap();
        assert_eq!(init.struct_size as usize, std::mem::size_of::<sys::pipe_worker_options>());
        let options = WorkerOptions::new(1, 2, "h:1");
        assert_eq!(options.threads_per_stage as i32, init.threads_per_stage);
        assert_eq!(crate::session::comm_timeout_ms(options.comm_timeout).unwrap(), init.comm_timeout_ms);
    }
}
