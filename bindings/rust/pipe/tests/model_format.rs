//! Model::format (pipe_model_format, libpipe >= 0.10): what kind of file a model was loaded from,
//! decided by the file's content, never its name.
mod common;

use std::path::PathBuf;

use common::*;
use pipe::{Model, ModelFormat};

#[test]
fn torchscript_archive() {
    let model = Model::load(fixture("demo.pt")).unwrap();
    assert_eq!(model.format().unwrap(), ModelFormat::TorchScript);
    assert_eq!(ModelFormat::TorchScript.to_string(), "torchscript");
}

#[test]
fn content_decides_not_the_name() {
    // A TorchScript archive called .pt2 is still TorchScript.
    let renamed = scratch("demo-renamed.pt2");
    std::fs::copy(fixture("demo.pt"), &renamed).unwrap();
    let format = Model::load(&renamed).unwrap().format().unwrap();
    std::fs::remove_file(&renamed).unwrap();
    assert_eq!(format, ModelFormat::TorchScript);
}

#[test]
fn exported_program() {
    assert_eq!(ModelFormat::Exported.to_string(), "exported");
    assert_ne!(ModelFormat::Exported, ModelFormat::TorchScript);
    // The staged torch.export program (tests/bindings/stage.cmake copies it from the build's test
    // models); skipped, saying so, when the fixtures have none.
    let dir = std::env::var_os("LIBPIPE_FIXTURES")
        .expect("LIBPIPE_FIXTURES must name the fixture folder (run-tests.sh sets it)");
    let path = PathBuf::from(dir).join("exported").join("multi_mlp.pt2");
    if !path.is_file() {
        eprintln!(
            "SKIPPED exported_program: no exported fixture {} (tests/bindings/stage.cmake copies \
             exported/multi_mlp.pt2 once the build makes it)",
            path.display()
        );
        return;
    }
    let model = Model::load(&path).unwrap();
    assert_eq!(model.format().unwrap(), ModelFormat::Exported);
    assert!(model.num_inputs().unwrap() > 0, "{}: the exported program reports no inputs", path.display());
}
