//! Generates the Status enum and its tables (src/error.rs includes them) from the pipe.h that
//! pipe-sys read, with the generator the three bindings share (bindings/codegen/pipe_constants.py,
//! run with $LIBPIPE_PYTHON or python3), so that the Rust status codes cannot drift from the header.
//!
//! Also gives this crate's own test and example binaries an rpath to the libpipe that pipe-sys
//! found (pipe-sys passes its folder as DEP_PIPE_LIBDIR), so `cargo test` runs without
//! LD_LIBRARY_PATH. Binaries of other packages that use this crate find libpipe.so the usual
//! way: an installed library, LD_LIBRARY_PATH, or their own rpath.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_PIPE_LIBDIR");
    if let Ok(libdir) = env::var("DEP_PIPE_LIBDIR") {
        // Reaches only this package's own binaries (its unit and integration tests).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    generate_status_table();
}

fn generate_status_table() {
    println!("cargo:rerun-if-env-changed=DEP_PIPE_INCLUDE");
    println!("cargo:rerun-if-env-changed=LIBPIPE_PYTHON");
    let include =
        env::var_os("DEP_PIPE_INCLUDE").expect("pipe: pipe-sys did not say where pipe.h is (DEP_PIPE_INCLUDE)");
    let header = Path::new(&include).join("pipe").join("pipe.h");
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../codegen/pipe_constants.py");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("status.rs");
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rerun-if-changed={}", generator.display());
    let python = env::var_os("LIBPIPE_PYTHON").unwrap_or_else(|| "python3".into());
    let status = Command::new(&python).arg(&generator).arg("rust").arg(&header).arg(&out).status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("pipe: {} failed on {} ({s}); its message is above", generator.display(), header.display()),
        Err(e) => panic!(
            "pipe: cannot run {python:?} ({e}): building this crate runs {} with Python 3 to generate its status \
             table from pipe.h; install python3 or set LIBPIPE_PYTHON",
            generator.display()
        ),
    }
}
