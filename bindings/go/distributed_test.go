package pipe_test

// Stages spread over processes: a Gloo session in this test process (rank 0, the driver) whose
// rank-1 worker is this same test binary run again as a child process in worker mode
// (TestWorkerProcess, which calls pipe.RunWorker); a killed worker breaks the session with
// ErrCommunication; bad options are ErrInvalidArgument with libpipe's message.
//
// No port is guessed: the driver's store is given 127.0.0.1:0, picks a free port itself and
// reports it in libpipe's INFO log message "store listening on HOST:PORT", which the test reads
// through pipe.SetLogCallback and only then tells the worker (started beforehand, so its start-up
// never counts against the session's CommTimeout). Every wait is for a state the test can see
// (a line from the worker, a log message, the worker's exit); the bounds only end a hung test.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/libpipe/libpipe/bindings/go/internal/testgate"
)

const (
	anyPort = "127.0.0.1:0" // a driver's store address: a free port on the loopback interface
	// createTimeout is the CommTimeout of the sessions that are not about timeouts: joining and
	// loading on a loaded machine.
	createTimeout = 60 * time.Second
	// margin is what a slow machine may add to a CommTimeout before a call fails.
	margin = 30 * time.Second
	// workerEnv set to 1 makes TestWorkerProcess serve as a worker (in the child processes).
	workerEnv = "LIBPIPE_GO_TEST_WORKER"
)

// storeListening is pipe.h's report of the store's address (exactly this message, at INFO); the
// port it got is never 0. HOST is a name, an IPv4 address or a bracketed IPv6 address.
var storeListening = regexp.MustCompile(`^store listening on ((?:\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):[1-9][0-9]*)$`)

// storeReports installs a log callback for the test that passes on every store address libpipe
// reports (at INFO), and prints warnings and errors as the default logger would. The callback
// never blocks libpipe's thread: reports beyond the channel's room are dropped.
func storeReports(t *testing.T) <-chan string {
	t.Helper()
	stores := make(chan string, 16)
	err := pipe.SetLogCallback(func(level pipe.LogLevel, message string) {
		if m := storeListening.FindStringSubmatch(message); m != nil && level == pipe.LogInfo {
			select {
			case stores <- m[1]:
			default:
			}
		} else if level >= pipe.LogWarning {
			fmt.Fprintf(os.Stderr, "libpipe %v: %s\n", level, message)
		}
	}, pipe.LogInfo)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pipe.ResetLogCallback(); err != nil {
			t.Error(err)
		}
	})
	return stores
}

// TestWorkerProcess is the worker side, run by the tests below in a child process of this
// binary: it prints "ready", reads the store's address from stdin, runs pipe.RunWorker as rank 1
// of 2, and prints "finished" when it returned nil, else "error STATUS MESSAGE". In the test run
// itself it is skipped.
func TestWorkerProcess(t *testing.T) {
	if os.Getenv(workerEnv) != "1" {
		t.Skip("the worker of the distributed tests; runs in the child processes they start")
	}
	fmt.Println("ready")
	line, err := bufio.NewReader(os.Stdin).ReadString('\n')
	if err != nil {
		fmt.Printf("error reading the store address: %v\n", err)
		return
	}
	err = pipe.RunWorker(&pipe.WorkerOptions{
		Rank: 1, WorldSize: 2, Store: strings.TrimSpace(line), CommTimeout: createTimeout,
	})
	var pe *pipe.Error
	switch {
	case err == nil:
		fmt.Println("finished")
	case errors.As(err, &pe):
		fmt.Printf("error %v %s\n", pe.Status, pe.Message)
	default:
		fmt.Printf("error %v\n", err)
	}
}

// worker is a child process of this test binary in worker mode.
type worker struct {
	cmd        *exec.Cmd
	stdin      io.WriteCloser
	lines      chan string // the child's stdout, line by line; closed at its end
	stderrPath string
	exited     bool
}

// startWorker starts a worker and returns once it printed "ready" (libpipe is loaded there). It
// is killed, if still running, when the test ends.
func startWorker(t *testing.T) *worker {
	t.Helper()
	stderrPath := filepath.Join(t.TempDir(), "worker.stderr")
	stderr, err := os.Create(stderrPath)
	if err != nil {
		t.Fatal(err)
	}
	defer stderr.Close() // the child has its own copy
	cmd := exec.Command(os.Args[0], "-test.run=^TestWorkerProcess$", "-test.count=1")
	// The worker needs neither the fixtures nor the test gate (TestMain loads the gate only
	// where it finds its library, and would leave a gate folder behind a killed child).
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "LIBPIPE_TEST_GATE_LIB=") || strings.HasPrefix(kv, "LIBPIPE_FIXTURES=")
	})
	cmd.Env = append(cmd.Env, workerEnv+"=1")
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &worker{cmd: cmd, stdin: stdin, lines: make(chan string, 64), stderrPath: stderrPath}
	go func() {
		scanner := bufio.NewScanner(stdout)
		for scanner.Scan() {
			w.lines <- scanner.Text()
		}
		close(w.lines)
	}()
	t.Cleanup(func() {
		if !w.exited {
			w.cmd.Process.Kill()
			w.wait(t)
		}
	})
	if line := w.next(t); line != "ready" {
		t.Fatalf("the worker did not start: %q; stderr:\n%s", line, w.stderr())
	}
	return w
}

