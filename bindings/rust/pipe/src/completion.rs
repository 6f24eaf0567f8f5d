//! Waiting for a [`Request`] without parking a thread on it: futures built on
//! `pipe_request_on_done` (libpipe calls a function once the call has finished, and the future's
//! task is woken from there) and the request's pollable file descriptor (`pipe_request_fd`), for
//! event loops that watch descriptors themselves (mio, tokio's `AsyncFd`).
//!
//! The futures need no particular executor: they use only `std::task`. The waker is woken on a
//! libpipe thread (or on the thread that polls or drops), so an executor must not poll the task
//! inline from `wake` — none of the common ones does; they schedule it.

use std::ffi::c_void;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pipe_sys as sys;

use crate::error::{Error, Result};
use crate::list::TensorList;
use crate::session::Request;
use crate::tensor::Tensor;

/// What the completion callback and the futures of one request share. The callback holds one
/// reference (given to libpipe as user_data, taken back when libpipe calls it, exactly once) and
/// the request holds another, so it is freed by whichever lets go last: the callback returns
/// before pipe_request_destroy does, and that runs in the request's Drop.
#[derive(Default)]
pub(crate) struct Completion {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    finished: bool,
    /// The waker of each pending future of this request, by the future's slot number. A future
    /// removes its own when it completes or is dropped; an owned [`RequestFuture`] leaves it to
    /// be freed with the state, which goes when the request does.
    wakers: Vec<(u64, Waker)>,
}

impl Completion {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing here can panic while holding the lock, and the state stays consistent anyway
        // (a flag and a list), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, slot: u64) {
        self.lock().wakers.retain(|(s, _)| *s != slot);
    }
}

/// The request's side: its callback, set at the first poll of one of its futures (libpipe takes
/// one callback per request, so it is set once and shared by every future), and what setting it
/// gave.
#[derive(Default)]
pub(crate) struct DoneCallback(OnceLock<Result<Arc<Completion>>>);

/// Numbers each future's waker slot; never reused within the process.
static NEXT_SLOT: AtomicU64 = AtomicU64::new(1);

/// Called by libpipe exactly once per request whose callback was set: when its call finished, on
/// a libpipe thread, or at once on the thread that set it if the call had already finished, or
/// at the latest inside pipe_request_destroy. It only records the fact and wakes the futures'
/// tasks; they collect the result with pipe_request_wait(0) on their own thread (the callback
/// must not call libpipe). A panic here (from a waker) aborts the process: it cannot unwind
/// through an `extern "C"` function.
unsafe extern "C" fn on_done(user_data: *mut c_void, _request: *mut sys::pipe_request, _status: sys::pipe_status) {
    // SAFETY: user_data is the reference that arm() leaked for libpipe; libpipe calls this once,
    // so it is taken back (and released at the end of this function) exactly once.
    let completion = unsafe { Arc::from_raw(user_data as *const Completion) };
    let wakers: Vec<Waker> = {
        let mut state = completion.lock();
        state.finished = true;
        state.wakers.iter().map(|(_, w)| w.clone()).collect()
    };
    // Outside the lock: a waker may run the executor's code, which may poll a future of this
    // request on this thread.
    for waker in wakers {
        waker.wake();
    }
}

/// Sets the completion callback of `request`.
fn arm(request: &Request) -> Result<Arc<Completion>> {
    let completion = Arc::new(Completion::default());
    let user_data = Arc::into_raw(Arc::clone(&completion)) as *mut c_void;
    // SAFETY: thread-safe. on_done matches pipe_request_done_fn and only touches `user_data`,
    // which stays valid until on_done takes it back. If the call has finished, on_done runs
    // here, on this thread, which holds no lock of `completion`.
    let code = unsafe { sys::pipe_request_on_done(request.as_ptr(), Some(on_done), user_data) };
    if code != sys::PIPE_OK {
        let error = Error::last(code);
        // SAFETY: refused, so libpipe will never call on_done with user_data: its reference
        // comes back here, once.
        drop(unsafe { Arc::from_raw(user_data as *const Completion) });
        return Err(error);
    }
    Ok(completion)
}

impl Request {
    fn completion(&self) -> Result<&Arc<Completion>> {
        self.done.0.get_or_init(|| arm(self)).as_ref().map_err(Clone::clone)
    }

