//! Finds the installed libpipe with pkg-config, generates Rust declarations for pipe.h with
//! bindgen, and tells cargo to link `-lpipe`.
//!
//! Environment:
//!   PKG_CONFIG_PATH       where libpipe.pc lives (e.g. PREFIX/lib/pkgconfig)
//!   DLPACK_INCLUDE_DIR    the folder holding dlpack/dlpack.h, when it is not in libpipe's include
//!                         paths nor in /usr/include (Debian's libdlpack-dev)

use std::env;
use std::path::{Path, PathBuf};

/// The oldest libpipe whose pipe.h has every field, constant and function these crates use (the
/// safe crate starts every versioned struct with pipe_*_init, new in 0.6, and its request futures
/// use pipe_request_on_done and pipe_request_fd, new in 0.7, it binds the generation functions,
/// new in 0.8, pipe_session_trace_start_with_operators, new in 0.9, pipe_model_format, new in
/// 0.10, the tokenizer functions, new in 0.14, and pipe_generation_options.prompt_logprobs with
/// pipe_generation_prompt_logprobs, new in 0.15, pipe_stage_options.quantize_head, new in 0.16, and
/// pipe_stage_options.quantize_embedding, new in 0.17).
const MIN_LIBPIPE: &str = "0.17";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DLPACK_INCLUDE_DIR");

    // pkg-config prints cargo:rustc-link-search / cargo:rustc-link-lib=pipe itself. An older
    // pipe.h would lack what the safe crate calls (pipe_*_init, pipe_request_on_done), so require
    // MIN_LIBPIPE here and fail with a clear message rather than a missing function.
    let lib = match pkg_config::Config::new().atleast_version(MIN_LIBPIPE).probe("libpipe") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "pipe-sys: libpipe >= {MIN_LIBPIPE} not found with pkg-config ({e}).\n\
             Install libpipe and point PKG_CONFIG_PATH at PREFIX/lib/pkgconfig."
        ),
    };

    let header =
        lib.include_paths.iter().map(|dir| dir.join("pipe").join("pipe.h")).find(|p| p.is_file()).unwrap_or_else(
            || panic!("pipe-sys: pipe/pipe.h is in none of libpipe's include paths {:?}", lib.include_paths),
        );

    // pipe.h includes <dlpack/dlpack.h>. It comes from libdlpack-dev in /usr/include, which is a
    // default search path anyway; -idirafter keeps it behind clang's own headers (stddef.h), so
    // naming it explicitly cannot reorder the system include search.
    let dlpack_dir =
        env::var_os("DLPACK_INCLUDE_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/usr/include"));

    let builder = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_args(lib.include_paths.iter().map(|p| format!("-I{}", p.display())))
        .clang_arg(format!("-idirafter{}", dlpack_dir.display()))
        .allowlist_function("pipe_.*")
        .allowlist_type("pipe_.*")
        .allowlist_var("PIPE_.*")
        .allowlist_type("DL.*")
        .allowlist_var("DLPACK_.*")
        // Status codes, PIPE_CHUNK_*, PIPE_DTYPE_*, ... are used as int32_t in pipe.h.
        .default_macro_constant_type(bindgen::MacroTypeVariation::Signed)
        // DLDeviceType / DLDataTypeCode as modules of constants: a C value outside the Rust
        // enum's variants can never become undefined behaviour.
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .derive_default(true)
        .layout_tests(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &lib.include_paths {
        println!("cargo:rerun-if-changed={}", dir.join("pipe").join("pipe.h").display());
    }
    let bindings = builder.generate().expect("pipe-sys: bindgen failed on pipe.h");

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("pipe-sys: cannot write bindings.rs");

    // Dependents with a build script read these as DEP_PIPE_LIBDIR / DEP_PIPE_INCLUDE (the
    // safe crate uses the first to give its own tests an rpath).
    if let Some(libdir) = lib.link_paths.first() {
        println!("cargo:libdir={}", libdir.display());
        rpath_for_own_tests(libdir);
    }
    if let Some(dir) = header.parent().and_then(Path::parent) {
        println!("cargo:include={}", dir.display());
    }
}

/// `cargo test -p pipe-sys` links its test binary against libpipe.so; an rpath lets it start
/// without LD_LIBRARY_PATH. (rustc-link-arg only reaches this package's own binaries, never
/// those of dependents, and does nothing for the rlib itself.)
fn rpath_for_own_tests(libdir: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", libdir.display());
}
