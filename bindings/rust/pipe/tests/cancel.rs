//! Asynchronous calls on the gated model: polling, timeouts, cancellation, deadlines and drops.
//! Each test holds its call at stage 0's gate (common/gate.rs) and acts on a state it has seen,
//! so no verdict depends on how long some work takes: a held call cannot finish until the test
//! opens its gate.
mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::gate::{wait_until, Key, ARRIVED};
use common::*;
use pipe::{Request, RunOptions, SessionOptions, Status};

fn session_of(microbatches: usize) -> pipe::Session {
    gated_session(SessionOptions::new().microbatches(microbatches))
}

/// Joins `thread`, failing the test if it has not finished within the gate's wait limit (a bound
/// for a hung test only: the test has made sure that it finishes).
fn join_bounded<T>(thread: thread::JoinHandle<T>, what: &str) -> T {
    wait_until(|| thread.is_finished(), || format!("{what} has not returned"));
    thread.join().unwrap()
}

#[test]
fn wait_times_out_then_cancel() {
    let session = session_of(2);
    let key = Key::new();
    let held = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    // Queued behind the held call's micro-batches in stage 0.
    let quick = session.submit(&gated_inputs(0)).unwrap();

    // Still running: a check and a short wait both report Timeout, and the call goes on.
    let e = held.wait(Some(Duration::ZERO)).unwrap_err();
    assert_eq!(e.status, Status::Timeout, "{e}");
    assert_eq!(held.wait(Some(Duration::from_millis(20))).unwrap_err().status, Status::Timeout);

    held.cancel().unwrap();
    let e = held.wait(None).unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
    assert!(e.message.contains("cancel"), "{}", e.message);
    // A finished (here: cancelled) call gives the same result again.
    assert_eq!(held.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Cancelled);
    // It ended while its first micro-batch was held in stage 0: stage 1 has run nothing.
    assert_eq!(session.stats().unwrap()[1].microbatches, 0);

    // The other call in the pipeline is unaffected once stage 0 goes on.
    key.open();
    let outputs = quick.wait(None).unwrap();
    let out = named(outputs.clone(), "output");
    check_gated_output("the call queued behind the cancelled one", outputs);
    // Its micro-batch came after the cancelled call's through both stages, so these counts are
    // final: the held micro-batch went no further, the queued one never ran.
    assert_eq!(key.count("stage0", ARRIVED), 1);
    assert_eq!(key.count("stage1", ARRIVED), 0);
    // Cancelling a finished call keeps its result.
    quick.cancel().unwrap();
    assert_eq!(named(quick.wait(Some(Duration::ZERO)).unwrap(), "output"), out);
}

#[test]
fn cancel_from_another_thread_while_waiting() {
    let session = session_of(2);
    let key = Key::new();
    let request = Arc::new(session.submit(&gated_inputs(key.value())).unwrap());
    let waiter = {
        let request = Arc::clone(&request);
        thread::spawn(move || request.wait(None))
    };
    // Held in stage 0: the wait cannot end before the cancel. Whether the cancel lands before
    // the waiter has started waiting or during its wait, the wait ends with Cancelled.
    key.wait("stage0", ARRIVED, 1);
    request.cancel().unwrap();
    let e = join_bounded(waiter, "the cancelled wait").unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
}

