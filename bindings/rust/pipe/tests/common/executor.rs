//! A tiny single-threaded executor for the tests of the request futures, so that they need no
//! async runtime: it polls futures on the calling thread and parks that thread until a waker
//! fires. A waker counts its wakes, so a test can tell whether (and how often) libpipe woke it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::Instant;

use super::gate::WAIT_LIMIT;

/// Wakes the thread that made it, and counts its wakes.
pub struct Signal {
    thread: Thread,
    notified: AtomicBool,
    wakes: AtomicUsize,
}

impl Signal {
    pub fn new() -> Arc<Signal> {
        Arc::new(Signal { thread: thread::current(), notified: AtomicBool::new(false), wakes: AtomicUsize::new(0) })
    }

    /// How many times a waker of this signal has been woken.
    pub fn wakes(&self) -> usize {
        self.wakes.load(Ordering::SeqCst)
    }

    /// Parks until a wake since the last call (returns at once if there was one); panics after
    /// WAIT_LIMIT, which only ends a hung test.
    fn wait(&self, give_up: Instant) {
        while !self.notified.swap(false, Ordering::SeqCst) {
            let now = Instant::now();
            assert!(now < give_up, "no future was woken within {WAIT_LIMIT:?}");
            thread::park_timeout(give_up - now);
        }
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.notified.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// Polls `future` once with `signal`'s waker.
pub fn poll_once<F: Future + Unpin>(future: &mut F, signal: &Arc<Signal>) -> Poll<F::Output> {
    let waker = Waker::from(Arc::clone(signal));
    Pin::new(future).poll(&mut Context::from_waker(&waker))
}

/// Runs `future` to completion on this thread.
pub fn block_on<F: Future>(future: F) -> F::Output {
    join_all(vec![future]).pop().unwrap()
}

/// Runs every future to completion on this thread, all at once (each is polled again after any
/// wake), and returns their outputs in order. Panics if no future is woken for WAIT_LIMIT.
pub fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let signal = Signal::new();
    let waker = Waker::from(Arc::clone(&signal));
    let mut cx = Context::from_waker(&waker);
    let mut pending: Vec<Option<Pin<Box<F>>>> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut outputs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    let give_up = Instant::now() + WAIT_LIMIT;
    loop {
        for (slot, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if let Some(future) = slot {
                if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                    *output = Some(out);
                    *slot = None;
                }
            }
        }
        if pending.iter().all(Option::is_none) {
            return outputs.into_iter().map(Option::unwrap).collect();
        }
        signal.wait(give_up);
    }
}
