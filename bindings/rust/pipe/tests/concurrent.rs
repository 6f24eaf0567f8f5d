//! One session shared by several threads: calls run at once, their micro-batches interleave in
//! the stages, and every caller gets its own result. Under the default adaptive micro-batching
//! a call that arrives while others are in flight is cut more coarsely; fixed micro-batching
//! cuts every call into the configured number.
mod common;

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::gate::{Key, ARRIVED, LEFT};
use common::*;
use pipe::{Microbatching, Model, Plan, Request, Session, SessionOptions, Status, TensorList};

const THREADS: usize = 4;
const CALLS: usize = 3;
const MICROBATCHES: usize = 4;

/// THREADS threads each run CALLS calls on `session` at once and check every result; returns
/// the number of calls made.
fn run_from_threads(session: &Arc<Session>) -> usize {
    let x = demo_input();
    let reference = demo_reference();
    // All threads start their first call together, so the calls really overlap.
    let start = Arc::new(Barrier::new(THREADS));

    // Thread k feeds the batch with its rows rotated by 8k, so its correct output is the
    // reference rotated the same way: results mixed up between concurrent calls would show.
    let handles: Vec<_> = (0..THREADS)
        .map(|k| {
            let session = Arc::clone(session);
            let start = Arc::clone(&start);
            let input = rotate_rows(&x, 8 * k);
            let want = rotate_rows(&reference, 8 * k);
            thread::spawn(move || {
                start.wait();
                for _ in 0..CALLS {
                    let got = named(session.run(&[&input]).unwrap(), "output");
                    let diff = max_abs_diff(&got, &want);
                    assert!(diff <= 1e-4, "thread {k}: max |diff| = {diff}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a thread's results differ from the reference");
    }
    THREADS * CALLS
}

#[test]
fn threads_share_one_session_fixed_microbatching() {
    let options = SessionOptions::new().microbatches(MICROBATCHES).microbatching(Microbatching::Fixed);
    let session = Arc::new(demo_session_with(options));
    let calls = run_from_threads(&session);

    // Fixed: every call's 4 micro-batches went through both stages, however the calls overlapped.
    for s in session.stats().unwrap() {
        assert_eq!(s.microbatches, (calls * MICROBATCHES) as u64, "{s:?}");
        assert_eq!(s.failures, 0);
    }
}

#[test]
fn threads_share_one_session_adaptive_microbatching() {
    // Adaptive is the default.
    let session = Arc::new(demo_session(MICROBATCHES));
    let calls = run_from_threads(&session);

    // Results are the same as with fixed micro-batching (checked per call above); only the
    // number of micro-batches differs: at least one per call, at most MICROBATCHES per call
    // (a call that finds the pipeline empty), and both stages ran the same ones.
    let stats = session.stats().unwrap();
    for s in &stats {
        assert!(
            (calls as u64..=(calls * MICROBATCHES) as u64).contains(&s.microbatches),
            "{} calls of {MICROBATCHES} micro-batches ran {} micro-batches: {s:?}",
            calls,
            s.microbatches
        );
        assert_eq!(s.failures, 0);
    }
    assert_eq!(stats[0].microbatches, stats[1].microbatches);
}

/// With 2 stages and 2 micro-batches per call, a call submitted while another call's 2
/// micro-batches are still in the pipeline (held at stage 0's gate) already has its one
/// micro-batch per stage: adaptive cuts it into 1, fixed into 2.
fn microbatches_run_by_two_overlapping_calls(mode: Microbatching) -> u64 {
    let session = gated_session(SessionOptions::new().microbatches(2).microbatching(mode));
    let key = Key::new();
    let first = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    let second = session.submit(&gated_inputs(0)).unwrap();
    assert_eq!(first.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Timeout, "the held call is not running");
    key.open();
    check_gated_output("the second call", second.wait(None).unwrap());
    check_gated_output("the first call", first.wait(None).unwrap());
    assert_eq!(key.count("stage1", LEFT), 2, "the first call's micro-batches");
    let stats = session.stats().unwrap();
    assert_eq!(stats.len(), 2);
    assert_eq!(stats[0].microbatches, stats[1].microbatches, "{stats:?}");
    stats[0].microbatches
}

#[test]
fn adaptive_cuts_a_call_that_finds_the_pipeline_full_into_fewer_microbatches() {
    assert_eq!(microbatches_run_by_two_overlapping_calls(Microbatching::Adaptive), 2 + 1);
    assert_eq!(microbatches_run_by_two_overlapping_calls(Microbatching::Fixed), 2 + 2);
}

#[test]
fn threads_submit_and_wait() {
    let session = Arc::new(demo_session(2));
    let x = demo_input();
    let reference = demo_reference();
    let handles: Vec<_> = (0..THREADS)
        .map(|k| {
            let session = Arc::clone(&session);
            let input = rotate_rows(&x, k);
            let want = rotate_rows(&reference, k);
            thread::spawn(move || {
                let requests: Vec<Request> = (0..CALLS).map(|_| session.submit(&[&input]).unwrap()).collect();
                for r in requests {
                    let got = named(r.wait(None).unwrap(), "output");
                    assert!(max_abs_diff(&got, &want) <= 1e-4, "thread {k}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

// Handles are Send/Sync exactly as pipe.h allows (lib.rs, "Threads"); this fails to compile if
// that changes, in either direction: the exclusive ones must not gain the traits they lack.
#[test]
fn handle_thread_safety_traits() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Model>();
    send_sync::<Plan>();
    send_sync::<Session>();
    send_sync::<Request>();
    send::<TensorList>();
    send_sync::<pipe::Tensor>();
}

// pipe_tensor_list_get is exclusive but takes &self: two threads must never share a list.
static_assertions::assert_not_impl_any!(TensorList: Sync);
// A DLPack deleter may not run on another thread than the one that took the tensor.
static_assertions::assert_not_impl_any!(pipe::ManagedTensor: Send, Sync);
