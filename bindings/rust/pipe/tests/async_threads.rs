//! Many calls awaited by one thread: the request futures park no thread per waiting call. Alone
//! in its test binary, so that no other test starts or ends threads while it counts them.
mod common;

use std::task::Poll;

use common::executor::{join_all, poll_once, Signal};
use common::gate::{Key, ARRIVED};
use common::*;
use pipe::SessionOptions;

const CALLS: usize = 32;

/// Threads of this process now (/proc/self/task).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn many_held_calls_are_awaited_by_one_thread() {
    // One micro-batch per call and room for every call in the pipeline, so that submit never
    // waits for room while the gate holds the calls.
    let session = gated_session(SessionOptions::new().microbatches(1).max_inflight(2 * CALLS));
    let key = Key::new();
    let requests: Vec<pipe::Request> =
        (0..CALLS).map(|_| session.submit(&gated_inputs(key.value())).unwrap()).collect();
    key.wait("stage0", ARRIVED, 1);

    // Poll one future first (whatever libpipe starts once for completion callbacks is then
    // running), then the others: those must add no thread at all.
    let signal = Signal::new();
    let mut futures: Vec<_> = requests.iter().map(|r| r.wait_async()).collect();
    assert!(poll_once(&mut futures[0], &signal).is_pending());
    let with_one = threads();
    for f in &mut futures[1..] {
        assert!(matches!(poll_once(f, &signal), Poll::Pending), "a call finished while its gate was shut");
    }
    let with_all = threads();
    println!("threads: {with_one} with one call awaited, {with_all} with {CALLS}");
    assert_eq!(with_all, with_one, "awaiting {CALLS} calls started threads");
    assert_eq!(signal.wakes(), 0);

    key.open();
    let outputs = join_all(futures);
    assert_eq!(outputs.len(), CALLS);
    for (i, out) in outputs.into_iter().enumerate() {
        check_gated_output(&format!("call {i}"), out.unwrap());
    }
}
