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
        "libpipe {}: {} stages, {} micro-batches, {} values, max |diff| vs PyTorch = {}",
        pipe::version(),
        plan.num_stages()?,
        MICROBATCHES,
        got.numel(),
        format_g(max_diff)
    );
    let ok = max_diff <= 1e-4;
    println!("{}", if ok { "output matches PyTorch" } else { "output DIFFERS from PyTorch" });
    Ok(ok)
}

/// A number as C's "%.3g" prints it (3 significant digits, exponent only when very small or
/// large), so this line reads like the C example's.
fn format_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let exp = x.abs().log10().floor() as i32;
    if !(-4..3).contains(&exp) {
        let s = format!("{x:.2e}"); // "4.77e-7"
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        return format!("{mantissa}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    let s = format!("{x:.*}", (2 - exp) as usize);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn format_g_matches_c() {
        use super::format_g;
        assert_eq!(format_g(0.0), "0");
        assert_eq!(format_g(4.768e-7), "4.77e-07");
        assert_eq!(format_g(0.00012345), "0.000123");
        assert_eq!(format_g(1.5), "1.5");
        assert_eq!(format_g(123.4), "123");
        assert_eq!(format_g(12345.0), "1.23e+04");
    }
}
