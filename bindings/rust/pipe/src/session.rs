use std::borrow::Borrow;
use std::ffi::CString;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::Mutex;
use std::time::Duration;

use pipe_sys as sys;

use crate::completion::DoneCallback;
use crate::error::{check, Error, Result, Status};
use crate::list::TensorList;
use crate::plan::{Plan, RawStageOptions, StageOptions};
use crate::tensor::Tensor;

/// Rust tensors described as DLPack for one libpipe call. The DLManagedTensors point into the
/// tensors' own memory (no copy) and have no deleter; the borrow `'a` keeps the tensors alive
/// and unchanged until this value is dropped, which is after the call returns. libpipe keeps no
/// pointer to them afterwards: pipe_session_run and pipe_plan_options_set_example_inputs
/// borrow only for the call, pipe_session_submit copies.
pub(crate) struct BorrowedInputs<'a> {
    // Kept alive (and never resized) while `ptrs` points into it.
    _managed: Vec<sys::DLManagedTensor>,
    ptrs: Vec<*const sys::DLManagedTensor>,
    _borrow: PhantomData<&'a Tensor>,
}

impl BorrowedInputs<'_> {
    pub(crate) fn as_ptr(&self) -> *const *const sys::DLManagedTensor {
        self.ptrs.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.ptrs.len()
    }
}

pub(crate) fn borrow_inputs<T: Borrow<Tensor>>(inputs: &[T]) -> BorrowedInputs<'_> {
    let managed: Vec<sys::DLManagedTensor> = inputs.iter().map(|t| t.borrow().dlpack_borrow()).collect();
    let ptrs = managed.iter().map(|m| m as *const sys::DLManagedTensor).collect();
    BorrowedInputs { _managed: managed, ptrs, _borrow: PhantomData }
}

/// Milliseconds for libpipe, rounded up so that a non-zero duration never becomes 0 ("no
/// deadline" / "only check"), saturating at i64::MAX.
pub(crate) fn duration_ms(d: Duration) -> i64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// A comm_timeout_ms field: 0 (libpipe's default, one minute) for None, else the duration in
/// milliseconds, rounded up. A zero duration or one beyond i32::MAX milliseconds is refused
/// rather than turned into the default or cut short.
pub(crate) fn comm_timeout_ms(timeout: Option<Duration>) -> Result<i32> {
    let Some(d) = timeout else { return Ok(0) };
    if d.is_zero() {
        return Err(Error::new(
            Status::InvalidArgument,
            "comm_timeout must be positive; leave it unset for libpipe's default (one minute)",
        ));
    }
    i32::try_from(duration_ms(d)).map_err(|_| {
        Error::new(Status::InvalidArgument, format!("comm_timeout is {d:?}; it can be at most {} ms", i32::MAX))
    })
}

/// How the stages of a session talk ([`SessionOptions::transport`]; pipe.h's PIPE_TRANSPORT_*).
/// Parsed from and displayed as "local", "tcp" and "nccl", as the pipe tool's `--transport` and
/// Python's `transport=` spell them ("gloo", the TCP transport's name before libpipe 0.12, parses
/// as [`Transport::Tcp`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Every stage runs in this process. `PIPE_TRANSPORT_LOCAL`.
    #[default]
    Local,
    /// CPU stages spread over [`SessionOptions::world_size`] processes, over libpipe's own TCP
    /// connections, each authenticated with the session's token ([`SessionOptions::token`]).
    /// `PIPE_TRANSPORT_TCP` (`PIPE_TRANSPORT_GLOO` before 0.12).
    Tcp,
    /// GPU stages spread over [`SessionOptions::world_size`] processes, one GPU each.
    /// `PIPE_TRANSPORT_NCCL`.
    Nccl,
}

impl Transport {
    const ALL: [Transport; 3] = [Transport::Local, Transport::Tcp, Transport::Nccl];