// next is the worker's next line of output ("" once it has none left).
func (w *worker) next(t *testing.T) string {
	t.Helper()
	select {
	case line := <-w.lines:
		return line
	case <-time.After(testgate.WaitLimit):
		t.Fatalf("no line from the worker within %v; stderr:\n%s", testgate.WaitLimit, w.stderr())
		return ""
	}
}

// tell gives a waiting worker the address of the store to join.
func (w *worker) tell(t *testing.T, store string) {
	t.Helper()
	if _, err := io.WriteString(w.stdin, store+"\n"); err != nil {
		t.Fatalf("telling the worker the store: %v; stderr:\n%s", err, w.stderr())
	}
}

// wait reads the worker's remaining output, reaps it and returns how it ended and what it
// printed (the framework's own lines, "PASS" and the like, left out).
func (w *worker) wait(t *testing.T) (*os.ProcessState, []string) {
	t.Helper()
	var printed []string
	for line := range w.lines {
		if line != "PASS" && !strings.HasPrefix(line, "ok ") {
			printed = append(printed, line)
		}
	}
	done := make(chan error, 1)
	go func() { done <- w.cmd.Wait() }()
	receive(t, done, "the worker's exit")
	w.exited = true
	return w.cmd.ProcessState, printed
}

func (w *worker) stderr() string {
	b, _ := os.ReadFile(w.stderrPath)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// newGlooSession creates a Gloo session of plan with opts over this process and w (world size
// 2, the store on a free port): NewSession runs on another goroutine, and w is told the store's
// address once libpipe reported it. Returns the session (closed when the test ends) and the
// address.
func newGlooSession(t *testing.T, plan *pipe.Plan, w *worker, opts pipe.SessionOptions) (*pipe.Session, string) {
	t.Helper()
	stores := storeReports(t)
	opts.Transport, opts.WorldSize, opts.Store = pipe.TransportTCP, 2, anyPort
	type created struct {
		session *pipe.Session
		err     error
	}
	done := make(chan created, 1)
	go func() {
		s, err := plan.NewSession(&opts)
		done <- created{s, err}
	}()
	var store string
	select {
	case store = <-stores:
	case c := <-done:
		if c.session != nil {
			c.session.Close()
		}
		t.Fatalf("NewSession ended without reporting its store's address: %v", c.err)
	case <-time.After(testgate.WaitLimit):
		t.Fatalf("NewSession reported no store address within %v", testgate.WaitLimit)
	}
	w.tell(t, store)
	c := receive(t, done, "NewSession")
	if c.err != nil {
		t.Fatalf("NewSession: %v; worker's stderr:\n%s", c.err, w.stderr())
	}
	t.Cleanup(func() { c.session.Close() })
	return c.session, store
}

func TestGlooSessionWithAWorkerProcess(t *testing.T) {
	d := newDemo(t, 4) // its local session gives the reference
	if d.plan.NumStages() != 2 {
		t.Fatalf("the demo plan has %d stages, want 2", d.plan.NumStages())
	}
	if err := d.session.Check(); err != nil {
		t.Fatalf("a local session reports itself broken: %v", err)
	}
	local := must(d.session.Run(context.Background(), d.x))(t).Get("output")

	w := startWorker(t)
	session, store := newGlooSession(t, d.plan, w, pipe.SessionOptions{Microbatches: 4, CommTimeout: createTimeout})
	if !strings.HasPrefix(store, "127.0.0.1:") || store == anyPort {
		t.Fatalf("the store reported %q, want 127.0.0.1 with the port it got", store)
	}
	if session.NumStages() != 2 {
		t.Fatalf("the session has %d stages, want 2", session.NumStages())
	}
	if err := session.Check(); err != nil {
		t.Fatalf("Check before any call: %v", err)
	}
	out := must(session.Run(context.Background(), d.x))(t).Get("output")
	if diff := maxAbsDiff(t, out, d.expected); diff > 1e-4 {
		t.Fatalf("max |diff| vs PyTorch = %g", diff)
	}
	// The same arithmetic as in one process, only moved.
	if !slices.Equal(out.Float32s(), local.Float32s()) {
		t.Fatal("the Gloo session's output differs from the local session's")
	}
	// Several calls at once, through Submit and a cancellable context.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var requests []*pipe.Request
	for range 3 {
		r := must(session.Submit(ctx, d.x))(t)
		defer r.Close()
		requests = append(requests, r)
	}
	for _, r := range requests {
		if diff := maxAbsDiff(t, must(r.Wait())(t).Get("output"), d.expected); diff > 1e-4 {
			t.Fatalf("submitted call: max |diff| vs PyTorch = %g", diff)
		}
	}
	if err := session.Check(); err != nil {
		t.Fatalf("Check after the calls: %v", err)
	}

	// Closing the session ends the worker's RunWorker with nil.
	session.Close()
	state, printed := w.wait(t)
	if !state.Success() || !slices.Equal(printed, []string{"finished"}) {
		t.Fatalf("worker: %v, printed %q; stderr:\n%s", state, printed, w.stderr())
	}
}

func TestKilledWorkerBreaksTheSession(t *testing.T) {
	d := newDemo(t, 2)
	w := startWorker(t)
	session, _ := newGlooSession(t, d.plan, w, pipe.SessionOptions{Microbatches: 2, CommTimeout: createTimeout})
	// The session is established: a call went through the worker's stage.
	if diff := maxAbsDiff(t, must(session.Run(context.Background(), d.x))(t).Get("output"), d.expected); diff > 1e-4 {
		t.Fatalf("max |diff| vs PyTorch = %g", diff)
	}
	if err := session.Check(); err != nil {
		t.Fatalf("Check while the worker lives: %v", err)
	}

	if err := w.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	state, _ := w.wait(t) // it is gone once reaped
	if ws, ok := state.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the worker ended with %v, not SIGKILL", state)
	}

	_, err := session.Run(context.Background(), d.x)
	if pe := asError(t, err, pipe.StatusCommunication); !errors.Is(err, pipe.ErrCommunication) ||
		!strings.Contains(pe.Message, "rank 1") {
		t.Fatalf("the call after the worker died: %v", err)
	}
	err = session.Check()
	if pe := asError(t, err, pipe.StatusCommunication); pe.Op != "pipe_session_check" {
		t.Fatalf("Check after the worker died: %v", err)
	}
	// Broken for good: every later call fails at once with the same status.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err = session.Run(ctx, d.x)
	asError(t, err, pipe.StatusCommunication)
	if err := session.Close(); err != nil {
		t.Fatal(err)
	}
	if err := session.Check(); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("Check on a closed session: %v", err)
	}
}

