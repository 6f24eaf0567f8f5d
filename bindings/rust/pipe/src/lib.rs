//! Safe Rust interface to libpipe: run a TorchScript model or a torch.export program cut into
//! pipeline stages, with micro-batches of concurrent calls streaming through the stages.
//!
//! ```no_run
//! use pipe::{Model, Plan, PlanOptions, Session, SessionOptions, Tensor};
//!
//! # fn main() -> pipe::Result<()> {
//! let model = Model::load("demo.pt")?;
//! let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin"))?;
//! let session = Session::new(&plan, &SessionOptions::new().microbatches(4))?;
//! let x = Tensor::new(vec![32, 256], vec![0.5f32; 32 * 256])?;
//! for (name, tensor) in session.run(&[x])? {
//!     println!("{name}: {:?} {:?}", tensor.dtype(), tensor.shape());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Threads
//!
//! Every handle type is `Send` and `Sync` exactly where `pipe.h` says its functions may be used
//! so: [`Model`], [`Plan`] and [`Session`] are `Send + Sync` (share a session with `Arc` and call
//! [`Session::run`] from many threads at once); [`Request`] is `Send + Sync` (its waits are
//! serialised internally, [`Request::cancel`] may run beside a wait), and so are its futures;
//! [`TensorList`] is only `Send`; [`ManagedTensor`] is neither; [`Generator`] and [`Generation`]
//! are `Send + Sync` (reading a generation takes `&mut`; a [`CancelHandle`] cancels it
//! meanwhile). Each `unsafe impl` says why next to it.
//!
//! With the default [`Microbatching::Adaptive`], a call that arrives while other calls are in
//! flight is cut into fewer micro-batches than [`SessionOptions::microbatches`] (the results are
//! the same); [`Microbatching::Fixed`] cuts every call into that many.
//!
//! # Asynchronous calls
//!
//! [`Session::submit`] starts a call and returns its [`Request`]. Wait for it with
//! [`Request::wait`] (a blocking thread per waiting call), or without any thread: await
//! [`Request::wait_async`] (dropping that future leaves the call running), or the request itself
//! (`session.submit(&inputs)?.await`; dropping that future cancels the call). libpipe wakes the
//! task when the call finishes: succeeds, fails, is cancelled, or passes its deadline
//! ([`RunOptions::with_timeout`]), which fires by itself. The futures use only `std::task`, so
//! any executor runs them (tokio, async-std, `futures::executor`, smol), and thousands of calls
//! can be awaited by one thread. Event loops that watch file descriptors can use
//! [`Request::fd`] (or `AsFd`/`AsRawFd`, e.g. tokio's `AsyncFd`): readable once the call has
//! finished; then `wait(Some(Duration::ZERO))` collects the result.
//!
//! ```no_run
//! # use pipe::{Session, Tensor};
//! # async fn serve(session: &Session, batches: Vec<Tensor>) -> pipe::Result<()> {
//! // Submit every batch, then await them all, on one task, without a thread per call.
//! let requests = batches.iter().map(|x| session.submit(&[x])).collect::<pipe::Result<Vec<_>>>()?;
//! for request in requests {
//!     let outputs = request.await?; // Vec<(String, Tensor)>
//!     println!("{}", outputs[0].0);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Generating tokens
//!
//! A [`Generator`] drives a decoder (pipe.h's decoder contract) step by step, batching and
//! pipelining the steps of many sequences; [`Generator::generate`] starts one and returns its
//! [`Generation`], an iterator of tokens that blocks in poll(2) on the generation's descriptor
//! (no thread per generation). [`Generation::next_async`] awaits the next token without blocking
//! (any executor), [`Generation::try_next`] never waits (with [`Generation::fd`] in an event loop).
//! A full queue of sequences waiting for a cache slot is [`Status::Busy`].
//!
//! ```no_run
//! # use pipe::{GenerationOptions, Generator};
//! # async fn f(generator: &Generator, prompt: &[i64]) -> pipe::Result<()> {
//! let options = GenerationOptions { max_new_tokens: 32, temperature: 0.7, seed: 1, ..Default::default() };
//! let mut generation = generator.generate(prompt, &options)?;
//! while let Some(token) = generation.next_async().await {
//!     println!("{}", token?);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Stages in other processes
//!
//! With [`SessionOptions::transport`] Gloo or NCCL, [`SessionOptions::world_size`] and
//! [`SessionOptions::store`], this process drives a session whose later stages run in worker
//! processes, each calling [`run_worker`] with its rank. [`Session::check`] says whether a
//! transport failure (a dead worker, or one whose heartbeat stopped) has broken the session
//! ([`Status::Communication`]).
//!
//! # Tensors
//!
//! Inputs are [`Tensor`]s (owned, typed, row-major). They are handed to libpipe as DLPack
//! tensors pointing at the Rust memory for the duration of one call only; libpipe keeps no
//! pointer to them after it returns. Outputs come back as copies in [`Tensor`]s, or, without a
//! copy, in a [`TensorList`] whose entries can be borrowed ([`TensorRef`]) or taken
//! ([`ManagedTensor`], which calls the DLPack deleter when dropped). A [`TensorList`] can also be
//! built from the caller's tensors ([`TensorList::new`], [`TensorList::append`], which copies),
//! e.g. to write them with libpipe's safetensors writer ([`safetensors::write_tensors`]).