    /// "local", "tcp" or "nccl".
    pub fn name(self) -> &'static str {
        match self {
            Transport::Local => "local",
            Transport::Tcp => "tcp",
            Transport::Nccl => "nccl",
        }
    }

    /// The transport of a PIPE_TRANSPORT_* value; None for one pipe.h does not define.
    fn from_raw(raw: i32) -> Option<Transport> {
        Transport::ALL.into_iter().find(|t| t.to_raw() == raw)
    }

    fn to_raw(self) -> i32 {
        match self {
            Transport::Local => sys::PIPE_TRANSPORT_LOCAL,
            Transport::Tcp => sys::PIPE_TRANSPORT_TCP,
            Transport::Nccl => sys::PIPE_TRANSPORT_NCCL,
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = Error;

    /// [`Status::InvalidArgument`] for any other name than "local", "tcp" ("gloo") and "nccl".
    fn from_str(name: &str) -> Result<Transport> {
        if name == "gloo" {
            return Ok(Transport::Tcp);
        }
        Transport::ALL.into_iter().find(|t| t.name() == name).ok_or_else(|| {
            Error::new(Status::InvalidArgument, format!("transport must be one of local, tcp, nccl, not {name:?}"))
        })
    }
}

/// How one input is cut into micro-batches, or how one output is put back together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ChunkSpec {
    /// Inputs: rank >= 1 split along 0, others replicated. Outputs: concatenated along 0.
    #[default]
    Default,
    /// Input: split along this dimension (negative counts from the end).
    Split(i32),
    /// Input: every micro-batch gets the whole tensor.
    Replicate,
    /// Output: concatenate the micro-batches' results along this dimension.
    Concat(i32),
    /// Output: add the micro-batches' results.
    Sum,
    /// Output: every micro-batch must give the same value (else [`Status::Execution`]).
    Equal,
}

impl ChunkSpec {
    fn to_raw(self) -> sys::pipe_chunk_spec {
        let (kind, dim) = match self {
            ChunkSpec::Default => (sys::PIPE_CHUNK_DEFAULT, 0),
            ChunkSpec::Split(d) => (sys::PIPE_CHUNK_SPLIT, d),
            ChunkSpec::Replicate => (sys::PIPE_CHUNK_REPLICATE, 0),
            ChunkSpec::Concat(d) => (sys::PIPE_CHUNK_CONCAT, d),
            ChunkSpec::Sum => (sys::PIPE_CHUNK_SUM, 0),
            ChunkSpec::Equal => (sys::PIPE_CHUNK_EQUAL, 0),
        };
        sys::pipe_chunk_spec { kind, dim }
    }
}

/// How many micro-batches each call is cut into ([`SessionOptions::microbatching`]). The
/// results are the same either way; only the number of micro-batches run
/// ([`StageStats::microbatches`]) differs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Microbatching {
    /// A call that finds the pipeline empty is cut into [`SessionOptions::microbatches`]; a
    /// call that arrives while others are in flight gets only as many as bring the pipeline to
    /// one micro-batch per stage (at least 1): the other calls already keep the stages busy,
    /// and finer cuts would only cost efficiency. `PIPE_MICROBATCHING_ADAPTIVE`.
    #[default]
    Adaptive,
    /// Every call is cut into [`SessionOptions::microbatches`], e.g. to bound the activation
    /// memory of one micro-batch. `PIPE_MICROBATCHING_FIXED`.
    Fixed,
}

impl Microbatching {
    /// The mode of a PIPE_MICROBATCHING_* value; None for one pipe.h does not define.
    fn from_raw(raw: i32) -> Option<Microbatching> {
        match raw {
            sys::PIPE_MICROBATCHING_ADAPTIVE => Some(Microbatching::Adaptive),
            sys::PIPE_MICROBATCHING_FIXED => Some(Microbatching::Fixed),
            _ => None,
        }
    }

    fn to_raw(self) -> i32 {
        match self {
            Microbatching::Adaptive => sys::PIPE_MICROBATCHING_ADAPTIVE,
            Microbatching::Fixed => sys::PIPE_MICROBATCHING_FIXED,
        }
    }
}

