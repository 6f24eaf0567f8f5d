//! The smallest complete libpipe program in Rust: load a TorchScript model, cut it in two
//! before `blocks.2`, run the inputs from a safetensors file through the pipeline with 4
//! micro-batches, and compare the result with the reference output PyTorch wrote.
//!
//!     example_rust MODEL.pt INPUTS.safetensors REFERENCE.safetensors

use std::process::ExitCode;

use pipe::{Model, Plan, PlanOptions, Session, SessionOptions, Tensor};

const MICROBATCHES: usize = 4;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: {} MODEL.pt INPUTS.safetensors REFERENCE.safetensors", args[0]);
        return ExitCode::from(2);
    }
    match run(&args[1], &args[2], &args[3]) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn find(tensors: &[(String, Tensor)], name: &str) -> pipe::Result<Tensor> {
    tensors
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.clone())
        .ok_or_else(|| pipe::Error::new(pipe::Status::NotFound, format!("no tensor called {name:?}")))
}

fn run(model_path: &str, inputs_path: &str, reference_path: &str) -> pipe::Result<bool> {
    let model = Model::load(model_path)?;
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin"))?;
    let session = Session::new(&plan, &SessionOptions::new().microbatches(MICROBATCHES))?;

    // The forward arguments in order, looked up by name in the input file.
    let file = pipe::safetensors::read(inputs_path)?;
    let inputs = model.input_names()?.iter().map(|name| find(&file, name)).collect::<pipe::Result<Vec<_>>>()?;
    let outputs = session.run(&inputs)?;

    let got = find(&outputs, "output")?;
    let want = find(&pipe::safetensors::read(reference_path)?, "output")?;
    if got.shape() != want.shape() {
        println!("output shape {:?} differs from the reference's {:?}", got.shape(), want.shape());
        return Ok(false);
    }
    let max_diff = got.to_f64_vec().iter().zip(want.to_f64_vec()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);

    println!(
        "libpipe {}: {} stages, {} micro-batches, {} values, max |diff| vs PyTorch = {:.3e}",
        pipe::version(),
        plan.num_stages()?,
        MICROBATCHES,
        got.numel(),
        max_diff
    );
    let ok = max_diff <= 1e-4;
    println!("{}", if ok { "output matches PyTorch" } else { "output DIFFERS from PyTorch" });
    Ok(ok)
}
