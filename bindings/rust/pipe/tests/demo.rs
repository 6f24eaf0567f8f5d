//! The demo model, cut in two and run with 4 micro-batches, gives eager PyTorch's result.
mod common;

use common::*;
use pipe::{DType, Model, Names, Plan, PlanOptions, Policy, Session, SessionOptions, Status};

#[test]
fn run_matches_reference() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    assert_eq!(model.input_names().unwrap(), vec!["x"]);
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    let session = Session::new(&plan, &SessionOptions::new().microbatches(4)).unwrap();
    assert_eq!(session.num_stages().unwrap(), 2);

    let outputs = session.run(&[demo_input()]).unwrap();
    assert_eq!(outputs.len(), 1);
    assert_eq!(outputs[0].0, "output");
    let got = &outputs[0].1;
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(got.shape(), &[32, 10]);
    let diff = max_abs_diff(got, &demo_reference());
    assert!(diff <= 1e-4, "max |diff| = {diff}");

    // Each stage ran the call's 4 micro-batches, none failed. (The default adaptive
    // micro-batching cuts a call that finds the pipeline empty into all 4.)
    let stats = session.stats().unwrap();
    assert_eq!(stats.len(), 2);
    for s in &stats {
        assert_eq!(s.microbatches, 4, "{s:?}");
        assert_eq!(s.failures, 0);
        assert!(s.busy_ms > 0.0);
    }
    assert_eq!(session.stage_stats(2).unwrap_err().status, Status::InvalidArgument);
}

#[test]
fn plan_queries() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let modules = model.modules().unwrap();
    assert_eq!(modules[0].path, "");
    assert_eq!(modules[0].depth, 0);
    let block = modules.iter().find(|m| m.path == "blocks.2").expect("blocks.2 in the module tree");
    assert_eq!(block.type_name, "Block");
    assert!(block.num_params > 0 && block.param_bytes == 4 * block.num_params);

    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    // The cut puts blocks 0-1 in stage 0 and blocks 2-3 with the head in stage 1.
    let p0 = plan.parameters(0).unwrap();
    let p1 = plan.names(1, Names::Parameters).unwrap();
    assert!(p0.contains(&"blocks.0.up.weight".to_string()), "{p0:?}");
    assert!(!p0.iter().any(|n| n.starts_with("blocks.2.")), "{p0:?}");
    assert!(p1.contains(&"blocks.2.up.weight".to_string()) && p1.contains(&"head.weight".to_string()));
    assert!(plan.buffers(0).unwrap().is_empty());
    assert!(plan.param_bytes(0).unwrap() > 0);
    assert_eq!(plan.estimated_ms(0).unwrap(), None, "no example inputs, no measured time");
    let json = plan.describe().unwrap();
    assert!(json.contains("\"num_stages\":2") || json.contains("\"num_stages\": 2"), "{json}");
    assert!(json.contains("blocks.2:begin"), "{json}");

    // No options: the model's three pipe::split() markers give four stages.
    assert_eq!(Plan::new(&model, &PlanOptions::new()).unwrap().num_stages().unwrap(), 4);
    // A stage count and a policy instead of split points.
    let uniform = model.plan(&PlanOptions::new().stages(2, Policy::Uniform)).unwrap();
    assert_eq!(uniform.num_stages().unwrap(), 2);
    // Example inputs make the plan measure each stage.
    let timed = model.plan(&PlanOptions::new().stages(2, Policy::Time).example_inputs(vec![demo_input()])).unwrap();
    assert_eq!(timed.num_stages().unwrap(), 2);
    assert!(timed.estimated_ms(0).unwrap().unwrap() >= 0.0);
}

#[test]
fn submit_then_wait_matches_reference() {
    let session = demo_session(4);
    let request = {
        // submit copies its inputs: the tensor may be dropped before the call runs.
        let x = demo_input();
        session.submit(&[x]).unwrap()
    };
    let got = named(request.wait(None).unwrap(), "output");
    assert!(max_abs_diff(&got, &demo_reference()) <= 1e-4);
    // A finished call may be waited for again and gives the same result.
    assert_eq!(named(request.wait(Some(std::time::Duration::ZERO)).unwrap(), "output"), got);
}

#[test]
fn outputs_without_copy_and_safetensors_round_trip() {
    let session = demo_session(4);
    let x = demo_input();
    let mut list = session.run_list(&[&x], &Default::default()).unwrap();
    assert_eq!(list.names().unwrap(), vec!["output"]);
    assert_eq!(list.find("output").unwrap(), 0);
    assert_eq!(list.find("nope").unwrap_err().status, Status::NotFound);

    // A borrowed view reads libpipe's memory directly and equals the copy.
    let copy = list.get(0).unwrap().to_tensor().unwrap();
    {
        let view = list.get_by_name("output").unwrap();
        assert_eq!(view.shape(), &[32, 10]);
        assert_eq!(view.as_slice::<f32>().unwrap(), copy.as_slice::<f32>().unwrap());
        assert!(view.as_slice::<f64>().is_none());
    }
    assert!(max_abs_diff(&copy, &demo_reference()) <= 1e-4);

    // Written by libpipe and read back, the outputs are unchanged.
    let path = scratch("outputs.safetensors");
    pipe::safetensors::write(&list, &path).unwrap();
    let back = pipe::safetensors::read(&path).unwrap();
    assert_eq!(back, vec![("output".to_string(), copy.clone())]);
    std::fs::remove_file(&path).unwrap();

    // Taking an entry moves it out: the list then refuses it, and writing needs every entry.
    let taken = list.take(0).unwrap();
    assert_eq!(taken.as_slice::<f32>().unwrap(), copy.as_slice::<f32>().unwrap());
    assert_eq!(taken.to_tensor().unwrap(), copy);
    assert!(list.get(0).is_err());
    let e = list.write_safetensors(&path).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument, "{e}");
    assert!(!path.exists(), "a failed write leaves no file");
    drop(taken); // runs the DLPack deleter
}