/// Session options; the defaults are libpipe's own (pipe_session_options_init, read at run time:
/// pipe.h's PIPE_SESSION_OPTIONS_INIT).
#[derive(Clone, Debug)]
pub struct SessionOptions {
    microbatches: usize,
    microbatching: Microbatching,
    threads_per_stage: usize,
    max_inflight: usize,
    input_specs: Vec<ChunkSpec>,
    output_specs: Vec<ChunkSpec>,
    stage_options: Option<StageOptions>,
    devices: Option<String>,
    transport: Transport,
    world_size: usize,
    store: Option<String>,
    comm_timeout: Option<Duration>,
    token: Option<String>,
}

impl Default for SessionOptions {
    fn default() -> SessionOptions {
        // Fails only if the loaded libpipe refuses the size of the pipe.h this crate was built
        // with, i.e. it is not the libpipe that header belongs to.
        let raw = crate::defaults::session_options()
            .unwrap_or_else(|e| panic!("libpipe does not match the pipe.h this crate was built with: {e}"));
        let count = |n: i32| usize::try_from(n).unwrap_or(0);
        SessionOptions {
            microbatches: count(raw.num_microbatches),
            microbatching: Microbatching::from_raw(raw.microbatching).unwrap_or_default(),
            threads_per_stage: count(raw.threads_per_stage),
            max_inflight: count(raw.max_inflight),
            input_specs: Vec::new(),
            output_specs: Vec::new(),
            stage_options: None,
            devices: None,
            transport: Transport::from_raw(raw.transport).unwrap_or_default(),
            world_size: count(raw.world_size),
            store: None,
            comm_timeout: None,
            token: None,
        }
    }
}

pub(crate) fn to_i32(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::new(Status::InvalidArgument, format!("{what} = {n} is too large")))
}

impl SessionOptions {
    pub fn new() -> SessionOptions {
        SessionOptions::default()
    }

    /// Micro-batches per call (>= 1; default 1); see [`SessionOptions::microbatching`] for
    /// when a call gets fewer. A batch with fewer rows runs as that many micro-batches.
    pub fn microbatches(mut self, n: usize) -> SessionOptions {
        self.microbatches = n;
        self
    }

    /// [`Microbatching::Adaptive`] (default: calls arriving while others are in flight are cut
    /// into fewer micro-batches) or [`Microbatching::Fixed`] (every call gets
    /// [`SessionOptions::microbatches`]).
    pub fn microbatching(mut self, mode: Microbatching) -> SessionOptions {
        self.microbatching = mode;
        self
    }

    /// Intra-op threads per stage worker; 0 (default) picks max(1, cores / stages).
    pub fn threads_per_stage(mut self, n: usize) -> SessionOptions {
        self.threads_per_stage = n;
        self
    }

    /// Micro-batches admitted into the pipeline at once, over all calls; 0 (default) picks
    /// max(2 x microbatches, 4 x stages).
    pub fn max_inflight(mut self, n: usize) -> SessionOptions {
        self.max_inflight = n;
        self
    }

    /// Per forward argument, in order (missing ones are [`ChunkSpec::Default`]).
    pub fn input_specs(mut self, specs: Vec<ChunkSpec>) -> SessionOptions {
        self.input_specs = specs;
        self
    }

    /// Per output, in the order the outputs are named (missing ones concatenate along 0).
    pub fn output_specs(mut self, specs: Vec<ChunkSpec>) -> SessionOptions {
        self.output_specs = specs;
        self
    }

    /// Weights and dtype of every stage.
    pub fn stage_options(mut self, options: StageOptions) -> SessionOptions {
        self.stage_options = Some(options);
        self
    }

    /// Where each stage runs: one device per stage (`"cpu,cuda:0"`), one for all (`"cuda:0"`),
    /// or `"auto"` (the visible GPUs in order, else the CPU). Default: every stage on the CPU.
    /// A device the machine lacks fails [`Session::new`] with [`Status::Unsupported`] naming the
    /// stage. Results always come back in CPU memory.
    pub fn devices(mut self, devices: &str) -> SessionOptions {
        self.devices = Some(devices.to_owned());
        self
    }