#[test]
fn deadline_exceeded_then_session_still_works() {
    let session = session_of(2);
    let timeout = Duration::from_millis(10);

    // The blocking call: it cannot finish while its gate is shut, so the deadline is the one way
    // it can end. Its deadline counts from its submission, which comes before its micro-batch
    // reaches stage 0: once the clock is `timeout` past that arrival, the deadline has passed,
    // and the gate is opened (run_with returns only after the call's micro-batches are dropped).
    // A deadline that passes before the micro-batch reaches stage 0 ends the call there.
    let blocking = Key::new();
    let e = thread::scope(|s| {
        let run = s.spawn(|| session.run_with(&gated_inputs(blocking.value()), &RunOptions::with_timeout(timeout)));
        let mut arrived = None;
        wait_until(
            || {
                if blocking.count("stage0", ARRIVED) > 0 {
                    arrived = Some(Instant::now());
                }
                arrived.is_some() || run.is_finished()
            },
            || "the call neither reached stage 0 nor returned".into(),
        );
        if let Some(arrived) = arrived {
            wait_until(|| arrived.elapsed() > timeout, || "the clock stands still".into());
            blocking.open();
        }
        wait_until(|| run.is_finished(), || "run_with past its deadline has not returned".into());
        run.join().unwrap().unwrap_err()
    });
    assert_eq!(e.status, Status::DeadlineExceeded, "{e}");

    // The asynchronous call: its deadline counts from inside submit_with, so it has passed once
    // the clock is `timeout` past submit_with's return; the held call cannot have finished.
    let asynchronous = Key::new();
    let request = session.submit_with(&gated_inputs(asynchronous.value()), &RunOptions::with_timeout(timeout)).unwrap();
    let after_submit = Instant::now();
    wait_until(|| after_submit.elapsed() > timeout, || "the clock stands still".into());
    assert_eq!(request.wait(None).unwrap_err().status, Status::DeadlineExceeded);
    asynchronous.open();

    // A generous deadline is met (the bound only ends a hung test), and the result is right. Its
    // micro-batches come after the failed calls' through both stages, so then the gate counts
    // are final: none of the failed calls' micro-batches ran in stage 1.
    let out = session.run_with(&gated_inputs(0), &RunOptions::with_timeout(Duration::from_secs(600))).unwrap();
    check_gated_output("a call within its deadline", out);
    assert_eq!(blocking.count("stage1", ARRIVED), 0);
    assert_eq!(asynchronous.count("stage1", ARRIVED), 0);
}

#[test]
fn dropping_a_running_request_cancels_it() {
    let session = session_of(2);
    let key = Key::new();
    let request = session.submit(&gated_inputs(key.value())).unwrap();
    key.wait("stage0", ARRIVED, 1);
    drop(request);
    key.open();
    // The next call's micro-batch comes after the dropped call's through both stages: the held
    // micro-batch went no further and the queued one never ran.
    check_gated_output("after a dropped request", session.run(&gated_inputs(0)).unwrap());
    assert_eq!(key.count("stage0", ARRIVED), 1);
    assert_eq!(key.count("stage1", ARRIVED), 0);
}

/// Dropping a session fails the calls still in flight with Cancelled, except that a stage
/// already running a micro-batch finishes it; their requests outlive the session. Three calls,
/// each with a gate key of its own: the first is held in stage 0, the other two queue behind it.
/// The session is dropped on another thread while stage 0's gates are opened; stage 1's stay
/// shut, so a call that reaches stage 1 before the dropped session stops taking work is held
/// there, in view, and then let through: it must finish with the right result, and every call
/// that was not seen in stage 1 must fail with Cancelled. (pipe_session_destroy cannot be
/// observed between its start and its end, so how many calls reach stage 1 is not fixed; each
/// call's outcome follows from where it was seen.)
#[test]
fn dropping_a_session_cancels_its_calls_in_flight() {
    let session = session_of(1);
    let keys: Vec<Key> = (0..3).map(|_| Key::new()).collect();
    let requests: Vec<Request> = keys.iter().map(|k| session.submit(&gated_inputs(k.value())).unwrap()).collect();
    keys[0].wait("stage0", ARRIVED, 1);

    let dropper = thread::spawn(move || drop(session));
    for k in &keys {
        k.open_stage("stage0");
    }
    let mut reached = [false; 3];
    wait_until(
        || {
            if dropper.is_finished() {
                return true;
            }
            for (i, k) in keys.iter().enumerate() {
                if !reached[i] && k.count("stage1", ARRIVED) > 0 {
                    reached[i] = true;
                    k.open_stage("stage1");
                }
            }
            false
        },
        || "dropping the session has not returned".into(),
    );
    dropper.join().unwrap();
    println!("calls that reached stage 1 before the session stopped: {reached:?}");

    for (i, r) in requests.iter().enumerate() {
        match r.wait(None) {
            Ok(out) if reached[i] => check_gated_output(&format!("request {i}"), out),
            Ok(_) => panic!("request {i} finished, but it never ran in stage 1"),
            Err(e) if reached[i] => panic!("request {i} was running in the last stage, which finishes it: {e}"),
            Err(e) => {
                assert_eq!(e.status, Status::Cancelled, "request {i}: {e}");
                assert!(e.message.contains("destroyed"), "request {i}: {}", e.message);
            }
        }
    }
}
