//! Awaiting a [`Generation`]'s tokens without a thread: [`Generation::next_async`], a future per
//! token, woken by the generation's token callback (`pipe_generation_on_event`: libpipe calls it
//! whenever tokens arrive and once when the sequence finishes). Like the request futures of
//! completion.rs it uses only `std::task`, so any executor runs it, and one thread can await any
//! number of generations. Event loops that watch descriptors can use [`Generation::fd`] and
//! [`Generation::try_next`] instead.
//!
//! The waker is woken on the generator's thread (or on the thread that first polls), so an
//! executor must not poll the task inline from `wake`; none of the common ones does.

use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use pipe_sys as sys;

use crate::error::{check, Result};
use crate::generation::Generation;

/// What the token callback and the futures of one generation share: the waker of the pending
/// future. libpipe holds one reference (given as user_data), released after
/// pipe_generation_destroy, once the callback can no longer run.
#[derive(Default)]
pub(crate) struct Events {
    waker: Mutex<Option<Waker>>,
}

impl Events {
    fn lock(&self) -> MutexGuard<'_, Option<Waker>> {
        // Nothing panics while holding it and an Option is always consistent, so a poisoned lock
        // is still usable.
        self.waker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Called by libpipe whenever tokens of the generation arrive and once when it finishes, on the
/// generator's thread (or at once inside pipe_generation_on_event when something is pending). It
/// only wakes the task that waits, which then reads on its own thread. A panic here (from a
/// waker) aborts the process: it cannot unwind through an `extern "C"` function.
unsafe extern "C" fn on_event(
    user_data: *mut c_void,
    _generation: *mut sys::pipe_generation,
    _available: usize,
    _finished: i32,
) {
    // SAFETY: user_data is the reference arm() handed to libpipe, alive until release(), which
    // runs only after pipe_generation_destroy, once no call of this function runs or will.
    let events = unsafe { &*(user_data as *const Events) };
    let waker = events.lock().take();
    // Outside the lock: waking may run the executor's code.
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// Sets the token callback of `generation` (once: libpipe takes one per generation). `&mut`: two
/// first polls cannot race to set it.
fn arm(generation: &mut Generation) -> Result<Arc<Events>> {
    if let Some(events) = generation.handle().events.get() {
        return Ok(Arc::clone(events));
    }
    let events = Arc::new(Events::default());
    let user_data = Arc::into_raw(Arc::clone(&events)) as *mut c_void;
    // SAFETY: thread-safe. on_event matches pipe_generation_fn and only reads `user_data`, which
    // stays valid until release(). If something is pending, on_event runs here, on this thread,
    // which holds no lock of `events`.
    let code = unsafe { sys::pipe_generation_on_event(generation.as_ptr(), Some(on_event), user_data) };
    if let Err(e) = check(code) {
        // SAFETY: refused, so libpipe never calls on_event with user_data: its reference comes
        // back here, once.
        drop(unsafe { Arc::from_raw(user_data as *const Events) });
        return Err(e);
    }
    // Empty before (checked above, and only &mut Generation sets it), so this cannot fail.
    let _ = generation.handle().events.set(Arc::clone(&events));
    Ok(events)
}

/// Lets go of libpipe's reference to `events` (and of the generation's own).
///
/// # Safety
///
/// Only after pipe_generation_destroy of the generation whose callback was set with it.
pub(crate) unsafe fn release(events: Arc<Events>) {
    // SAFETY: the reference arm() handed to libpipe with Arc::into_raw, given back once.
    drop(unsafe { Arc::from_raw(Arc::as_ptr(&events)) });
}

impl Generation {
    /// The next item, as [`Iterator::next`] gives it, as a future: it completes once a token is
    /// there or the sequence ended (`None` after a stop id or its length; its error, then
    /// `None`, otherwise), and no thread waits meanwhile: libpipe wakes the task. Works with any
    /// executor. Dropping the future drops nothing else: the generation goes on.
    ///
    /// ```no_run
    /// # async fn f(generator: &pipe::Generator) -> pipe::Result<Vec<i64>> {
    /// let mut generation = generator.generate(&[1, 2, 3], &pipe::GenerationOptions::default())?;
    /// let mut tokens = Vec::new();
    /// while let Some(token) = generation.next_async().await {
    ///     tokens.push(token?);
    /// }
    /// # Ok(tokens)
    /// # }
    /// ```
    pub fn next_async(&mut self) -> NextToken<'_> {
        NextToken { generation: self }
    }
}

/// The future of [`Generation::next_async`].
#[must_use = "futures do nothing unless awaited"]
pub struct NextToken<'a> {
    generation: &'a mut Generation,
}

impl Future for NextToken<'_> {
    type Output = Option<Result<i64>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let generation = &mut *self.get_mut().generation;
        // Something already read, or the end: no callback needed.
        if let ready @ Poll::Ready(_) = generation.try_next() {
            return ready;
        }
        let events = match arm(generation) {
            Ok(events) => events,
            Err(e) => return Poll::Ready(Some(Err(e))),
        };
        // The waker goes in before the read: a token that arrives after the read found nothing
        // finds the waker (libpipe calls back for every arrival), one that arrives before is read.
        let stored = events.lock().replace(cx.waker().clone());
        drop(stored);
        let item = generation.try_next();
        if item.is_ready() {
            events.lock().take();
        }
        item
    }
}

impl Drop for NextToken<'_> {
    fn drop(&mut self) {
        // The generation may live on for long: take this future's waker out of it.
        if let Some(events) = self.generation.handle().events.get() {
            events.lock().take();
        }
    }
}