    /// How the stages talk: [`Transport::Local`] (default) runs every stage in this process.
    /// With [`Transport::Tcp`] or [`Transport::Nccl`] this process is rank 0 (the driver, with
    /// the first stages), and [`SessionOptions::world_size`] - 1 worker processes, ranks 1 ..
    /// world_size - 1, each run [`crate::run_worker`] (or `pipe worker`) and get contiguous
    /// groups of the following stages. [`Session::new`] waits for them to join and load them.
    pub fn transport(mut self, transport: Transport) -> SessionOptions {
        self.transport = transport;
        self
    }

    /// Processes in the session, this one included (default 1; at least 2 with TCP or NCCL).
    pub fn world_size(mut self, n: usize) -> SessionOptions {
        self.world_size = n;
        self
    }

    /// `"HOST:PORT"` of the rendezvous store, which this process hosts: it listens on PORT, and
    /// HOST is this machine's address as the workers reach it. Required unless the transport is
    /// local. Port 0 lets the store pick a free port, which libpipe reports as soon as it
    /// listens, before waiting for the workers, in the [`crate::LogLevel::Info`] message
    /// `"store listening on HOST:PORT"` ([`crate::set_log_callback`]): the address to give the
    /// workers. A malformed address is [`Status::InvalidArgument`], an unusable one
    /// [`Status::Communication`].
    pub fn store(mut self, address: &str) -> SessionOptions {
        self.store = Some(address.to_owned());
        self
    }

    /// How long joining and loading may take, and a worker may send no heartbeat, before the
    /// session breaks and the calls its workers hold fail with [`Status::Communication`] naming
    /// the rank. Workers send heartbeats from a thread of their own whatever their stages do, so
    /// a stage may take longer than this per micro-batch; only a worker that was killed or
    /// stopped, or whose host hangs, stops them (a worker that dies is noticed at once).
    /// Default: libpipe's, one minute. Rounded up to whole milliseconds; zero, or more
    /// than `i32::MAX` milliseconds, fails [`Session::new`] with [`Status::InvalidArgument`].
    pub fn comm_timeout(mut self, timeout: Duration) -> SessionOptions {
        self.comm_timeout = Some(timeout);
        self
    }

    /// The session's secret, the same for every process of it (default: the `LIBPIPE_TOKEN`
    /// environment variable). Required with a world size above 1 (at least 16 bytes): every
    /// connection to the store and between ranks proves both ends hold it without sending it, and
    /// a process that cannot is refused while the session goes on. It authenticates; it does not
    /// encrypt.
    pub fn token(mut self, token: &str) -> SessionOptions {
        self.token = Some(token.to_owned());
        self
    }
}

/// A pipe_session_options and everything it points into, owned together so that the pointers stay
/// valid while this value lives (a Vec's or CString's heap buffer does not move with it; the stage
/// options are boxed for the same reason).
pub(crate) struct RawSessionOptions {
    pub(crate) raw: sys::pipe_session_options,
    _input_specs: Vec<sys::pipe_chunk_spec>,
    _output_specs: Vec<sys::pipe_chunk_spec>,
    _stage: Option<Box<RawStageOptions>>,
    _devices: Option<CString>,
    _store: Option<CString>,
    _token: Option<CString>,
}