    /// The call's result once it has finished, `Pending` (with `cx`'s waker stored in `slot`)
    /// before. Shared by every future of this module.
    fn poll_done(&self, slot: &mut Option<u64>, cx: &mut Context<'_>) -> Poll<Result<TensorList>> {
        let completion = match self.completion() {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        {
            let mut state = completion.lock();
            if !state.finished {
                let id = *slot.get_or_insert_with(|| NEXT_SLOT.fetch_add(1, Ordering::Relaxed));
                match state.wakers.iter_mut().find(|(s, _)| *s == id) {
                    Some((_, stored)) => stored.clone_from(cx.waker()),
                    None => state.wakers.push((id, cx.waker().clone())),
                }
                return Poll::Pending;
            }
            if let Some(id) = slot.take() {
                state.wakers.retain(|(s, _)| *s != id);
            }
        }
        // Finished, so this returns at once (it may wait for the turn of a blocking wait on
        // another thread, which returns at once too now).
        Poll::Ready(self.wait_list(Some(Duration::ZERO)))
    }

    fn forget_slot(&self, slot: Option<u64>) {
        if let (Some(id), Some(Ok(completion))) = (slot, self.done.0.get()) {
            completion.forget(id);
        }
    }

    /// [`Request::wait`] as a future: it completes with the same result once the call has
    /// finished (succeeded, failed, was cancelled or passed its deadline, which fires by itself),
    /// and no thread waits meanwhile: libpipe wakes the task. Works with any executor.
    ///
    /// Dropping the future leaves the call running (wait again, [`Request::cancel`], or drop the
    /// request); to cancel by dropping, await the request itself, which it then owns
    /// (`session.submit(&inputs)?.await`, see [`RequestFuture`]). Many futures of one request,
    /// on any threads, all complete.
    ///
    /// ```no_run
    /// # async fn f(session: &pipe::Session, x: pipe::Tensor) -> pipe::Result<()> {
    /// let request = session.submit(&[x])?;
    /// let outputs = request.wait_async().await?; // Vec<(String, Tensor)>
    /// # Ok(())
    /// # }
    /// ```
    pub fn wait_async(&self) -> WaitFuture<'_> {
        WaitFuture { inner: self.wait_list_async() }
    }

    /// [`Request::wait_async`], giving libpipe's own output list (no copy), as
    /// [`Request::wait_list`] does.
    pub fn wait_list_async(&self) -> WaitListFuture<'_> {
        WaitListFuture { request: self, slot: None }
    }
}

/// The future of [`Request::wait_list_async`].
#[must_use = "futures do nothing unless awaited"]
pub struct WaitListFuture<'a> {
    request: &'a Request,
    slot: Option<u64>,
}

impl Future for WaitListFuture<'_> {
    type Output = Result<TensorList>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.request.poll_done(&mut this.slot, cx)
    }
}

impl Drop for WaitListFuture<'_> {
    fn drop(&mut self) {
        // The request may live on for long: take this future's waker out of it.
        self.request.forget_slot(self.slot.take());
    }
}

/// The future of [`Request::wait_async`].
#[must_use = "futures do nothing unless awaited"]
pub struct WaitFuture<'a> {
    inner: WaitListFuture<'a>,
}

impl Future for WaitFuture<'_> {
    type Output = Result<Vec<(String, Tensor)>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.get_mut().inner).poll(cx).map(|list| list?.to_tensors())
    }
}

/// A [`Request`] awaited by value (`session.submit(&inputs)?.await`): the future owns the
/// request, so dropping it before it completes drops the request, which cancels the call. It
/// completes as [`Request::wait`] would return.
#[must_use = "futures do nothing unless awaited"]
pub struct RequestFuture {
    request: Request,
    slot: Option<u64>,
}

impl RequestFuture {
    /// The request, e.g. to [`Request::cancel`] it (the future then completes with
    /// [`crate::Status::Cancelled`]).
    pub fn request(&self) -> &Request {
        &self.request
    }
}

impl Future for RequestFuture {
    type Output = Result<Vec<(String, Tensor)>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.request.poll_done(&mut this.slot, cx).map(|list| list?.to_tensors())
    }
}

// No Drop: the stored waker is freed with the request's shared state, as the request goes
// (pipe_request_destroy runs the callback, which lets go of its reference, then the request
// lets go of its own).

impl IntoFuture for Request {
    type Output = Result<Vec<(String, Tensor)>>;
    type IntoFuture = RequestFuture;

    fn into_future(self) -> RequestFuture {
        RequestFuture { request: self, slot: None }
    }
}

#[cfg(unix)]
mod fd {
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

    use pipe_sys as sys;

    use crate::error::{check, Error, Result, Status};
    use crate::session::Request;

    impl Request {
        /// A file descriptor that becomes readable when the call finishes and stays readable
        /// (level-triggered), for poll, epoll or an event loop (mio's `SourceFd`, tokio's
        /// `AsyncFd`); then collect the result with `wait(Some(Duration::ZERO))`. It belongs to
        /// the request: do not read, write or close it; it is the same on every call, and
        /// closed when the request is dropped. [`crate::Status::Io`] if the process has no
        /// descriptor left.
        pub fn fd(&self) -> Result<BorrowedFd<'_>> {
            let mut fd: i32 = -1;
            // SAFETY: thread-safe; writes the descriptor.
            check(unsafe { sys::pipe_request_fd(self.as_ptr(), &mut fd) })?;
            if fd < 0 {
                return Err(Error::new(Status::Internal, format!("libpipe returned file descriptor {fd}")));
            }
            // SAFETY: open until pipe_request_destroy, which runs in Drop, after every borrow
            // of the request (so of this descriptor) has ended.
            Ok(unsafe { BorrowedFd::borrow_raw(fd) })
        }
    }

    /// [`Request::fd`].
    ///
    /// # Panics
    ///
    /// If libpipe cannot make the descriptor (the process has none left); call
    /// [`Request::fd`] to get that as an error.
    impl AsFd for Request {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.fd().unwrap_or_else(|e| panic!("pipe::Request has no file descriptor: {e}"))
        }
    }

    /// [`Request::fd`], e.g. for `tokio::io::unix::AsyncFd::new(request)`.
    ///
    /// # Panics
    ///
    /// As [`AsFd::as_fd`].
    impl AsRawFd for Request {
        fn as_raw_fd(&self) -> RawFd {
            self.as_fd().as_raw_fd()
        }
    }
}