#[test]
fn batch_with_fewer_rows_than_microbatches_still_runs() {
    let session = demo_session(4);
    let x = demo_input();
    let two_rows = pipe::Tensor::new(vec![2, 256], x.as_slice::<f32>().unwrap()[..512].to_vec()).unwrap();
    let out = named(session.run(&[two_rows]).unwrap(), "output");
    let want = demo_reference();
    let want = pipe::Tensor::new(vec![2, 10], want.as_slice::<f32>().unwrap()[..20].to_vec()).unwrap();
    assert!(max_abs_diff(&out, &want) <= 1e-4);
}

// 8-bit linear weights (libpipe >= 0.13): the demo's result to int8's precision, in float32; a CPU without AVX-512
// refuses them with Unsupported.
#[test]
fn int8_weights_give_the_result_to_their_precision() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    let stage = pipe::StageOptions { quantize: pipe::Quantization::Int8, ..Default::default() };
    match Session::new(&plan, &SessionOptions::new().microbatches(2).stage_options(stage)) {
        Err(e) => assert_eq!(e.status, Status::Unsupported, "{e}"),
        Ok(session) => {
            let outputs = session.run(&[demo_input()]).unwrap();
            let got = &outputs[0].1;
            assert_eq!(got.dtype(), DType::F32);
            let diff = max_abs_diff(got, &demo_reference());
            assert!(diff > 0.0 && diff <= 0.1, "max |diff| = {diff}");
        }
    }
}

// 4-bit linear weights in groups of 64 (libpipe >= 0.14): further from the float result, still close; a group
// size libpipe does not take is refused with InvalidArgument.
#[test]
fn int4_weights_give_the_result_to_their_precision() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    let stage = pipe::StageOptions { quantize: pipe::Quantization::Int4 { group: 64 }, ..Default::default() };
    match Session::new(&plan, &SessionOptions::new().microbatches(2).stage_options(stage)) {
        Err(e) => assert_eq!(e.status, Status::Unsupported, "{e}"),
        Ok(session) => {
            let outputs = session.run(&[demo_input()]).unwrap();
            let got = &outputs[0].1;
            assert_eq!(got.dtype(), DType::F32);
            let diff = max_abs_diff(got, &demo_reference());
            assert!(diff > 0.0 && diff <= 0.5, "max |diff| = {diff}");
        }
    }
    let bad = pipe::StageOptions { quantize: pipe::Quantization::Int4 { group: 48 }, ..Default::default() };
    let err = Session::new(&plan, &SessionOptions::new().stage_options(bad)).err().unwrap();
    assert_eq!(err.status, Status::InvalidArgument, "{err}");
}

// The output head's storage (libpipe >= 0.16): each choice passes with quantized weights (the demo's last layer is
// its head; a CPU without AVX-512 refuses quantized weights with Unsupported), and is refused without them.
#[test]
fn the_head_quantization_needs_quantized_weights() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    for head in [pipe::HeadQuantization::Int8, pipe::HeadQuantization::Int4, pipe::HeadQuantization::None] {
        let stage = pipe::StageOptions {
            quantize: pipe::Quantization::Int4 { group: 32 },
            quantize_head: head,
            ..Default::default()
        };
        match Session::new(&plan, &SessionOptions::new().stage_options(stage)) {
            Err(e) => assert_eq!(e.status, Status::Unsupported, "{e}"),
            Ok(session) => {
                let outputs = session.run(&[demo_input()]).unwrap();
                let diff = max_abs_diff(&outputs[0].1, &demo_reference());
                assert!(diff <= 0.5, "head {head:?}: max |diff| = {diff}");
            }
        }
        let alone = pipe::StageOptions { quantize_head: head, ..Default::default() };
        let err = Session::new(&plan, &SessionOptions::new().stage_options(alone.clone())).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
        assert!(err.message.contains("quantize_head"), "{err}");
        let err = plan.weight_bytes(1, Some(&alone)).err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument, "{err}");
    }
}

// The embedding's storage (libpipe >= 0.17) reaches libpipe without quantized weights: the demo has no embedding
// table, so its results are the float model's.
#[test]
fn the_embedding_quantization_is_taken_alone() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    let stage = pipe::StageOptions { quantize_embedding: pipe::EmbeddingQuantization::Int8, ..Default::default() };
    let session = Session::new(&plan, &SessionOptions::new().stage_options(stage)).unwrap();
    let outputs = session.run(&[demo_input()]).unwrap();
    let diff = max_abs_diff(&outputs[0].1, &demo_reference());
    assert!(diff <= 1e-4, "max |diff| = {diff}");
}

// The bytes a stage stores (libpipe >= 0.16): float panels hold at least the model's bytes, 8-bit codes fewer (a CPU
// without AVX-512 refuses them with Unsupported).
#[test]
fn weight_bytes_follow_the_storage() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    let plain = plan.weight_bytes(1, None).unwrap();
    assert!(plain >= plan.param_bytes(1).unwrap());
    let int8 = pipe::StageOptions { quantize: pipe::Quantization::Int8, ..Default::default() };
    match plan.weight_bytes(1, Some(&int8)) {
        Err(e) => assert_eq!(e.status, Status::Unsupported, "{e}"),
        Ok(bytes) => assert!(bytes < plain, "{bytes} as int8, {plain} as float"),
    }
}
