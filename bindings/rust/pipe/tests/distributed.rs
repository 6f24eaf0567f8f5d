//! Stages spread over processes: a Gloo session in this test process (rank 0, the driver) whose
//! rank-1 worker is this same test binary run again as a child process in worker mode
//! (`worker_process`, which calls `pipe::run_worker`); a killed worker breaks the session with
//! `Status::Communication`; bad options are `Status::InvalidArgument` with libpipe's message.
//!
//! No port is guessed: the driver's store is given 127.0.0.1:0, picks a free port itself and
//! reports it in libpipe's INFO log message "store listening on HOST:PORT", which the test reads
//! through `pipe::set_log_callback` and only then tells the worker (started beforehand, so its
//! start-up never counts against the session's comm timeout). Every wait is for a state the test
//! can see (a line from the worker, a log message, the worker's exit); the bounds only end a hung
//! test. The logger is process-wide, so the tests that create sessions take turns (`one_driver`).
mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Mutex, MutexGuard, Once};
use std::thread;
use std::time::{Duration, Instant};

use common::gate::WAIT_LIMIT;
use common::*;
use pipe::{LogLevel, Plan, PlanOptions, Session, SessionOptions, Status, Transport, WorkerOptions};

/// A driver's store address: a free port on the loopback interface.
const ANY_PORT: &str = "127.0.0.1:0";
/// The comm timeout of the sessions that are not about timeouts: joining and loading on a loaded
/// machine.
const CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// What a slow machine may add to a comm timeout before a call fails.
const MARGIN: Duration = Duration::from_secs(30);
/// Set to 1, makes `worker_process` serve as a worker (in the child processes).
const WORKER_ENV: &str = "LIBPIPE_RUST_TEST_WORKER";
/// Starts the worker's own lines on its stdout, which libtest shares.
const WORKER_MARK: &str = "pipe-worker: ";

/// What a test waiting for its session hears: the store address libpipe reported, or the end of
/// the session's creation.
enum Event {
    Store(String),
    Created(pipe::Result<Session>),
}

/// Where the log callback sends store reports: the channel of the test that holds `one_driver`.
static STORE_SINK: Mutex<Option<Sender<Event>>> = Mutex::new(None);
static ONE_DRIVER: Mutex<()> = Mutex::new(());
static LOGGER: Once = Once::new();

/// pipe.h's report of the store's address: exactly "store listening on HOST:PORT", at INFO, with
/// the port the store got (never 0).
fn reported_store(message: &str) -> Option<&str> {
    let address = message.strip_prefix("store listening on ")?;
    let (host, port) = address.rsplit_once(':')?;
    let port_ok = !port.starts_with('0') && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    (port_ok && !host.is_empty() && !host.contains(char::is_whitespace)).then_some(address)
}

/// The turn of one test that creates sessions, with its store reports going to `events`. The
/// process-wide log callback is installed once; warnings and errors are printed as the default
/// logger would.
fn one_driver(events: &Sender<Event>) -> MutexGuard<'static, ()> {
    LOGGER.call_once(|| {
        pipe::set_log_callback(
            |level, message| match reported_store(message) {
                Some(store) if level == LogLevel::Info => {
                    if let Some(sink) = STORE_SINK.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                        let _ = sink.send(Event::Store(store.to_owned()));
                    }
                }
                _ if level >= LogLevel::Warning => eprintln!("libpipe {level:?}: {message}"),
                _ => {}
            },
            LogLevel::Info,
        )
        .unwrap();
    });
    // A test that failed while holding the turn poisons it; the next may still run.
    let turn = ONE_DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    *STORE_SINK.lock().unwrap_or_else(|e| e.into_inner()) = Some(events.clone());
    turn
}

/// The worker side, run by the tests below in a child process of this binary: it prints "ready",
/// reads the store's address from stdin, runs `pipe::run_worker` as rank 1 of 2, and prints
/// "finished" when that returned Ok, else "error STATUS MESSAGE". In the test run itself it does
/// nothing.
#[test]
fn worker_process() {
    if std::env::var_os(WORKER_ENV).is_none_or(|v| v != "1") {
        return;
    }
    let say = |line: &str| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{WORKER_MARK}{line}").unwrap();
        out.flush().unwrap();
    };
    say("ready");
    let mut store = String::new();
    std::io::stdin().read_line(&mut store).unwrap();
    match pipe::run_worker(&WorkerOptions::new(1, 2, store.trim()).comm_timeout(CREATE_TIMEOUT)) {
        Ok(()) => say("finished"),
        Err(e) => say(&format!("error {} {}", e.status, e.message)),
    }
}

