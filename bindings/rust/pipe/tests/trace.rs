//! Traces with operator timing (Session::trace_start_with_operators): every stage slice holds the
//! time of each operator its stage ran, no more in all than the slice lasted, with the linear layers
//! keyed by their weights' shapes, which must be the fixture model's own; a generator's trace also
//! has the engine's track, whose launch slices feed exactly the tokens the sequences fed in.
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::decoder::json::{self, Value};
use common::decoder::{expected, tiny_generator};
use common::*;
use pipe::GenerationOptions;

/// The complete events ("ph": "X") of the Chrome trace at `path`, by track name ("stage 0",
/// "engine").
fn read_tracks(path: &Path) -> BTreeMap<String, Vec<Value>> {
    let trace = json::parse(&std::fs::read_to_string(path).unwrap());
    let events = trace.get("traceEvents").as_array();
    let mut names = BTreeMap::new();
    for e in events {
        if e.get("ph").as_str() == "M" && e.get("name").as_str() == "thread_name" {
            names.insert(e.get("tid").as_i64(), e.get("args").get("name").as_str().to_string());
        }
    }
    let mut tracks: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.get("ph").as_str() == "X") {
        let track = names.get(&e.get("tid").as_i64()).unwrap_or_else(|| panic!("{e:?} is on a track with no name"));
        tracks.entry(track.clone()).or_default().push(e.clone());
    }
    tracks
}

/// Each of a stage's slices holds its time per operator, no more in all than the slice lasted (+1
/// µs: the slice's bounds are whole microseconds), and the stage's linear layers are keyed by
/// exactly the weight shapes in `want` ("out x in").
fn check_operators(stage: &str, slices: &[Value], want: &[&str]) {
    assert!(!slices.is_empty(), "{stage} has no slices");
    let mut shapes = BTreeSet::new();
    for e in slices {
        let name = e.get("name").as_str();
        let ops = e.get("args").find("operators_us").unwrap_or_else(|| panic!("{stage} slice {name}: no operators_us"));
        assert!(!ops.as_object().is_empty(), "{stage} slice {name}: operators_us is empty");
        let mut sum = 0.0;
        for (key, us) in ops.as_object() {
            assert!(us.as_f64() >= 0.0, "{stage} slice {name}: {key} took {us:?}");
            sum += us.as_f64();
            let (op, shape) = key.split_once(" [").unwrap_or((key, ""));
            // A group of products of one input (q, k, v; gate, up) is one key: "[64x64+32x64+32x64]".
            if op.ends_with("linear") || op.ends_with("linear_group") {
                shapes.extend(shape.trim_end_matches(']').split('+').map(str::to_string));
            }
        }
        let dur = e.get("dur").as_f64();
        assert!(sum <= dur + 1.0, "{stage} slice {name}: operators take {sum} µs of {dur} µs: {ops:?}");
    }
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    assert_eq!(shapes, want, "{stage}'s linear layers' weight shapes");
}

/// The demo (examples/model/make_demo_model.py): blocks of up 256 -> 1024 and down 1024 -> 256,
/// the head 256 -> 10; cut before blocks.2, so the head is stage 1's.
#[test]
fn each_stage_slice_holds_its_operators_time() {
    let session = demo_session(4);
    let path = scratch("trace-operators.json");
    session.trace_start_with_operators().unwrap();
    session.run(&[demo_input()]).unwrap();
    session.trace_stop(Some(&path)).unwrap();
    let tracks = read_tracks(&path);
    assert_eq!(
        tracks.keys().collect::<Vec<_>>(),
        ["stage 0", "stage 1"],
        "the stages' tracks only (a session that is not a generator's has no engine)"
    );
    let stages: [(&str, &[&str]); 2] =
        [("stage 0", &["1024x256", "256x1024"]), ("stage 1", &["1024x256", "256x1024", "10x256"])];
    for (stage, shapes) in stages {
        assert_eq!(tracks[stage].len(), 4, "{stage}: one slice per micro-batch");
        check_operators(stage, &tracks[stage], shapes);
    }

    // A plain trace after it times no operators.
    session.trace_start().unwrap();
    session.run(&[demo_input()]).unwrap();
    session.trace_stop(Some(&path)).unwrap();
    for (stage, slices) in read_tracks(&path) {
        for e in slices {
            assert!(e.get("args").find("operators_us").is_none(), "{stage}: a plain trace with operators_us: {e:?}");
        }
    }
    std::fs::remove_file(&path).unwrap();
}

/// A generator's trace with operators: the engine's track holds one "launch step" slice per step,
/// whose tokens are every token the sequences fed in (each prompt, then each generated token but
/// the last), and each stage one slice per launched step with the tiny decoder's linear layers
/// (tests/models/decoder_models.py: hidden 64, 4 query and 2 key-value heads of 16, MLP 128,
/// vocabulary 128).
#[test]
fn a_generators_trace_has_the_engines_steps() {
    let want = expected();
    let generator = tiny_generator();
    let session = generator.session().unwrap();
    let path = scratch("generate-trace-operators.json");
    session.trace_start_with_operators().unwrap();
    let options = GenerationOptions { max_new_tokens: want.max_new_tokens, ..Default::default() };
    // All at once, so that their steps batch.
    let generations: Vec<_> = want.prompts.iter().map(|p| generator.generate(p, &options).unwrap()).collect();
    let mut fed = 0;
    for (i, generation) in generations.into_iter().enumerate() {
        let tokens = generation.collect::<pipe::Result<Vec<i64>>>().unwrap();
        assert_eq!(tokens, want.greedy[i], "prompt {i}");
        fed += want.prompts[i].len() + tokens.len() - 1;
    }
    session.trace_stop(Some(&path)).unwrap();
    let tracks = read_tracks(&path);
    let launches: Vec<&Value> =
        tracks["engine"].iter().filter(|e| e.get("name").as_str().starts_with("launch step ")).collect();
    let tokens: i64 = launches.iter().map(|e| e.get("args").get("tokens").as_i64()).sum();
    assert!(!launches.is_empty());
    assert_eq!(tokens, fed as i64, "tokens of the engine's launch slices");
    let mut launched: Vec<i64> = launches.iter().map(|e| e.get("args").get("request").as_i64()).collect();
    launched.sort();
    // q and o, k and v, gate and up, down; stage 1's LM head is 128x64 like gate and up.
    let layer = ["64x64", "32x64", "128x64", "64x128"];
    for stage in ["stage 0", "stage 1"] {
        let mut requests: Vec<i64> = tracks[stage].iter().map(|e| e.get("args").get("request").as_i64()).collect();
        requests.sort();
        assert_eq!(requests, launched, "{stage}: one slice per launched step");
        check_operators(stage, &tracks[stage], &layer);
    }
    std::fs::remove_file(&path).unwrap();
}