func TestDriverWithoutWorkersNamesTheMissingRank(t *testing.T) {
	d := newDemo(t, 1)
	stores := storeReports(t)
	started := time.Now()
	_, err := d.plan.NewSession(&pipe.SessionOptions{
		Transport: pipe.TransportTCP, WorldSize: 2, Store: anyPort, CommTimeout: time.Second,
	})
	pe := asError(t, err, pipe.StatusCommunication)
	// A CommTimeout that did not reach libpipe would be its one-minute default.
	if took := time.Since(started); took > time.Second+margin {
		t.Fatalf("NewSession gave up after %v with a CommTimeout of 1s", took)
	}
	store := receive(t, stores, "the store's address")
	if store == anyPort || !strings.Contains(pe.Message, "rank 1") ||
		!strings.Contains(pe.Message, "--store "+store+"`") {
		t.Fatalf("the message should name rank 1 and how to start it with --store %s: %q", store, pe.Message)
	}
}

func TestDistributedSessionOptionErrors(t *testing.T) {
	d := newDemo(t, 1)
	// checked makes a session with opts, which must fail with ErrInvalidArgument and a message
	// containing want.
	checked := func(what string, opts pipe.SessionOptions, want string) {
		t.Helper()
		s, err := d.plan.NewSession(&opts)
		if s != nil {
			s.Close()
		}
		if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, want) {
			t.Errorf("%s: the message %q does not say %q", what, pe.Message, want)
		}
	}
	gloo := func(worldSize int, store string) pipe.SessionOptions {
		return pipe.SessionOptions{Transport: pipe.TransportTCP, WorldSize: worldSize, Store: store,
			CommTimeout: time.Second}
	}
	checked("local over 2 processes", pipe.SessionOptions{WorldSize: 2}, "local transport")
	checked("an unknown transport", pipe.SessionOptions{Transport: 7, WorldSize: 2, Store: anyPort}, "transport is 7")
	checked("no store", gloo(2, ""), "store")
	checked("a store without a port", gloo(2, "no-port"), "HOST:PORT")
	checked("a store with a NUL byte", gloo(2, "127.0.0.1:1\x00"), "NUL")
	checked("a store with the local transport", pipe.SessionOptions{Store: anyPort}, "transport is local")
	checked("world size 0", gloo(0, anyPort), "world_size >= 2")
	checked("world size 1", gloo(1, anyPort), "world_size >= 2")
	checked("world size -1", gloo(-1, anyPort), "world_size >= 2")
	checked("world size 2^40", gloo(1<<40, anyPort), "WorldSize is 1099511627776")
	checked("more processes than stages", gloo(3, anyPort), "3 processes")
	negative := gloo(2, anyPort)
	negative.CommTimeout = -time.Millisecond
	checked("a negative CommTimeout", negative, "CommTimeout is -1ms")
	huge := gloo(2, anyPort)
	huge.CommTimeout = 1000 * time.Hour
	checked("a CommTimeout beyond int32 milliseconds", huge, "at most")

	for _, tc := range []struct {
		name string
		want pipe.Transport
	}{{"local", pipe.TransportLocal}, {"tcp", pipe.TransportTCP}, {"nccl", pipe.TransportNCCL}} {
		if got, err := pipe.ParseTransport(tc.name); err != nil || got != tc.want || got.String() != tc.name {
			t.Errorf("ParseTransport(%q) = %v, %v", tc.name, got, err)
		}
	}
	// "gloo", tcp's name before libpipe 0.12, still parses.
	if got, err := pipe.ParseTransport("gloo"); err != nil || got != pipe.TransportTCP || pipe.TransportGloo != pipe.TransportTCP {
		t.Errorf("ParseTransport(\"gloo\") = %v, %v", got, err)
	}
	for _, bad := range []string{"udp", "Gloo", "TCP", ""} {
		_, err := pipe.ParseTransport(bad)
		if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, fmt.Sprintf("%q", bad)) {
			t.Errorf("ParseTransport(%q): %q does not quote it", bad, pe.Message)
		}
	}
	if s := pipe.Transport(7).String(); s != "Transport(7)" {
		t.Errorf("Transport(7).String() = %q", s)
	}
}