impl SessionOptions {
    /// libpipe's form of these options, for pipe_session_create and pipe_generator_create.
    pub(crate) fn to_raw(&self) -> Result<RawSessionOptions> {
        let devices = self
            .devices
            .as_deref()
            .map(|d| CString::new(d).map_err(|_| Error::new(Status::InvalidArgument, "devices contains a NUL byte")))
            .transpose()?;
        let input_specs: Vec<sys::pipe_chunk_spec> = self.input_specs.iter().map(|s| s.to_raw()).collect();
        let output_specs: Vec<sys::pipe_chunk_spec> = self.output_specs.iter().map(|s| s.to_raw()).collect();
        let stage = self.stage_options.as_ref().map(StageOptions::to_raw).transpose()?.map(Box::new);
        let store = self.store.as_deref().map(|s| crate::cstring("store", s)).transpose()?;
        let token = self.token.as_deref().map(|t| crate::cstring("token", t)).transpose()?;
        let mut raw = crate::defaults::session_options()?;
        raw.num_microbatches = to_i32("microbatches", self.microbatches)?;
        raw.microbatching = self.microbatching.to_raw();
        raw.threads_per_stage = to_i32("threads_per_stage", self.threads_per_stage)?;
        raw.max_inflight = to_i32("max_inflight", self.max_inflight)?;
        if !input_specs.is_empty() {
            raw.input_specs = input_specs.as_ptr();
            raw.num_input_specs = input_specs.len();
        }
        if !output_specs.is_empty() {
            raw.output_specs = output_specs.as_ptr();
            raw.num_output_specs = output_specs.len();
        }
        raw.stage_options = stage.as_ref().map_or(ptr::null(), |s| &s.raw as *const _);
        raw.devices = devices.as_ref().map_or(ptr::null(), |d| d.as_ptr());
        raw.transport = self.transport.to_raw();
        raw.world_size = to_i32("world_size", self.world_size)?;
        raw.store = store.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        raw.comm_timeout_ms = comm_timeout_ms(self.comm_timeout)?;
        raw.token = token.as_ref().map_or(ptr::null(), |t| t.as_ptr());
        Ok(RawSessionOptions {
            raw,
            _input_specs: input_specs,
            _output_specs: output_specs,
            _stage: stage,
            _devices: devices,
            _store: store,
            _token: token,
        })
    }
}

/// Per-call options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// The call fails with [`Status::DeadlineExceeded`] if it has not finished this long after
    /// it started (waiting for room in the pipeline included). None: no deadline.
    pub timeout: Option<Duration>,
}

impl RunOptions {
    pub fn with_timeout(timeout: Duration) -> RunOptions {
        RunOptions { timeout: Some(timeout) }
    }

    fn to_raw(self) -> Result<sys::pipe_run_options> {
        let mut raw = crate::defaults::run_options()?;
        raw.timeout_ms = self.timeout.map_or(0, duration_ms);
        Ok(raw)
    }
}

/// What one stage worker has done since the session was created.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageStats {
    /// Micro-batches run (failed ones included).
    pub microbatches: u64,
    /// Micro-batches whose stage code raised.
    pub failures: u64,
    /// Time spent running the stage, in milliseconds.
    pub busy_ms: f64,
    /// Time spent waiting for work, in milliseconds.
    pub idle_ms: f64,
    /// Micro-batches waiting for this stage now.
    pub queue_depth: u64,
}

/// Stage workers running a plan: call [`Session::run`] (blocking) or [`Session::submit`]
/// (asynchronous), from as many threads as you like.
pub struct Session {
    ptr: NonNull<sys::pipe_session>,
}

// SAFETY: pipe.h marks pipe_session_run and pipe_session_submit "thread-safe: many threads may
// run on one session at once", and num_stages, stage_stats, trace_start, trace_stop and check
// thread-safe too; every &self method here calls only those. pipe_session_destroy is exclusive
// and must not overlap a run or submit in another thread: it runs in Drop, which needs sole
// ownership, so no &Session (hence no call in progress) can exist then. Nothing ties a session
// to the thread that created it.
unsafe impl Send for Session {}
unsafe impl Sync for Session {}

