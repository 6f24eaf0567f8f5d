//! Asynchronous calls on slow_loop: polling, timeouts, cancellation and deadlines. n = 200000
//! makes a call take seconds, so it is certainly still running when it is checked or cancelled
//! a few milliseconds after it started; n = 50000 (a fraction of a second) is enough where only
//! a 10 ms deadline or a drop has to catch it running.
mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::*;
use pipe::{RunOptions, Status};

const SLOW: i64 = 200_000;
const MEDIUM: i64 = 50_000;

#[test]
fn wait_times_out_then_cancel() {
    let session = slow_session(2);
    let slow = session.submit(&slow_inputs(SLOW)).unwrap();
    let quick = session.submit(&slow_inputs(2)).unwrap();

    // Still running: a check and a short wait both report Timeout, and the call goes on.
    let e = slow.wait(Some(Duration::ZERO)).unwrap_err();
    assert_eq!(e.status, Status::Timeout, "{e}");
    assert_eq!(slow.wait(Some(Duration::from_millis(20))).unwrap_err().status, Status::Timeout);

    slow.cancel().unwrap();
    let e = slow.wait(None).unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
    assert!(e.message.contains("cancel"), "{}", e.message);
    // A finished (here: cancelled) call gives the same result again.
    assert_eq!(slow.wait(Some(Duration::ZERO)).unwrap_err().status, Status::Cancelled);

    // The other call in the pipeline is unaffected.
    let out = named(quick.wait(None).unwrap(), "output");
    assert_eq!(out.shape(), &[4, 64]);
    // Cancelling a finished call keeps its result.
    quick.cancel().unwrap();
    assert_eq!(named(quick.wait(Some(Duration::ZERO)).unwrap(), "output"), out);
}

#[test]
fn cancel_from_another_thread_while_waiting() {
    let session = slow_session(2);
    let request = Arc::new(session.submit(&slow_inputs(SLOW)).unwrap());
    let waiter = {
        let request = Arc::clone(&request);
        thread::spawn(move || request.wait(None))
    };
    // Whether the cancel lands before or during the wait, the wait ends with Cancelled.
    thread::sleep(Duration::from_millis(50));
    request.cancel().unwrap();
    let e = waiter.join().unwrap().unwrap_err();
    assert_eq!(e.status, Status::Cancelled, "{e}");
}

#[test]
fn deadline_exceeded_then_session_still_works() {
    let session = slow_session(2);
    let e = session.run_with(&slow_inputs(MEDIUM), &RunOptions::with_timeout(Duration::from_millis(10))).unwrap_err();
    assert_eq!(e.status, Status::DeadlineExceeded, "{e}");

    let request =
        session.submit_with(&slow_inputs(MEDIUM), &RunOptions { timeout: Some(Duration::from_millis(10)) }).unwrap();
    assert_eq!(request.wait(None).unwrap_err().status, Status::DeadlineExceeded);

    // A generous deadline is met, and the result is right.
    let out = session.run_with(&slow_inputs(2), &RunOptions::with_timeout(Duration::from_secs(600))).unwrap();
    let expected = pipe::safetensors::read(fixture("slow_loop.expected.safetensors")).unwrap();
    let inputs = pipe::safetensors::read(fixture("slow_loop.inputs.safetensors")).unwrap();
    // The fixture's own inputs give the fixture's expected output.
    let fixture_inputs = vec![named(inputs.clone(), "x"), named(inputs, "n")];
    let got = named(session.run(&fixture_inputs).unwrap(), "output");
    assert!(max_abs_diff(&got, &named(expected, "output")) <= 1e-4);
    assert_eq!(named(out, "output").shape(), &[4, 64]);
}

#[test]
fn dropping_running_request_or_session_does_not_hang() {
    let session = slow_session(2);
    // Dropping a request that is still running cancels it.
    drop(session.submit(&slow_inputs(MEDIUM)).unwrap());
    // A request outlives its session; destroying the session fails it if it was running.
    let orphan = session.submit(&slow_inputs(MEDIUM)).unwrap();
    drop(session);
    match orphan.wait(None) {
        Ok(out) => assert_eq!(named(out, "output").shape(), &[4, 64]),
        Err(e) => assert_eq!(e.status, Status::Cancelled, "{e}"),
    }
}