/// A child process of this test binary in worker mode, killed (if still running) when dropped.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>, // the worker's own lines; disconnected at its end
    stderr: std::path::PathBuf,
}

impl Worker {
    /// Starts a worker and returns once it printed "ready" (libpipe is loaded there).
    fn start(name: &str) -> Worker {
        let stderr = scratch(&format!("{name}.worker.stderr"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "worker_process", "--nocapture", "--test-threads", "1"])
            .env(WORKER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            // libtest's own output shares the stream: only the marked lines are the worker's
            // (libtest may start a line with "test worker_process ... " before one of them).
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Some(at) = line.find(WORKER_MARK) {
                    let _ = tx.send(line[at + WORKER_MARK.len()..].to_owned());
                }
            }
        });
        let mut worker = Worker { child, stdin, lines, stderr };
        let first = worker.next();
        assert_eq!(first.as_deref(), Some("ready"), "the worker did not start; stderr:\n{}", worker.stderr());
        worker
    }

    /// The worker's next line (None once it has none left).
    fn next(&mut self) -> Option<String> {
        match self.lines.recv_timeout(WAIT_LIMIT) {
            Ok(line) => Some(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("no line from the worker within {WAIT_LIMIT:?}; stderr:\n{}", self.stderr())
            }
        }
    }

    /// Gives the waiting worker the address of the store to join.
    fn tell(&mut self, store: &str) {
        writeln!(self.stdin, "{store}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// How the worker ended and the lines it printed meanwhile.
    fn wait(&mut self) -> (ExitStatus, Vec<String>) {
        let mut printed = Vec::new();
        while let Some(line) = self.next() {
            printed.push(line);
        }
        // Its stdout is closed, so it has ended or is ending.
        (self.child.wait().unwrap(), printed)
    }

    fn stderr(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        text[text.len().saturating_sub(4000)..].to_owned()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// demo.pt cut in two before blocks.2.
fn demo_plan() -> Plan {
    let model = pipe::Model::load(fixture("demo.pt")).unwrap();
    let plan = Plan::new(&model, &PlanOptions::new().split_point("blocks.2:begin")).unwrap();
    assert_eq!(plan.num_stages().unwrap(), 2);
    plan
}

/// A Gloo session of `plan` with `options` over this process and `worker` (world size 2, the
/// store on a free port): created on another thread, and `worker` is told the store's address
/// once libpipe reported it. Returns the session, the address, and the driver's turn, which the
/// caller holds while the session lives.
fn gloo_session(
    plan: &Plan,
    worker: &mut Worker,
    options: SessionOptions,
) -> (Session, String, MutexGuard<'static, ()>) {
    let (tx, events) = mpsc::channel();
    let turn = one_driver(&tx);
    let options = options.transport(Transport::Tcp).world_size(2).store(ANY_PORT);
    let store = thread::scope(|scope| {
        scope.spawn(|| tx.send(Event::Created(Session::new(plan, &options))).unwrap());
        let store = match events.recv_timeout(WAIT_LIMIT) {
            Ok(Event::Store(store)) => store,
            Ok(Event::Created(result)) => {
                panic!("Session::new ended without reporting its store's address: {:?}", result.err())
            }
            Err(e) => panic!("Session::new reported no store address: {e}"),
        };
        worker.tell(&store);
        store
    });
    // The scope has joined the creating thread, so its result is in the channel.
    let session = loop {
        match events.try_recv().unwrap() {
            Event::Created(result) => {
                break result.unwrap_or_else(|e| panic!("Session::new: {e}; worker's stderr:\n{}", worker.stderr()))
            }
            Event::Store(other) => panic!("a second store report ({other}) while one session was made"),
        }
    };
    (session, store, turn)
}

#[test]
fn gloo_session_with_a_worker_process_equals_local() {
    let plan = demo_plan();
    let (x, expected) = (demo_input(), demo_reference());
    let local = Session::new(&plan, &SessionOptions::new().microbatches(4)).unwrap();
    local.check().unwrap(); // a local session never breaks
    let want = named(local.run(&[&x]).unwrap(), "output");
    drop(local);

    let mut worker = Worker::start("equals-local");
    let options = SessionOptions::new().microbatches(4).comm_timeout(CREATE_TIMEOUT);
    let (session, store, _turn) = gloo_session(&plan, &mut worker, options);
    assert!(store.starts_with("127.0.0.1:") && store != ANY_PORT, "the store reported {store}");
    assert_eq!(session.num_stages().unwrap(), 2);
    session.check().unwrap();
    let out = named(session.run(&[&x]).unwrap(), "output");
    let diff = max_abs_diff(&out, &expected);
    assert!(diff <= 1e-4, "max |diff| vs PyTorch = {diff}");
    // The same arithmetic as in one process, only moved.
    assert_eq!(out.as_slice::<f32>().unwrap(), want.as_slice::<f32>().unwrap());
    // Several calls at once.
    let requests: Vec<_> = (0..3).map(|_| session.submit(&[&x]).unwrap()).collect();
    for request in requests {
        let diff = max_abs_diff(&named(request.wait(Some(WAIT_LIMIT)).unwrap(), "output"), &expected);
        assert!(diff <= 1e-4, "submitted call: max |diff| vs PyTorch = {diff}");
    }
    session.check().unwrap();

    // Dropping the session ends the worker's run_worker with Ok.
    drop(session);
    let (status, printed) = worker.wait();
    assert!(status.success() && printed == ["finished"], "worker: {status}, {printed:?}; stderr:\n{}", worker.stderr());
}

#[test]
fn killed_worker_breaks_the_session() {
    let plan = demo_plan();
    let (x, expected) = (demo_input(), demo_reference());
    let mut worker = Worker::start("killed");
    let options = SessionOptions::new().microbatches(2).comm_timeout(CREATE_TIMEOUT);
    let (session, _, _turn) = gloo_session(&plan, &mut worker, options);
    // The session is established: a call went through the worker's stage.
    let diff = max_abs_diff(&named(session.run(&[&x]).unwrap(), "output"), &expected);
    assert!(diff <= 1e-4, "max |diff| vs PyTorch = {diff}");
    session.check().unwrap();

    worker.child.kill().unwrap();
    let (status, _) = worker.wait(); // it is gone once reaped
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "the worker ended with {status}");

    let e = session.run(&[&x]).unwrap_err();
    assert_eq!(e.status, Status::Communication, "the call after the worker died: {e}");
    assert!(e.message.contains("rank 1"), "{e}");
    let e = session.check().unwrap_err();
    assert_eq!(e.status, Status::Communication, "check after the worker died: {e}");
    assert!(!e.message.is_empty());
    // Broken for good: every later call fails at once with the same status.
    let e = session.submit(&[&x]).and_then(|r| r.wait(Some(WAIT_LIMIT))).unwrap_err();
    assert_eq!(e.status, Status::Communication, "{e}");
}

#[test]
fn driver_without_workers_names_the_missing_rank() {
    let plan = demo_plan();
    let (tx, events) = mpsc::channel();
    let _turn = one_driver(&tx);
    let started = Instant::now();
    let options = SessionOptions::new()
        .transport(Transport::Tcp)
        .world_size(2)
        .store(ANY_PORT)
        .comm_timeout(Duration::from_secs(1));
    let e = Session::new(&plan, &options).err().expect("a session without its worker");
    assert_eq!(e.status, Status::Communication, "{e}");
    // A comm timeout that did not reach libpipe would be its one-minute default.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1) + MARGIN, "Session::new gave up after {took:?} with a 1 s comm timeout");
    let Ok(Event::Store(store)) = events.try_recv() else { panic!("no store address was reported") };
    assert!(e.message.contains("rank 1") && e.message.contains(&format!("--store {store}`")), "{e}");
}

#[test]
fn distributed_session_option_errors() {
    let plan = demo_plan();
    let (tx, _events) = mpsc::channel();
    let _turn = one_driver(&tx); // a session that got as far as its store would report it
    let refused = |what: &str, options: SessionOptions, want: &str| {
        let e = Session::new(&plan, &options).err().unwrap_or_else(|| panic!("{what}: a session was made"));
        assert_eq!(e.status, Status::InvalidArgument, "{what}: {e}");
        assert!(e.message.contains(want), "{what}: the message {:?} does not say {want:?}", e.message);
    };
    let gloo = |world_size: usize, store: &str| {
        SessionOptions::new()
            .transport(Transport::Tcp)
            .world_size(world_size)
            .store(store)
            .comm_timeout(Duration::from_secs(1))
    };
    refused("local over 2 processes", SessionOptions::new().world_size(2), "local transport");
    refused("no store", SessionOptions::new().transport(Transport::Tcp).world_size(2), "store");
    refused("a store without a port", gloo(2, "no-port"), "HOST:PORT");
    refused("a store with a NUL byte", gloo(2, "127.0.0.1:1\0"), "NUL");
    refused("a store with the local transport", SessionOptions::new().store(ANY_PORT), "transport is local");
    refused("world size 0", gloo(0, ANY_PORT), "world_size >= 2");
    refused("world size 1", gloo(1, ANY_PORT), "world_size >= 2");
    refused("world size beyond i32", gloo(usize::MAX, ANY_PORT), "world_size");
    refused("more processes than stages", gloo(3, ANY_PORT), "3 processes");
    refused("a zero comm timeout", gloo(2, ANY_PORT).comm_timeout(Duration::ZERO), "comm_timeout must be positive");
    refused("a huge comm timeout", gloo(2, ANY_PORT).comm_timeout(Duration::from_secs(1 << 40)), "at most");
    // An unknown transport can only come from a name.
    let e = "udp".parse::<Transport>().unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("\"udp\"") && e.message.contains("tcp"), "{e}");
    assert_eq!("gloo".parse::<Transport>(), Ok(Transport::Tcp));
}

/// A port on 127.0.0.1 where nothing listens while the returned socket is open: it is bound but
/// never listens, so connections are refused and no other process can take the port.
fn refused_port() -> (libc::c_int, u16) {
    // SAFETY: plain socket calls on a socket this function owns; the address structs are
    // initialised and as large as the lengths passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len), 0, "bind");
        let mut got = len;
        assert_eq!(libc::getsockname(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut got), 0, "getsockname");
        (fd, u16::from_be(addr.sin_port))
    }
}