impl Session {
    /// Build every stage of `plan` on its device ([`SessionOptions::devices`]; the CPU by
    /// default) and start one worker thread per stage.
    pub fn new(plan: &Plan, options: &SessionOptions) -> Result<Session> {
        let raw = options.to_raw()?;
        let mut session = ptr::null_mut();
        // SAFETY: thread-safe on the plan; every pointer in `raw` outlives the call (the spec
        // arrays, the device list and the store address are copied by libpipe).
        check(unsafe { sys::pipe_session_create(plan.as_ptr(), &raw.raw, &mut session) })?;
        NonNull::new(session)
            .map(|ptr| Session { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL session"))
    }

    /// A `Session` for a session that libpipe owns (a generator's, [`crate::Generator::session`]):
    /// never dropped, so never destroyed here.
    ///
    /// # Safety
    ///
    /// `ptr` must stay valid while the result is used.
    pub(crate) unsafe fn borrowed(ptr: NonNull<sys::pipe_session>) -> ManuallyDrop<Session> {
        ManuallyDrop::new(Session { ptr })
    }

    /// `Ok` while the session works. Once a transport failure has broken it (a worker process
    /// died, or sent no heartbeat for [`SessionOptions::comm_timeout`]), the error
    /// [`Status::Communication`] with the reason, and every later call fails at once the same
    /// way: drop the session, start its workers again and create a new one. A local session
    /// never breaks.
    pub fn check(&self) -> Result<()> {
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_session_check(self.ptr.as_ptr()) })
    }

    /// Number of stages (and worker threads).
    pub fn num_stages(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_session_num_stages(self.ptr.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Run one call and wait for it. `inputs` are the forward arguments in order
    /// ([`crate::Model::input_names`]). The outputs, copied, are named "output" for a tensor
    /// result, "output.0", "output.1", ... for a tuple, `"output.<key>"` for a dict.
    pub fn run<T: Borrow<Tensor>>(&self, inputs: &[T]) -> Result<Vec<(String, Tensor)>> {
        self.run_list(inputs, &RunOptions::default())?.to_tensors()
    }

    /// [`Session::run`] with a deadline.
    pub fn run_with<T: Borrow<Tensor>>(&self, inputs: &[T], options: &RunOptions) -> Result<Vec<(String, Tensor)>> {
        self.run_list(inputs, options)?.to_tensors()
    }

    /// [`Session::run_with`], returning libpipe's own output list (no copy; it can also be
    /// written to a safetensors file).
    pub fn run_list<T: Borrow<Tensor>>(&self, inputs: &[T], options: &RunOptions) -> Result<TensorList> {
        let borrowed = borrow_inputs(inputs);
        let raw = options.to_raw()?;
        let mut out = ptr::null_mut();
        // SAFETY: thread-safe. The inputs are borrowed only until this returns, and `borrowed`
        // (with the tensors it borrows) lives until then.
        check(unsafe { sys::pipe_session_run(self.ptr.as_ptr(), borrowed.as_ptr(), borrowed.len(), &raw, &mut out) })?;
        drop(borrowed);
        unsafe { TensorList::from_raw(out) }
    }

    /// Start one call without waiting for it (it may wait for room in the pipeline). The inputs
    /// are copied, so they may change or be dropped right after. Input errors (count, batch
    /// sizes) are reported here, errors while running by [`Request::wait`].
    pub fn submit<T: Borrow<Tensor>>(&self, inputs: &[T]) -> Result<Request> {
        self.submit_with(inputs, &RunOptions::default())
    }

    /// [`Session::submit`] with a deadline.
    pub fn submit_with<T: Borrow<Tensor>>(&self, inputs: &[T], options: &RunOptions) -> Result<Request> {
        let borrowed = borrow_inputs(inputs);
        let raw = options.to_raw()?;
        let mut request = ptr::null_mut();
        // SAFETY: thread-safe; libpipe copies the inputs before returning.
        check(unsafe {
            sys::pipe_session_submit(self.ptr.as_ptr(), borrowed.as_ptr(), borrowed.len(), &raw, &mut request)
        })?;
        NonNull::new(request)
            .map(|ptr| Request { ptr, wait_lock: Mutex::new(()), done: DoneCallback::default() })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL request"))
    }

    /// Statistics of stage `stage`.
    pub fn stage_stats(&self, stage: usize) -> Result<StageStats> {
        let mut raw = crate::defaults::stage_stats()?;
        // SAFETY: thread-safe; the library fills the fields struct_size covers.
        check(unsafe { sys::pipe_session_stage_stats(self.ptr.as_ptr(), stage, &mut raw) })?;
        Ok(StageStats {
            microbatches: raw.microbatches,
            failures: raw.failures,
            busy_ms: raw.busy_ms,
            idle_ms: raw.idle_ms,
            queue_depth: raw.queue_depth,
        })
    }

    /// Statistics of every stage, in order.
    pub fn stats(&self) -> Result<Vec<StageStats>> {
        (0..self.num_stages()?).map(|s| self.stage_stats(s)).collect()
    }

    /// Record a timeline of every micro-batch each stage runs from now on.
    pub fn trace_start(&self) -> Result<()> {
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_session_trace_start(self.ptr.as_ptr()) })
    }

