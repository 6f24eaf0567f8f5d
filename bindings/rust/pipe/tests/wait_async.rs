//! Waiting for calls without a thread: request futures (pipe_request_on_done) and the request's
//! file descriptor (pipe_request_fd). Each call that must still be running is held at stage 0's
//! gate (common/gate.rs), so every verdict follows from a state the test has seen; the futures
//! run on the test thread with the tiny executor of common/executor.rs.
mod common;

use std::future::IntoFuture;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use common::executor::{block_on, join_all, poll_once, Signal};
use common::gate::{wait_until, Key, ARRIVED, WAIT_LIMIT};
use common::*;
use pipe::{RequestFuture, RunOptions, SessionOptions, Status, WaitFuture, WaitListFuture};

fn session() -> pipe::Session {
    gated_session(SessionOptions::new().microbatches(2))
}

#[test]
fn wait_async_on_a_finished_call() {
    let session = session();
    let request = session.submit(&gated_inputs(0)).unwrap();
    let blocking = request.wait(None).unwrap();
    check_gated_output("wait", blocking.clone());

    // Already finished: libpipe calls the callback at once, inside the first poll, so the
    // future is ready then, without a wake.
    let signal = Signal::new();
    let mut future = request.wait_async();
    match poll_once(&mut future, &signal) {
        Poll::Ready(outputs) => assert_eq!(outputs.unwrap(), blocking),
        Poll::Pending => panic!("the future of a finished call is pending"),
    }
    assert_eq!(signal.wakes(), 0);
    // The callback is set once per request; later futures share it.
    assert_eq!(block_on(request.wait_async()).unwrap(), blocking);
    let list = block_on(request.wait_list_async()).unwrap();
    assert_eq!(list.to_tensors().unwrap(), blocking);
}

#[test]
fn wait_async_on_a_held_call() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);

    let signal = Signal::new();
    let mut first = request.wait_async();
    let mut second = request.wait_async();
    assert!(poll_once(&mut first, &signal).is_pending());
    assert!(poll_once(&mut second, &signal).is_pending());
    assert_eq!(signal.wakes(), 0, "woken while the call is held");

    key.open();
    // Both futures of the one request complete, each woken by the one callback.
    for outputs in join_all(vec![first, second]) {
        check_gated_output("a held call awaited", outputs.unwrap());
    }
    // A later future of the finished call gives the result again.
    check_gated_output("awaited again", block_on(request.wait_async()).unwrap());
}

#[test]
fn awaiting_a_request_by_value() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let signal = Signal::new();
    let mut future = request.into_future();
    assert!(poll_once(&mut future, &signal).is_pending());
    key.open();
    check_gated_output("a request awaited by value", block_on(future).unwrap());
}

#[test]
fn cancel_completes_a_pending_future_with_cancelled() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let signal = Signal::new();
    let mut future = request.wait_async();
    assert!(poll_once(&mut future, &signal).is_pending());

    request.cancel().unwrap();
    // The gate stays shut: the cancel alone completes the call, and wakes the future.
    wait_until(|| signal.wakes() > 0, || "the cancelled call did not wake its future".into());
    let e = block_on(future).unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
    assert_eq!(block_on(request.wait_async()).unwrap_err().status, Status::Cancelled);
}

#[test]
fn dropping_a_pending_future_leaves_the_call_running() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let signal = Signal::new();
    let mut future = request.wait_async();
    assert!(poll_once(&mut future, &signal).is_pending());
    assert_eq!(Arc::strong_count(&signal), 2, "the pending future's waker is stored");
    drop(future);
    // The request keeps no waker of a dropped future, and the call goes on.
    assert_eq!(Arc::strong_count(&signal), 1);
    assert_eq!(request.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Timeout);

    request.cancel().unwrap();
    assert_eq!(block_on(request.wait_async()).unwrap_err().status, Status::Cancelled);
    assert_eq!(signal.wakes(), 0, "a dropped future was woken");
}

