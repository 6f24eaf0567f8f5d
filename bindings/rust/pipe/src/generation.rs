//! One sequence being generated ([`crate::Generator::generate`]): its tokens as an iterator that
//! blocks in poll(2) on the generation's file descriptor (no thread per generation), without
//! blocking ([`Generation::try_next`]), or as futures (generation_async.rs); cancel, progress and
//! how it ended.

use std::collections::VecDeque;
use std::iter::FusedIterator;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::generation_async::Events;
use crate::session::duration_ms;

/// Tokens read from libpipe at once; more wait for the next read.
const READ_CHUNK: usize = 256;

/// How a sequence ended (pipe.h's PIPE_FINISH_*).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop id was generated (it is the last token).
    Stop,
    /// `max_new_tokens` were generated, or the decoder's maximum length is full.
    Length,
    /// [`Generation::cancel`], dropping the generation while it went on, or dropping the
    /// generator.
    Cancelled,
    /// Its [`crate::GenerationOptions::timeout`] passed.
    Deadline,
    /// A step it was in failed; the iterator's last item, or [`Generation::wait`], gives the error.
    Error,
}

impl FinishReason {
    /// None for PIPE_FINISH_NONE (still queued or generating).
    fn from_raw(raw: i32) -> Result<Option<FinishReason>> {
        Ok(Some(match raw {
            sys::PIPE_FINISH_NONE => return Ok(None),
            sys::PIPE_FINISH_STOP => FinishReason::Stop,
            sys::PIPE_FINISH_LENGTH => FinishReason::Length,
            sys::PIPE_FINISH_CANCELLED => FinishReason::Cancelled,
            sys::PIPE_FINISH_DEADLINE => FinishReason::Deadline,
            sys::PIPE_FINISH_ERROR => FinishReason::Error,
            other => {
                return Err(Error::new(Status::Internal, format!("libpipe reported an unknown finish reason {other}")))
            }
        }))
    }
}

/// One sequence's progress ([`Generation::info`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationInfo {
    /// None while the sequence is queued or generating.
    pub finish_reason: Option<FinishReason>,
    /// The prompt's length.
    pub prompt_tokens: usize,
    /// Tokens generated so far, read or not.
    pub generated_tokens: usize,
    /// From [`crate::Generator::generate`] to getting a cache slot; None while queued.
    pub queued_ms: Option<f64>,
    /// From [`crate::Generator::generate`] to the first token; None before it.
    pub time_to_first_token_ms: Option<f64>,
    /// Mean time between tokens after the first; None before the second.
    pub mean_inter_token_ms: Option<f64>,
    /// Prompt tokens found in the cache slot the sequence got, left there by an earlier sequence
    /// that began the same way, and not computed again (prefix reuse).
    pub cached_tokens: usize,
}

/// A generated (or prompt) token's log-probability under the model's distribution at its position
/// (the log-softmax of the logits, before temperature, top-k and top-p: what the model said,
/// whatever the sampler then chose), and the likeliest tokens there, most likely first
/// ([`crate::GenerationOptions::top_logprobs`] of them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<TokenLogprob>,
}

/// One of the likeliest tokens at a position and its log-probability.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenLogprob {
    pub id: i64,
    pub logprob: f32,
}

/// One sequence being generated: an [`Iterator`] of its tokens (`Result<i64>`), each as soon as it
/// has been sampled. The iterator blocks in poll(2) on the generation's file descriptor while no
/// token is there, so no thread is held per generation; [`Generation::next_async`] waits without
/// blocking, [`Generation::try_next`] never waits.
///
/// The iteration ends with `None` once the sequence finished by a stop id or its length; one that
/// was cancelled, passed its deadline or failed gives its tokens, then that error
/// ([`Status::Cancelled`], [`Status::DeadlineExceeded`], [`Status::Execution`] naming the
/// stage, ...) as its last item, then `None`.
///
/// Reading needs `&mut`; to cancel from another thread or task while one reads, take a
/// [`CancelHandle`] first ([`Generation::cancel_handle`]). Dropping a generation that goes on
/// cancels it (its cache slot is freed). It may outlive its generator.
pub struct Generation {
    handle: Arc<Handle>,
    /// Read from libpipe, not yet returned.
    pending: VecDeque<i64>,
    /// libpipe said the sequence finished and every token was read.
    finished: bool,
    /// The end (`None`, or the error) has been returned: the iterator is fused.
    done: bool,
    /// With [`crate::GenerationOptions::logprobs`]: the alternatives asked for per token, and a
    /// [`TokenLogprobs`] per token read from libpipe (collected as they are read).
    logprobs: Option<(usize, Vec<TokenLogprobs>)>,
    /// With [`crate::GenerationOptions::prompt_logprobs`]: the prompt's scores, read with the
    /// first token (or the end).
    prompt_logprobs: Option<PromptLogprobs>,
}