// refusedPort is a port on 127.0.0.1 where nothing listens for the rest of the test: the socket
// is bound but never listens, so connections are refused and no other process can take the port.
func refusedPort(t *testing.T) int {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return sa.(*syscall.SockaddrInet4).Port
}

func TestRunWorkerErrors(t *testing.T) {
	const store = "127.0.0.1:1" // refused before any store is looked for
	checked := func(what string, opts *pipe.WorkerOptions, want string) {
		t.Helper()
		err := pipe.RunWorker(opts)
		if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, want) {
			t.Errorf("%s: the message %q does not say %q", what, pe.Message, want)
		}
	}
	worker := func(rank, worldSize int, store string) *pipe.WorkerOptions {
		return &pipe.WorkerOptions{Rank: rank, WorldSize: worldSize, Store: store, CommTimeout: 500 * time.Millisecond}
	}
	checked("no options", nil, "no launcher (torchrun, srun)") // rank and world size 0: a launcher's
	checked("no store", worker(1, 2, ""), "options->store")
	for _, rank := range []int{0, 2, -1} {
		checked(fmt.Sprintf("rank %d of 2", rank), worker(rank, 2, store), "rank")
	}
	checked("world size 1", worker(1, 1, store), "world size")
	checked("world size 2^40", worker(1, 1<<40, store), "WorldSize is 1099511627776")
	checked("a store without a port", worker(1, 2, "no-port"), "HOST:PORT")
	checked("a store with a NUL byte", worker(1, 2, "127.0.0.1:1\x00"), "NUL")
	// Port 0 lets a driver's store pick one; a worker needs the port the store got.
	checked("port 0", worker(1, 2, anyPort), "port 0")
	threads := worker(1, 2, store)
	threads.ThreadsPerStage = -1
	checked("negative threads per stage", threads, "threads_per_stage")
	negative := worker(1, 2, store)
	negative.CommTimeout = -time.Second
	checked("a negative CommTimeout", negative, "CommTimeout is -1s")

	// No store where the address points: ErrCommunication naming it, once CommTimeout is over.
	refused := fmt.Sprintf("127.0.0.1:%d", refusedPort(t))
	started := time.Now()
	err := pipe.RunWorker(worker(1, 2, refused))
	if pe := asError(t, err, pipe.StatusCommunication); !strings.Contains(pe.Message, refused) {
		t.Fatalf("the message %q does not name the address %s", pe.Message, refused)
	}
	// A CommTimeout that did not reach libpipe would be its one-minute default.
	if took := time.Since(started); took > 500*time.Millisecond+margin {
		t.Fatalf("RunWorker gave up after %v with a CommTimeout of 500ms", took)
	}
}