#[test]
fn run_worker_errors() {
    const STORE: &str = "127.0.0.1:1"; // refused before any store is looked for
    let refused = |what: &str, options: WorkerOptions, want: &str| {
        let e = pipe::run_worker(&options).unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument, "{what}: {e}");
        assert!(e.message.contains(want), "{what}: the message {:?} does not say {want:?}", e.message);
    };
    let worker = |rank: usize, world_size: usize, store: &str| {
        WorkerOptions::new(rank, world_size, store).comm_timeout(Duration::from_millis(500))
    };
    for rank in [0, 2] {
        refused(&format!("rank {rank} of 2"), worker(rank, 2, STORE), "rank");
    }
    refused("rank beyond i32", worker(usize::MAX, 2, STORE), "rank");
    refused("world size 1", worker(1, 1, STORE), "world size");
    refused("world size 0", worker(1, 0, STORE), "world size");
    refused("no store", worker(1, 2, ""), "options->store"); // and no LIBPIPE_STORE
    refused("a store without a port", worker(1, 2, "no-port"), "HOST:PORT");
    refused("a store with a NUL byte", worker(1, 2, "127.0.0.1:1\0"), "NUL");
    // Port 0 lets a driver's store pick one; a worker needs the port the store got.
    refused("port 0", worker(1, 2, ANY_PORT), "port 0");
    refused("a zero comm timeout", worker(1, 2, STORE).comm_timeout(Duration::ZERO), "comm_timeout");
    refused("threads beyond i32", worker(1, 2, STORE).threads_per_stage(usize::MAX), "threads_per_stage");

    // No store where the address points: Communication naming it, once the comm timeout is over.
    let (fd, port) = refused_port();
    let address = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let e = pipe::run_worker(&worker(1, 2, &address)).unwrap_err();
    // SAFETY: fd is the socket refused_port opened, closed once.
    unsafe { libc::close(fd) };
    assert_eq!(e.status, Status::Communication, "{e}");
    assert!(e.message.contains(&address), "{e}");
    // A comm timeout that did not reach libpipe would be its one-minute default.
    let took = started.elapsed();
    assert!(took < Duration::from_millis(500) + MARGIN, "run_worker gave up after {took:?} with a 500 ms comm timeout");
}

#[test]
fn store_reports_are_parsed_exactly() {
    assert_eq!(reported_store("store listening on 127.0.0.1:29500"), Some("127.0.0.1:29500"));
    assert_eq!(reported_store("store listening on [::1]:80"), Some("[::1]:80"));
    for other in [
        "store listening on 127.0.0.1:0",
        "store listening on 127.0.0.1:",
        "listening on h:1",
        "store listening on h:1x",
    ] {
        assert_eq!(reported_store(other), None, "{other}");
    }
}