mod completion;
mod defaults;
mod error;
mod generation;
mod generation_async;
mod generator;
mod list;
mod log;
mod model;
mod plan;
mod session;
mod tensor;
mod text;
mod worker;

pub mod safetensors;

pub use completion::{RequestFuture, WaitFuture, WaitListFuture};
pub use error::{Error, Result, Status};
pub use generation::{CancelHandle, FinishReason, Generation, GenerationInfo, TokenLogprob, TokenLogprobs};
pub use generation_async::NextToken;
pub use generator::{GenerationOptions, Generator, GeneratorInfo, GeneratorOptions, GeneratorSession, GeneratorStats};
pub use list::TensorList;
pub use log::{reset_log_callback, set_log_callback, LogLevel};
pub use model::{Model, ModelFormat, ModuleInfo};
pub use plan::{
    EmbeddingQuantization, HeadQuantization, Names, Plan, PlanOptions, Policy, Quantization, StageOptions, WeightDType,
};
pub use session::{ChunkSpec, Microbatching, Request, RunOptions, Session, SessionOptions, StageStats, Transport};
pub use tensor::{AppendSource, DType, Element, ManagedTensor, Tensor, TensorRef};
pub use text::{DecodeStream, Tokenizer};
pub use worker::{run_worker, WorkerOptions};

/// The raw declarations, for what the safe API does not cover.
pub use pipe_sys as sys;

/// "MAJOR.MINOR.PATCH" of the loaded libpipe.
pub fn version() -> &'static str {
    // SAFETY: pipe_version is global, never fails, and returns a static NUL-terminated string
    // that lives as long as the library is loaded (for the whole process: it is linked).
    let v = unsafe { std::ffi::CStr::from_ptr(sys::pipe_version()) };
    v.to_str().unwrap_or("unknown")
}

use std::ffi::CString;
use std::path::Path;

/// A path as a C string (bytes as they are on Unix, so non-UTF-8 file names work too).
pub(crate) fn path_cstring(path: &Path) -> Result<CString> {
    #[cfg(unix)]
    let bytes = {
        use std::os::unix::ffi::OsStrExt;
        path.as_os_str().as_bytes().to_vec()
    };
    #[cfg(not(unix))]
    let bytes = path.to_string_lossy().into_owned().into_bytes();
    CString::new(bytes)
        .map_err(|_| Error::new(Status::InvalidArgument, format!("path {} contains a NUL byte", path.display())))
}

/// A string argument as a C string.
pub(crate) fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::new(Status::InvalidArgument, format!("{what} {s:?} contains a NUL byte")))
}

/// A string owned by libpipe, copied. `ptr` must be NUL-terminated and valid for this call.
pub(crate) unsafe fn copy_cstr(ptr: *const std::os::raw::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned()
}
