//! The test side of the test gate (tests/gate/gate_op.cpp in the libpipe repository): an
//! operator that holds a stage of the gated test model until the test opens it, so that a test
//! waits for a state it can see ("the call is held in stage 0") instead of guessing how long
//! some work takes on a loaded machine.
//!
//! ```text
//! let key = Key::new();                     // one per call to hold; its value is input n
//! key.wait("stage0", ARRIVED, 1);           // a micro-batch is held in stage 0
//! key.open();                               // every stage (open_stage: one)
//! ```
//!
//! The protocol is files in one folder (LIBPIPE_TEST_GATE_DIR): the operator creates
//! `gate-<key>.<stage>.arrived.<pid>.<seq>` when a micro-batch reaches the gate, waits for
//! `gate-<key>.open` or `gate-<key>.<stage>.open`, then creates `gate-<key>.<stage>.left.<pid>.<seq>`.

use std::ffi::{CStr, CString, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

/// What a micro-batch has done at a gate.
pub const ARRIVED: &str = "arrived";
pub const LEFT: &str = "left";

/// Bounds every wait here. Waits are for states the test itself brings about, so the bound only
/// ends a broken (hung) test; it never decides a verdict.
pub const WAIT_LIMIT: Duration = Duration::from_secs(300);

/// This process's gate folder, made once (before the first gated model is loaded).
struct Gate {
    dir: PathBuf,
    last_key: AtomicI64,
}

static GATE: OnceLock<Gate> = OnceLock::new();

fn gate() -> &'static Gate {
    GATE.get_or_init(Gate::init)
}

/// Loads the operator library and sets up the gate folder; call before loading the gated model.
pub fn init() {
    gate();
}

impl Gate {
    fn init() -> Gate {
        load_library(&library());
        // A folder of its own per process: keys start at 1 in every test binary, so a folder
        // shared with another one would find that binary's gates already open.
        let parent = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pipe-tests");
        std::fs::create_dir_all(&parent).unwrap();
        let dir = make_temp_dir(&parent.join("gate-XXXXXX"));
        // The operator reads this with getenv when a gated stage runs. Set once, before this
        // process's first gated session, and never changed.
        std::env::set_var("LIBPIPE_TEST_GATE_DIR", &dir);
        Gate { dir, last_key: AtomicI64::new(0) }
    }
}

/// LIBPIPE_TEST_GATE_LIB if set, else the copy in the fixtures folder (tests/bindings/stage.cmake
/// puts it beside the gated model).
fn library() -> PathBuf {
    match std::env::var_os("LIBPIPE_TEST_GATE_LIB") {
        Some(lib) if !lib.is_empty() => PathBuf::from(lib),
        _ => super::fixture("libpipe_test_gate.so"),
    }
}

/// dlopen(RTLD_NOW | RTLD_GLOBAL): the library's TORCH_LIBRARY registration runs into the
/// LibTorch libpipe already loaded, so that libpipe resolves libpipe_test::gate in the model. The
/// handle is kept for the whole process.
fn load_library(path: &Path) {
    let c_path = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C string; dlerror is read on the same thread right after the failure.
    unsafe {
        if libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL).is_null() {
            let why = libc::dlerror();
            let why = if why.is_null() { "unknown error".into() } else { CStr::from_ptr(why).to_string_lossy() };
            panic!("cannot load the test gate's operator library {}: {why}", path.display());
        }
    }
}

fn make_temp_dir(template: &Path) -> PathBuf {
    let mut bytes = CString::new(template.as_os_str().as_bytes()).unwrap().into_bytes_with_nul();
    // SAFETY: a writable NUL-terminated template ending in XXXXXX, which mkdtemp fills in.
    let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    assert!(!made.is_null(), "mkdtemp {}: {}", template.display(), std::io::Error::last_os_error());
    bytes.pop(); // the NUL
    PathBuf::from(OsString::from_vec(bytes))
}

/// A gate key of this process (> 0; 0 passes every gate). Dropping it opens all its gates, so a
/// test that fails with a call held never leaves its session's drop waiting for the gate's own
/// time limit: declare the key after the session, so that it is dropped first.
pub struct Key(i64);

impl Key {
    pub fn new() -> Key {
        Key(gate().last_key.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// The value to pass as the gated model's input n.
    pub fn value(&self) -> i64 {
        self.0
    }

    /// How many micro-batches of this key's calls have `what` (ARRIVED or LEFT) the gate of `stage`.
    pub fn count(&self, stage: &str, what: &str) -> usize {
        let prefix = format!("gate-{}.{stage}.{what}.", self.0);
        std::fs::read_dir(&gate().dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().as_bytes().starts_with(prefix.as_bytes()))
            .count()
    }

    /// Returns once at least `count` micro-batches of this key's calls have `what` the gate of `stage`.
    pub fn wait(&self, stage: &str, what: &str, count: usize) {
        wait_until(
            || self.count(stage, what) >= count,
            || {
                format!(
                    "gate {} ({stage}): {} micro-batches {what}, waited for {count}",
                    self.0,
                    self.count(stage, what)
                )
            },
        );
    }

    /// Opens this key's gate of every stage.
    pub fn open(&self) {
        touch(&gate().dir.join(format!("gate-{}.open", self.0)));
    }

    /// Opens this key's gate of one stage.
    pub fn open_stage(&self, stage: &str) {
        touch(&gate().dir.join(format!("gate-{}.{stage}.open", self.0)));
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.open();
    }
}

fn touch(path: &Path) {
    std::fs::File::create(path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
}

/// Returns once `done()` holds; panics with `what()` if it still does not after WAIT_LIMIT.
pub fn wait_until(mut done: impl FnMut() -> bool, what: impl Fn() -> String) {
    let give_up = Instant::now() + WAIT_LIMIT;
    while !done() {
        assert!(Instant::now() < give_up, "gave up after {WAIT_LIMIT:?}: {}", what());
        // The operator itself looks every 2 ms.
        thread::sleep(Duration::from_millis(2));
    }
}