/// What a generation that scores its prompt keeps.
struct PromptLogprobs {
    top: usize,
    prompt_len: usize,
    /// Empty until read; then None for position 0 and an entry per position after it.
    scored: Vec<Option<TokenLogprobs>>,
}

/// libpipe's generation, owned by the [`Generation`] and its [`CancelHandle`]s together: destroyed
/// when the last of them goes.
pub(crate) struct Handle {
    ptr: NonNull<sys::pipe_generation>,
    /// The token callback's state, once a future of this generation has set the callback.
    pub(crate) events: OnceLock<Arc<Events>>,
}

// SAFETY: pipe.h marks pipe_generation_cancel, get_info, wait, fd and on_event thread-safe, which
// are all that is called through a shared Handle; pipe_generation_read is exclusive and is
// called only from &mut Generation methods, and only a Generation reads (a CancelHandle only
// cancels); pipe_generation_destroy is exclusive and runs in Drop of the last owner. Nothing ties a
// generation to the thread that submitted it. The callback's state is Send + Sync.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    fn cancel(&self) -> Result<()> {
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_generation_cancel(self.ptr.as_ptr()) })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: exclusive (the last owner); a sequence still going is cancelled. Once this
        // returns the token callback has returned and is never called again, so libpipe's
        // reference to its state can be let go of.
        unsafe { sys::pipe_generation_destroy(self.ptr.as_ptr()) }
        if let Some(events) = self.events.take() {
            // SAFETY: the callback, which held the reference handed to libpipe, is gone.
            unsafe { crate::generation_async::release(events) };
        }
    }
}

/// Cancels a [`Generation`] from anywhere while the generation itself is being read (which needs
/// `&mut`), e.g. from another thread while one iterates, or from a task while another awaits
/// [`Generation::next_async`]. Cheap to clone; keeps libpipe's generation (not the sequence: it
/// ends as usual) alive while it exists.
#[derive(Clone)]
pub struct CancelHandle {
    handle: Arc<Handle>,
}

impl CancelHandle {
    /// [`Generation::cancel`].
    pub fn cancel(&self) -> Result<()> {
        self.handle.cancel()
    }
}

/// What one read found.
enum Read {
    /// Tokens were added to `pending` (the sequence may have finished too).
    Tokens,
    /// Nothing new and the sequence goes on.
    Nothing,
    /// Every token was read and the sequence finished.
    Finished,
}

impl Generation {
    /// # Safety
    ///
    /// `ptr` is a generation libpipe made and nothing else owns.
    pub(crate) unsafe fn from_raw(ptr: NonNull<sys::pipe_generation>) -> Generation {
        let handle = Arc::new(Handle { ptr, events: OnceLock::new() });
        Generation {
            handle,
            pending: VecDeque::new(),
            finished: false,
            done: false,
            logprobs: None,
            prompt_logprobs: None,
        }
    }

    /// Collect each token's log-probabilities, with `top` alternatives, as the tokens are read.
    pub(crate) fn keeping_logprobs(mut self, top: usize) -> Generation {
        self.logprobs = Some((top, Vec::new()));
        self
    }

    /// Read the prompt's scores (a prompt of `prompt_len` tokens, `top` alternatives each) with the
    /// first token.
    pub(crate) fn keeping_prompt_logprobs(mut self, top: usize, prompt_len: usize) -> Generation {
        self.prompt_logprobs = Some(PromptLogprobs { top, prompt_len, scored: Vec::new() });
        self
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::pipe_generation {
        self.handle.ptr.as_ptr()
    }

    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// A handle that cancels this generation while it is being read elsewhere.
    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle { handle: Arc::clone(&self.handle) }
    }

    /// Stop the sequence: it finishes with [`Status::Cancelled`] (at once, or when its step in the
    /// pipeline returns; a token of that step is dropped) and frees its cache slot. The tokens
    /// generated before stay readable; a finished sequence is left as it is.
    pub fn cancel(&self) -> Result<()> {
        self.handle.cancel()
    }

    /// The sequence's progress and, once it finished, how it ended.
    pub fn info(&self) -> Result<GenerationInfo> {
        let mut raw = crate::defaults::generation_info()?;
        // SAFETY: thread-safe; fills the fields struct_size covers.
        check(unsafe { sys::pipe_generation_get_info(self.as_ptr(), &mut raw) })?;
        // libpipe's -1 means "not yet".
        let ms = |v: f64| (v >= 0.0).then_some(v);
        Ok(GenerationInfo {
            finish_reason: FinishReason::from_raw(raw.finish_reason)?,
            prompt_tokens: usize::try_from(raw.prompt_tokens).unwrap_or(0),
            generated_tokens: usize::try_from(raw.generated_tokens).unwrap_or(0),
            queued_ms: ms(raw.queued_ms),
            time_to_first_token_ms: ms(raw.time_to_first_token_ms),
            mean_inter_token_ms: ms(raw.mean_inter_token_ms),
            cached_tokens: usize::try_from(raw.cached_tokens).unwrap_or(0),
        })
    }