/// A request awaited by value and dropped while pending: the drop cancels the call, libpipe runs
/// the callback inside pipe_request_destroy (one wake), and the state the callback shared with
/// the request is freed, with the waker it stored (else the waker, and the task behind it in a
/// real executor, would leak). A double free would release the waker twice, which the count
/// shows too.
#[test]
fn dropping_a_pending_request_future_cancels_the_call_and_frees_its_state() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let signal = Signal::new();
    let mut future = request.into_future();
    assert!(poll_once(&mut future, &signal).is_pending());
    assert_eq!(Arc::strong_count(&signal), 2);

    drop(future);
    assert_eq!(signal.wakes(), 1, "the callback runs once, inside the drop");
    assert_eq!(Arc::strong_count(&signal), 1, "the shared state (holding the waker) was not freed once");

    // Cancelled: the held micro-batch goes no further once the gate opens. The next call's
    // micro-batch comes after it through both stages, so then the counts are final.
    key.open();
    check_gated_output("after a dropped request future", session.run(&gated_inputs(0)).unwrap());
    assert_eq!(key.count("stage1", ARRIVED), 0);
}

/// The other ways a request with its callback set goes: its call had finished before the
/// callback was set (libpipe calls it at once, on the polling thread), or it is dropped with the
/// callback set and its future gone. No waker is stored in either case, so whether the state is
/// freed cannot be seen from here; this checks that these paths run without a crash or a stray
/// wake (a double free would likely crash the test binary).
#[test]
fn dropping_requests_with_their_callback_set() {
    let session = session();
    let signal = Signal::new();

    let finished = session.submit(&gated_inputs(0)).unwrap();
    finished.wait(None).unwrap();
    let mut future = finished.into_future();
    assert!(poll_once(&mut future, &signal).is_ready());
    drop(future);
    assert_eq!(Arc::strong_count(&signal), 1);

    let key = Key::new();
    let held = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let mut future = held.wait_async();
    assert!(poll_once(&mut future, &signal).is_pending());
    drop(future);
    drop(held); // cancels; the callback runs in here and wakes nobody
    assert_eq!(signal.wakes(), 0);
    assert_eq!(Arc::strong_count(&signal), 1);
}

/// The deadline fires by itself: the held call completes, and wakes its future, although nobody
/// waits in libpipe and the gate stays shut until the result is in.
#[test]
fn a_deadline_completes_a_held_call_without_the_gate() {
    let session = session();
    let key = Key::new();
    let timeout = Duration::from_millis(10);
    let request = session.submit_with(&gated_inputs(key.value()), &RunOptions::with_timeout(timeout)).unwrap();
    let signal = Signal::new();
    let mut future = request.wait_async();
    // Pending unless the deadline has already passed (it counts from inside submit_with).
    if poll_once(&mut future, &signal).is_pending() {
        assert_eq!(signal.wakes(), 0);
    }
    let e = block_on(future).unwrap_err();
    assert_eq!(e.status, Status::DeadlineExceeded, "{e}");
    assert_eq!(key.count("stage0", "left"), 0, "the gate was passed");
}

/// The descriptor: not readable while the call is held, readable (and staying so) once it has
/// finished, after which a zero-timeout wait collects the result.
#[test]
fn the_fd_becomes_readable_when_the_call_finishes() {
    let session = session();
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);

    let fd = request.as_raw_fd();
    assert!(fd >= 0);
    assert_eq!(request.fd().unwrap().as_raw_fd(), fd, "the same descriptor on every call");
    assert_eq!(request.as_fd().as_raw_fd(), fd);
    assert_eq!(poll_readable(fd, Duration::ZERO), 0, "readable while the call is held");

    key.open();
    assert_eq!(poll_readable(fd, WAIT_LIMIT), 1, "not readable within {WAIT_LIMIT:?} of opening the gate");
    assert_eq!(poll_readable(fd, Duration::ZERO), 1, "level-triggered: still readable");
    check_gated_output("collected after the fd", request.wait(Some(Duration::ZERO)).unwrap());
}

/// poll(2) for POLLIN on `fd`: 1 if readable within `timeout`, 0 if not.
fn poll_readable(fd: i32, timeout: Duration) -> i32 {
    let give_up = Instant::now() + timeout;
    loop {
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = give_up.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
        if n == 1 {
            assert_ne!(pfd.revents & libc::POLLIN, 0, "revents {:#x}", pfd.revents);
            assert_eq!(pfd.revents & (libc::POLLNVAL | libc::POLLERR), 0, "revents {:#x}", pfd.revents);
        }
        return n;
    }
}

// Futures can move to another thread (e.g. tokio::spawn needs Send), as the request can.
#[test]
fn future_thread_safety_traits() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<WaitFuture<'static>>();
    send_sync::<WaitListFuture<'static>>();
    send_sync::<RequestFuture>();
}
