//! Every failure comes back as an Error with libpipe's status and message, and leaves the
//! handles usable.
mod common;

use common::*;
use pipe::{Model, Plan, PlanOptions, Policy, Session, SessionOptions, Status, Tensor};

#[test]
fn missing_model_file() {
    let path = std::env::temp_dir().join("pipe-rust-no-such-model.pt");
    let e = Model::load(&path).err().expect("loading a missing file fails");
    assert_eq!(e.status, Status::NotFound);
    assert!(e.message.contains("pipe-rust-no-such-model.pt"), "message: {}", e.message);
    // Display carries both, and it is a std::error::Error.
    let shown = e.to_string();
    assert!(shown.contains("PIPE_ERR_NOT_FOUND") && shown.contains(&e.message), "{shown}");
    let boxed: Box<dyn std::error::Error> = Box::new(e);
    assert!(boxed.to_string().contains("NOT_FOUND"));
}

#[test]
fn file_that_is_not_a_model() {
    let e = Model::load(fixture("demo.inputs.safetensors")).err().unwrap();
    assert_eq!(e.status, Status::InvalidFormat, "{e}");
    assert!(!e.message.is_empty());
}

#[test]
fn nul_byte_in_path_is_caught_before_libpipe() {
    let e = Model::load("bad\0name.pt").err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("NUL"), "{}", e.message);
}

#[test]
fn wrong_inputs() {
    let session = demo_session(4);
    let x = demo_input();

    let e = session.run(&[x.clone(), x.clone()]).unwrap_err();
    assert_eq!(e.status, Status::Input, "{e}");
    assert!(e.message.contains("takes 1 input") && e.message.contains("2 were given"), "{}", e.message);

    let none: [Tensor; 0] = [];
    assert_eq!(session.run(&none).unwrap_err().status, Status::Input);
    assert_eq!(session.submit(&none).err().unwrap().status, Status::Input);

    // A wrong feature size fails inside the model: an execution error naming the stage and
    // carrying the model's own message.
    let narrow = Tensor::new(vec![32, 128], vec![0f32; 32 * 128]).unwrap();
    let e = session.run(&[narrow]).unwrap_err();
    assert_eq!(e.status, Status::Execution, "{e}");
    assert!(e.message.contains("stage 0") && e.message.contains("256"), "{}", e.message);

    // The session stays usable after failed calls.
    let got = named(session.run(&[x]).unwrap(), "output");
    assert!(max_abs_diff(&got, &demo_reference()) <= 1e-4);
}

#[test]
fn unknown_split_point_names_nearest_modules() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let e = Plan::new(&model, &PlanOptions::new().split_point("blok.2:begin")).err().unwrap();
    assert_eq!(e.status, Status::Split, "{e}");
    assert!(e.message.contains("blok.2"), "names the bad module: {}", e.message);
    assert!(e.message.contains("blocks.2"), "suggests the nearest one: {}", e.message);
}

#[test]
fn bad_plan_options() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    // Not "FQN:begin" / "FQN:end".
    let e = Plan::new(&model, &PlanOptions::new().split_point("blocks.2")).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains(":begin"), "says what to write: {}", e.message);
    // Split points together with a stage count.
    let both = PlanOptions::new().split_point("blocks.2:begin").stages(2, Policy::Uniform);
    assert_eq!(Plan::new(&model, &both).err().unwrap().status, Status::InvalidArgument);
    // N < 1.
    let zero = PlanOptions::new().stages(0, Policy::Params);
    assert_eq!(Plan::new(&model, &zero).err().unwrap().status, Status::InvalidArgument);
    // "time" needs example inputs to measure.
    let e = Plan::new(&model, &PlanOptions::new().stages(2, Policy::Time)).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("example inputs"), "{}", e.message);
}

#[test]
fn bad_session_options() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new()).unwrap();
    let e = Session::new(&plan, &SessionOptions::new().microbatches(0)).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    // A SUM spec makes no sense for an input.
    let e = Session::new(&plan, &SessionOptions::new().input_specs(vec![pipe::ChunkSpec::Sum])).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(e.message.contains("input_specs[0]"), "{}", e.message);
    // Devices: a GPU the machine does not have is named; a malformed list is refused.
    let e = Session::new(&plan, &SessionOptions::new().devices("cuda:64")).err().unwrap();
    assert_eq!(e.status, Status::Unsupported, "{e}");
    assert!(e.message.contains("stage 0 is on cuda:64"), "{}", e.message);
    let e = Session::new(&plan, &SessionOptions::new().devices("gpu")).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    let e = Session::new(&plan, &SessionOptions::new().devices("cpu\0")).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
}

#[test]
fn safetensors_errors() {
    let e = pipe::safetensors::read(scratch("absent.safetensors")).unwrap_err();
    assert_eq!(e.status, Status::NotFound, "{e}");
    let e = pipe::safetensors::read(fixture("demo.pt")).unwrap_err();
    assert_eq!(e.status, Status::InvalidFormat, "{e}");
}

#[test]
fn status_names_and_codes() {
    assert_eq!(Status::Input.name(), "PIPE_ERR_INPUT");
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(12), Some(Status::Cancelled));
    assert_eq!(Status::from_code(999), Some(Status::Unknown(999)));
    assert_eq!(Status::Unknown(999).name(), "PIPE_ERR_UNKNOWN");
    assert_eq!(Status::DeadlineExceeded.code(), pipe::sys::PIPE_ERR_DEADLINE_EXCEEDED);
    assert!(pipe::version().starts_with(&format!("{}.", pipe::sys::PIPE_VERSION_MAJOR)));
}
