//! Shared by the integration tests: fixtures come from the folder in LIBPIPE_FIXTURES (set by
//! run-tests.sh), never from a hard-coded path.
#![allow(dead_code)]

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

/// slow_loop.scripted.pt: forward(x: float32 [B, 64], n: int64 0-d); each of its 2 stages loops
/// a 64x64 matmul n times, so n sets how long a call takes.
pub fn slow_session(microbatches: usize) -> Session {
    slow_session_with(SessionOptions::new().microbatches(microbatches))
}

/// slow_loop.scripted.pt with these options, plus the input specs it needs (x split, n
/// replicated).
pub fn slow_session_with(options: SessionOptions) -> Session {
    let model = Model::load(fixture("slow_loop.scripted.pt")).unwrap();
    assert_eq!(model.input_names().unwrap(), vec!["x", "n"]);
    let plan = Plan::new(&model, &PlanOptions::new()).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    let options = options.input_specs(vec![ChunkSpec::Split(0), ChunkSpec::Replicate]);
    Session::new(&plan, &options).unwrap()
}

pub fn slow_inputs(n: i64) -> Vec<Tensor> {
    let x: Vec<f32> = (0..4 * 64).map(|i| ((i % 7) as f32 - 3.0) / 10.0).collect();
    vec![Tensor::new(vec![4, 64], x).unwrap(), Tensor::scalar(n)]
}
