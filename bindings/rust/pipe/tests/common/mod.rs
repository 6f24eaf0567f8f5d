//! Shared by the integration tests: fixtures come from the folder in LIBPIPE_FIXTURES (set by
//! run-tests.sh), never from a hard-coded path.
#![allow(dead_code)]

pub mod decoder;
pub mod executor;
pub mod gate;

use std::path::PathBuf;

use pipe::{ChunkSpec, Model, Plan, PlanOptions, Session, SessionOptions, Tensor};

pub fn fixture(name: &str) -> PathBuf {
    let dir = std::env::var_os("LIBPIPE_FIXTURES")
        .expect("LIBPIPE_FIXTURES must name the fixture folder (run-tests.sh sets it)");
    let path = PathBuf::from(dir).join(name);
    assert!(path.is_file(), "missing fixture {}", path.display());
    path
}

/// A scratch path under the cargo target folder (so under run-tests.sh's WORKDIR).
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pipe-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}-{}", std::process::id(), name))
}

/// demo.pt cut in two before blocks.2, as the examples do (default, adaptive micro-batching).
pub fn demo_session(microbatches: usize) -> Session {
    demo_session_with(SessionOptions::new().microbatches(microbatches))
}

/// demo.pt cut in two before blocks.2, with these session options.
pub fn demo_session_with(options: SessionOptions) -> Session {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    Session::new(&plan, &options).unwrap()
}

/// demo's input "x" (float32 [32, 256]).
pub fn demo_input() -> Tensor {
    named(pipe::safetensors::read(fixture("demo.inputs.safetensors")).unwrap(), "x")
}

/// Eager PyTorch's output for demo_input (float32 [32, 10]).
pub fn demo_reference() -> Tensor {
    named(pipe::safetensors::read(fixture("demo.expected.safetensors")).unwrap(), "output")
}

pub fn named(list: Vec<(String, Tensor)>, name: &str) -> Tensor {
    list.into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no tensor called {name}")).1
}

/// Largest element-wise difference; panics if shapes or dtypes differ.
pub fn max_abs_diff(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape(), "shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "dtypes differ");
    got.to_f64_vec().iter().zip(want.to_f64_vec()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

/// Rows of a 2-d float32 tensor rotated by `k` (row i of the result is row (i + k) % rows).
pub fn rotate_rows(t: &Tensor, k: usize) -> Tensor {
    let (rows, cols) = (t.shape()[0] as usize, t.shape()[1] as usize);
    let v = t.as_slice::<f32>().unwrap();
    let mut out = Vec::with_capacity(v.len());
    for i in 0..rows {
        let r = (i + k) % rows;
        out.extend_from_slice(&v[r * cols..(r + 1) * cols]);
    }
    Tensor::new(t.shape().to_vec(), out).unwrap()
}

/// gated.scripted.pt: forward(x: float32 [B, 64], n: int64 0-d), 2 stages, each passing through
/// the test gate with key n (n = 0: the gates pass at once; see gate.rs), with the input specs it
/// needs (x split, n replicated so that every micro-batch carries the key).
pub fn gated_session(options: SessionOptions) -> Session {
    gate::init();
    let model = Model::load(fixture("gated.scripted.pt")).unwrap();
    assert_eq!(model.input_names().unwrap(), vec!["x", "n"]);
    let plan = Plan::new(&model, &PlanOptions::new()).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    let options = options.input_specs(vec![ChunkSpec::Split(0), ChunkSpec::Replicate]);
    Session::new(&plan, &options).unwrap()
}

/// The gated fixture's x with gate key n.
pub fn gated_inputs(n: i64) -> Vec<Tensor> {
    let x = named(pipe::safetensors::read(fixture("gated.inputs.safetensors")).unwrap(), "x");
    vec![x, Tensor::scalar(n)]
}

/// Eager PyTorch's output for the gated fixture's x (whatever the key: the gate returns its input).
pub fn gated_reference() -> Tensor {
    named(pipe::safetensors::read(fixture("gated.expected.safetensors")).unwrap(), "output")
}

/// Checks a call's outputs against eager PyTorch's.
pub fn check_gated_output(what: &str, outputs: Vec<(String, Tensor)>) {
    let diff = max_abs_diff(&named(outputs, "output"), &gated_reference());
    assert!(diff <= 1e-4, "{what}: max |diff| vs PyTorch = {diff}");
}
