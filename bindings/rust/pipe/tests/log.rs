//! The log callback receives libpipe's messages (in its own test binary: the logger is
//! process-wide).
mod common;

use std::sync::{Arc, Mutex};

use common::*;
use pipe::LogLevel;

#[test]
fn warnings_reach_the_callback() {
    let seen: Arc<Mutex<Vec<(LogLevel, String)>>> = Arc::default();
    let sink = Arc::clone(&seen);
    pipe::set_log_callback(move |level, msg| sink.lock().unwrap().push((level, msg.to_owned())), LogLevel::Warning)
        .unwrap();

    // A batch of 2 rows with 4 micro-batches runs as 2 micro-batches, with a warning.
    let session = demo_session(4);
    let x = demo_input();
    let two_rows = pipe::Tensor::new(vec![2, 256], x.as_slice::<f32>().unwrap()[..512].to_vec()).unwrap();
    session.run(&[two_rows]).unwrap();
    pipe::reset_log_callback().unwrap();

    let seen = seen.lock().unwrap();
    assert!(
        seen.iter().any(|(level, msg)| *level == LogLevel::Warning && msg.contains("micro")),
        "no warning about micro-batches among {seen:?}"
    );
    assert!(seen.iter().all(|(level, _)| *level >= LogLevel::Warning), "min_level filters: {seen:?}");
}