    /// The log-probabilities of the tokens read so far, in order: entry i is the i-th token of the
    /// sequence. Every token the iterator (or [`Generation::try_next`], or the futures) returned has
    /// its entry; a few more may be there, of tokens read from libpipe but not returned yet. Once
    /// the iteration ended there is one per token. [`Status::InvalidArgument`] when the generation
    /// was not asked for them ([`crate::GenerationOptions::logprobs`]).
    pub fn logprobs(&self) -> Result<&[TokenLogprobs]> {
        match &self.logprobs {
            Some((_, lps)) => Ok(lps),
            None => Err(Error::new(
                Status::InvalidArgument,
                "this generation keeps no log-probabilities; generate it with GenerationOptions::logprobs",
            )),
        }
    }

    /// The prompt's scores, indexed by prompt position: `None` for position 0, which nothing
    /// precedes (OpenAI's echo gives null there), then each prompt token's log-probability given
    /// the tokens before it and the likeliest tokens there. Empty until the first token was read
    /// (every position is scored by then: once the iterator, [`Generation::try_next`] or the
    /// futures returned a token or the end, it is there); shorter than the prompt when the
    /// generation failed before its prompt was scored. [`Status::InvalidArgument`] when the
    /// generation was not asked for them ([`crate::GenerationOptions::prompt_logprobs`]).
    pub fn prompt_logprobs(&self) -> Result<&[Option<TokenLogprobs>]> {
        match &self.prompt_logprobs {
            Some(p) => Ok(&p.scored),
            None => Err(Error::new(
                Status::InvalidArgument,
                "this generation did not score its prompt; generate it with GenerationOptions::prompt_logprobs",
            )),
        }
    }

    /// How the sequence ended; None while it is queued or generating.
    pub fn finish_reason(&self) -> Result<Option<FinishReason>> {
        Ok(self.info()?.finish_reason)
    }

