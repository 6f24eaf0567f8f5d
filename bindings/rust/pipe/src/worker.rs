//! Serving stages for a session driven by another process (pipe.h's pipe_worker_run).

use std::time::Duration;

use pipe_sys as sys;

use crate::error::{check, Result};
use crate::session::to_i32;

/// Which session a worker process joins ([`run_worker`]; pipe.h's pipe_worker_options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerOptions {
    rank: usize,
    world_size: usize,
    store: String,
    comm_timeout: Option<Duration>,
    threads_per_stage: usize,
    token: Option<String>,
}

impl WorkerOptions {
    /// Rank `rank` (1 .. world_size - 1; rank 0 is the driver, which creates the session) of a
    /// session over `world_size` processes (the driver's [`crate::SessionOptions::world_size`]),
    /// whose driver's store listens at `store`, `"HOST:PORT"`. A driver given port 0 reports the
    /// port its store got ("store listening on HOST:PORT", see [`crate::SessionOptions::store`]);
    /// port 0 is [`crate::Status::InvalidArgument`] here.
    pub fn new(rank: usize, world_size: usize, store: &str) -> WorkerOptions {
        WorkerOptions {
            rank,
            world_size,
            store: store.to_owned(),
            comm_timeout: None,
            threads_per_stage: 0,
            token: None,
        }
    }

    /// A worker whose rank and world size a launcher's environment gives (torchrun, srun): its
    /// rank i serves as rank i + 1 of a driver outside the launch, whose store is `store` (`""`:
    /// the `LIBPIPE_STORE` environment variable).
    pub fn from_launcher(store: &str) -> WorkerOptions {
        WorkerOptions::new(0, 0, store)
    }

    /// The session's secret, the driver's own (default: the `LIBPIPE_TOKEN` environment
    /// variable).
    pub fn token(mut self, token: &str) -> WorkerOptions {
        self.token = Some(token.to_owned());
        self
    }

    /// How long to keep trying to reach the store, and to wait for the driver's stages, before
    /// failing with [`crate::Status::Communication`]. Default: libpipe's, one minute. Once serving, a
    /// worker waits for work as long as its driver is alive. Rounded up to whole milliseconds;
    /// zero, or more than `i32::MAX` milliseconds, is [`crate::Status::InvalidArgument`].
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
/// [`crate::SessionOptions`] `transport(Tcp or Nccl)`, `world_size` and `store`: join through
/// the driver's store, receive this rank's stages and run them until the driver drops that
/// session, then return `Ok`. Serves one session; call it again for the next.
///
/// Errors: [`crate::Status::Communication`] when the store cannot be reached within the comm timeout (the
/// message names the address), the rank is taken, the driver's libpipe version differs, or the
/// driver goes away (also when its session broke); [`crate::Status::InvalidArgument`] for a rank, world
/// size or address that is out of range or malformed. Errors in this worker's stages are
/// reported to the driver's calls, not here.
///
/// There is no cancellation: this blocks the calling thread in libpipe until one of the above
/// happens, and libpipe has no call that stops a worker from outside. To stop a worker early,
/// drop the driver's session (this then returns `Ok`) or end the worker's process.
pub fn run_worker(options: &WorkerOptions) -> Result<()> {
    // An empty store is NULL: libpipe then reads LIBPIPE_STORE, and says so when it is not set.
    let store = (!options.store.is_empty()).then(|| crate::cstring("store", &options.store)).transpose()?;
    let token = options.token.as_deref().map(|t| crate::cstring("token", t)).transpose()?;
    let mut raw = crate::defaults::worker_options()?;
    raw.rank = to_i32("rank", options.rank)?;
    raw.world_size = to_i32("world_size", options.world_size)?;
    raw.store = store.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    raw.token = token.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
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