    /// Record as [`Session::trace_start`] does, and also put in each stage slice's args, as
    /// `"operators_us"`, the microseconds the stage spent in each operator (a linear layer's keyed
    /// with its weight's shape, `"aten::linear [out x in]"`). A generator's session also records the
    /// engine's steps on a track named `"engine"`. Needs libpipe 0.9.
    pub fn trace_start_with_operators(&self) -> Result<()> {
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_session_trace_start_with_operators(self.ptr.as_ptr()) })
    }

    /// Stop recording and write the timeline as Chrome trace JSON to `path` (None discards it).
    pub fn trace_stop(&self, path: Option<&Path>) -> Result<()> {
        let c = path.map(crate::path_cstring).transpose()?;
        // SAFETY: thread-safe; `c` outlives the call.
        check(unsafe {
            sys::pipe_session_trace_stop(self.ptr.as_ptr(), c.as_ref().map_or(ptr::null(), |c| c.as_ptr()))
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: exclusive, and no run/submit can be in progress (see the Send/Sync note).
        // Calls still in flight (submitted requests) fail with Cancelled; their requests stay
        // valid.
        unsafe { sys::pipe_session_destroy(self.ptr.as_ptr()) }
    }
}

/// An asynchronous call ([`Session::submit`]). Dropping it cancels the call if it is still
/// running. It may outlive its session.
///
/// Wait for it with [`Request::wait`] (blocking), or without a thread: as a future
/// ([`Request::wait_async`], or `request.await`, which cancels the call if dropped before it
/// completes), or by watching [`Request::fd`] (also `AsFd`/`AsRawFd`) in an event loop.
pub struct Request {
    ptr: NonNull<sys::pipe_request>,
    /// pipe_request_wait is exclusive per request: waits from several threads take turns.
    wait_lock: Mutex<()>,
    /// The completion callback, set when a future of this request is first polled.
    pub(crate) done: DoneCallback,
}

// SAFETY: pipe.h: pipe_request_wait is "exclusive per request" — serialised here by
// `wait_lock`, so &Request may be shared; pipe_request_cancel, pipe_request_on_done and
// pipe_request_fd are thread-safe, so they may run while another thread waits;
// pipe_request_destroy is exclusive and runs in Drop with sole ownership. Nothing ties a request
// to the thread that submitted it.
unsafe impl Send for Request {}
unsafe impl Sync for Request {}

impl Request {
    pub(crate) fn as_ptr(&self) -> *mut sys::pipe_request {
        self.ptr.as_ptr()
    }

    /// Wait for the call: `None` as long as it takes, `Some(Duration::ZERO)` only checks.
    /// [`Status::Timeout`] if it is still running when the time is up (wait again, cancel, or
    /// drop); otherwise the call's own result. A finished call gives the same result again.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<(String, Tensor)>> {
        self.wait_list(timeout)?.to_tensors()
    }

    /// [`Request::wait`], returning libpipe's own output list (no copy).
    pub fn wait_list(&self, timeout: Option<Duration>) -> Result<TensorList> {
        let timeout_ms = timeout.map_or(-1, duration_ms);
        // The guard protects no data, so a poisoned lock is still usable.
        let _turn = self.wait_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = ptr::null_mut();
        // SAFETY: exclusive per request, which `_turn` ensures among this request's callers.
        check(unsafe { sys::pipe_request_wait(self.ptr.as_ptr(), timeout_ms, &mut out) })?;
        unsafe { TensorList::from_raw(out) }
    }

    /// Ask the call to stop: micro-batches not yet run are dropped and it fails with
    /// [`Status::Cancelled`]. A call that already finished keeps its result.
    pub fn cancel(&self) -> Result<()> {
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_request_cancel(self.ptr.as_ptr()) })
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: exclusive (we own it); a call still running is cancelled. A completion
        // callback that has not run yet runs in here, before this returns; `done` is dropped
        // after, so the state it shares with the callback is freed once, by the last of them.
        unsafe { sys::pipe_request_destroy(self.ptr.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_to_milliseconds() {
        assert_eq!(duration_ms(Duration::ZERO), 0);
        assert_eq!(duration_ms(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms(Duration::from_millis(250)), 250);
        assert_eq!(duration_ms(Duration::from_micros(2500)), 3);
        assert_eq!(duration_ms(Duration::MAX), i64::MAX);
    }

    // SessionOptions::default() must be libpipe's own defaults (pipe_session_options_init), and
    // the modes must map to pipe.h's constants both ways.
    #[test]
    fn session_option_defaults_are_libpipes() {
        let init = crate::defaults::session_options().unwrap();
        let options = SessionOptions::default();
        assert_eq!(options.microbatches as i32, init.num_microbatches);
        assert_eq!(options.microbatching.to_raw(), init.microbatching);
        assert_eq!(options.threads_per_stage as i32, init.threads_per_stage);
        assert_eq!(options.max_inflight as i32, init.max_inflight);
        assert_eq!(Microbatching::from_raw(sys::PIPE_MICROBATCHING_FIXED), Some(Microbatching::Fixed));
        assert_eq!(Microbatching::from_raw(sys::PIPE_MICROBATCHING_ADAPTIVE), Some(Microbatching::Adaptive));
        assert_eq!(Microbatching::from_raw(-1), None);
        assert_eq!(Microbatching::Fixed.to_raw(), sys::PIPE_MICROBATCHING_FIXED);
        assert_ne!(Microbatching::Fixed.to_raw(), Microbatching::Adaptive.to_raw());
        assert_eq!(options.transport.to_raw(), init.transport);
        assert_eq!(options.world_size as i32, init.world_size);
        assert!(init.store.is_null() && options.store.is_none());
        assert_eq!(init.comm_timeout_ms, 0);
        assert_eq!(comm_timeout_ms(options.comm_timeout).unwrap(), 0);
    }

    #[test]
    fn transports_map_to_pipe_h_and_parse_by_name() {
        for (t, raw, name) in [
            (Transport::Local, sys::PIPE_TRANSPORT_LOCAL, "local"),
            (Transport::Tcp, sys::PIPE_TRANSPORT_TCP, "tcp"),
            (Transport::Nccl, sys::PIPE_TRANSPORT_NCCL, "nccl"),
        ] {
            assert_eq!(t.to_raw(), raw);
            assert_eq!(Transport::from_raw(raw), Some(t));
            assert_eq!(t.to_string(), name);
            assert_eq!(name.parse::<Transport>(), Ok(t));
        }
        assert_eq!(Transport::from_raw(7), None);
        assert_eq!("gloo".parse::<Transport>(), Ok(Transport::Tcp)); // tcp's name before libpipe 0.12
        for bad in ["udp", "Gloo", "TCP", ""] {
            let e = bad.parse::<Transport>().unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument);
            assert!(e.message.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn comm_timeouts_round_up_and_refuse_zero_and_overflow() {
        assert_eq!(comm_timeout_ms(Some(Duration::from_micros(1))).unwrap(), 1);
        assert_eq!(comm_timeout_ms(Some(Duration::from_millis(1500))).unwrap(), 1500);
        assert_eq!(comm_timeout_ms(Some(Duration::from_millis(i32::MAX as u64))).unwrap(), i32::MAX);
        for bad in [Duration::ZERO, Duration::from_millis(i32::MAX as u64 + 1)] {
            let e = comm_timeout_ms(Some(bad)).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument);
            assert!(e.message.contains("comm_timeout"), "{e}");
        }
    }
}