    /// Wait until the sequence finished, read or not: `None` as long as it takes,
    /// `Some(Duration::ZERO)` only checks. [`Status::Timeout`] while it goes on; otherwise its
    /// result: `Ok` when it ended by a stop id or its length, else its error. Its tokens stay
    /// readable. Blocks this thread (the iterator and [`Generation::next_async`] do not need it).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let timeout_ms = timeout.map_or(-1, duration_ms);
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_generation_wait(self.as_ptr(), timeout_ms) })
    }

    /// The next item without waiting: `Ready(Some(Ok(token)))`, `Ready(Some(Err(e)))` (the
    /// sequence ended with an error; the last item), `Ready(None)` (the end), or `Pending` when
    /// no token is there yet (wait for [`Generation::fd`] to become readable, or use the iterator
    /// or [`Generation::next_async`], which do).
    pub fn try_next(&mut self) -> Poll<Option<Result<i64>>> {
        loop {
            if let Some(token) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(token)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            if self.finished {
                self.done = true;
                return Poll::Ready(self.outcome().err().map(Err));
            }
            match self.read() {
                Ok(Read::Tokens) | Ok(Read::Finished) => continue,
                Ok(Read::Nothing) => return Poll::Pending,
                Err(e) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    /// Reads what libpipe has into `pending`.
    fn read(&mut self) -> Result<Read> {
        let mut chunk = [0i64; READ_CHUNK];
        let mut count = 0usize;
        let mut finished = 0i32;
        // SAFETY: exclusive, which &mut self ensures; `chunk` holds READ_CHUNK tokens.
        check(unsafe {
            sys::pipe_generation_read(self.as_ptr(), chunk.as_mut_ptr(), READ_CHUNK, &mut count, &mut finished)
        })?;
        let count = count.min(READ_CHUNK);
        if let Some(p) = &mut self.prompt_logprobs {
            if p.scored.is_empty() && (count > 0 || finished != 0) {
                // Every position is scored before the first token is published (or the end told);
                // libpipe refuses a position only of a generation that failed before scoring it.
                p.scored.push(None);
                for position in 1..p.prompt_len {
                    match logprobs_of(self.handle.ptr, position, p.top, true) {
                        Ok(lp) => p.scored.push(Some(lp)),
                        Err(e) if e.status == Status::InvalidArgument => break,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        if let Some((top, lps)) = &mut self.logprobs {
            for _ in 0..count {
                lps.push(logprobs_of(self.handle.ptr, lps.len(), *top, false)?);
            }
        }
        self.pending.extend(&chunk[..count]);
        self.finished = finished != 0;
        Ok(if count > 0 {
            Read::Tokens
        } else if self.finished {
            Read::Finished
        } else {
            Read::Nothing
        })
    }

    /// The finished sequence's status.
    fn outcome(&self) -> Result<()> {
        self.wait(Some(Duration::ZERO))
    }
}

/// Token `index`'s log-probability and its `top` (at most 20) likeliest alternatives; with
/// `prompt`, those of the prompt's token at position `index`.
fn logprobs_of(ptr: NonNull<sys::pipe_generation>, index: usize, top: usize, prompt: bool) -> Result<TokenLogprobs> {
    let mut ids = [0i64; crate::GenerationOptions::MAX_TOP_LOGPROBS];
    let mut lps = [0f32; crate::GenerationOptions::MAX_TOP_LOGPROBS];
    let capacity = top.min(ids.len());
    let mut logprob = 0f32;
    let mut count = 0usize;
    let read = if prompt { sys::pipe_generation_prompt_logprobs } else { sys::pipe_generation_logprobs };
    // SAFETY: both thread-safe; `ids` and `lps` hold `capacity` entries each.
    check(unsafe {
        read(ptr.as_ptr(), index, &mut logprob, ids.as_mut_ptr(), lps.as_mut_ptr(), capacity, &mut count)
    })?;
    let count = count.min(capacity);
    let top = ids[..count].iter().zip(&lps[..count]).map(|(&id, &logprob)| TokenLogprob { id, logprob }).collect();
    Ok(TokenLogprobs { logprob, top })
}

impl Iterator for Generation {
    type Item = Result<i64>;

    /// The next token, waiting for it in poll(2) on the generation's descriptor; see
    /// [`Generation`] for how the iteration ends.
    fn next(&mut self) -> Option<Result<i64>> {
        loop {
            if let Poll::Ready(item) = self.try_next() {
                return item;
            }
            if let Err(e) = self.wait_readable() {
                self.done = true;
                return Some(Err(e));
            }
        }
    }
}

impl FusedIterator for Generation {}

impl Drop for Generation {
    fn drop(&mut self) {
        // Cancel a sequence that goes on even when a CancelHandle keeps libpipe's generation
        // alive; the last owner destroys it. A finished sequence is left as it is, and a failure
        // here has nobody to go to.
        let _ = self.handle.cancel();
    }
}

#[cfg(unix)]
mod fd {
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

    use pipe_sys as sys;

    use super::Generation;
    use crate::error::{check, Error, Result, Status};

    impl Generation {
        /// A file descriptor that is readable (level-triggered) while unread tokens exist or
        /// once the sequence finished; reading every token of a sequence that goes on
        /// ([`Generation::try_next`] until `Pending`) clears it. For poll, epoll or an event loop
        /// (mio's `SourceFd`, tokio's `AsyncFd`). It belongs to the generation: do not read, write
        /// or close it; it is closed when the generation is dropped. [`Status::Io`] if the
        /// process has no descriptor left.
        pub fn fd(&self) -> Result<BorrowedFd<'_>> {
            let mut fd: i32 = -1;
            // SAFETY: thread-safe; writes the descriptor.
            check(unsafe { sys::pipe_generation_fd(self.as_ptr(), &mut fd) })?;
            if fd < 0 {
                return Err(Error::new(Status::Internal, format!("libpipe returned file descriptor {fd}")));
            }
            // SAFETY: open until pipe_generation_destroy, which runs in Drop, after every borrow
            // of the generation (so of this descriptor) has ended.
            Ok(unsafe { BorrowedFd::borrow_raw(fd) })
        }

        /// Blocks until the descriptor is readable.
        pub(super) fn wait_readable(&self) -> Result<()> {
            let fd = self.fd()?;
            let mut pollfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            loop {
                // SAFETY: one valid pollfd; -1 waits as long as it takes (a generation always
                // finishes: by its length, a deadline, cancel, or its generator being dropped).
                let n = unsafe { libc::poll(&mut pollfd, 1, -1) };
                if n > 0 {
                    return Ok(());
                }
                let e = std::io::Error::last_os_error();
                if n < 0 && e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::new(Status::Io, format!("poll on the generation's descriptor failed: {e}")));
                }
            }
        }
    }

    /// [`Generation::fd`].
    ///
    /// # Panics
    ///
    /// If libpipe cannot make the descriptor (the process has none left); call
    /// [`Generation::fd`] to get that as an error.
    impl AsFd for Generation {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.fd().unwrap_or_else(|e| panic!("pipe::Generation has no file descriptor: {e}"))
        }
    }

    /// [`Generation::fd`], e.g. for `tokio::io::unix::AsyncFd::new(generation)`.
    ///
    /// # Panics
    ///
    /// As [`AsFd::as_fd`].
    impl AsRawFd for Generation {
        fn as_raw_fd(&self) -> RawFd {
            self.as_fd().as_raw_fd()
        }
    }
}
