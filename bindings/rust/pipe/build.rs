//! Gives this crate's own test and example binaries an rpath to the libpipe that pipe-sys found
//! (pipe-sys passes its folder as DEP_PIPE_LIBDIR), so `cargo test` runs without
//! LD_LIBRARY_PATH. Binaries of other packages that use this crate find libpipe.so the usual
//! way: an installed library, LD_LIBRARY_PATH, or their own rpath.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_PIPE_LIBDIR");
    if let Ok(libdir) = std::env::var("DEP_PIPE_LIBDIR") {
        // Reaches only this package's own binaries (its unit and integration tests).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}
