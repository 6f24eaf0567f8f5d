package main

// Worker processes (-processes N > 1): the model's later stages run in N-1 processes that
// pipe-serve starts itself, so that a stage that crashes (a kernel's fault, the OOM killer, a
// stray signal) takes down one worker, not the service: the service answers what that costs
// (faults.go) and starts a fresh set. With -processes 1 every stage is a thread of pipe-serve.
//
// Each worker is this same binary (/proc/self/exe: a binary replaced on disk while the service
// runs never pairs a new worker with an old driver, whose libpipe versions must match) in worker
// mode, which runs pipe.RunWorker (the Go binding's side of a session over TCP):
//
//   - it learns its rank from workerEnv, the session's token from LIBPIPE_TOKEN (the environment,
//     never the command line, which any user can read with ps), and the store's address from its
//     stdin, once the driver's store listens: the store picks its own free port (so none is
//     guessed) and the worker loads libpipe meanwhile;
//   - the store and every connection listen on the loopback only, and every connection proves it
//     holds the token (libpipe's challenge-response);
//   - it dies with the service (PR_SET_PDEATHSIG), and its stderr is the service's.

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// workerEnv set to "RANK/WORLD_SIZE" makes pipe-serve a worker process (see serveAsWorker).
const workerEnv = "PIPE_SERVE_WORKER"

// commTimeout is how long the workers may take to join and load their stages, and how long one
// may send no heartbeat before the session breaks (a worker that dies is noticed at once, by its
// closed connections; this bounds one that hangs). It also bounds how long a worker that
// survived a broken session is given to end before it is killed (faults.go).
const commTimeout = time.Minute

// serveAsWorker is pipe-serve in a worker process: rank and world size from spec ("RANK/WORLD"),
// the store's address from stdin, the token from LIBPIPE_TOKEN. It serves the session until the
// driver closes it (exit 0) or the session is lost (exit 1: the driver, which started it, knows
// why and starts another).
func serveAsWorker(spec string) int {
	var rank, world int
	if _, err := fmt.Sscanf(spec, "%d/%d", &rank, &world); err != nil || rank < 1 || rank >= world {
		fmt.Fprintf(os.Stderr, "pipe-serve: %s=%q is not RANK/WORLD_SIZE; pipe-serve sets it for the worker "+
			"processes it starts (-processes), it is not for users\n", workerEnv, spec)
		return 2
	}
	line, err := bufio.NewReader(os.Stdin).ReadString('\n')
	if err != nil {
		return 1 // the service gave up on this worker before its store listened
	}
	err = pipe.RunWorker(&pipe.WorkerOptions{Rank: rank, WorldSize: world, Store: strings.TrimSpace(line),
		CommTimeout: commTimeout})
	if err != nil {
		fmt.Fprintf(os.Stderr, "pipe-serve worker %d/%d: %v\n", rank, world, err)
		return 1
	}
	return 0
}

// generatorSource makes the service's generator: from the plan, in this process or over worker
// processes it starts. With worker processes it keeps the plan, to make another generator when
// one breaks.
type generatorSource struct {
	plan      *pipe.Plan
	session   pipe.SessionOptions // the stages' weights
	options   pipe.GeneratorOptions
	processes int
}

// build makes a generator: a backend whose stages run in this process, or whose later stages run
// in processes-1 workers started for it (and killed again if the session cannot be created).
func (g *generatorSource) build() (*backend, error) {
	if g.processes <= 1 {
		gen, err := g.plan.NewGenerator(&g.session, &g.options)
		if err != nil {
			return nil, err
		}
		return &backend{gen: gen}, nil
	}
	var secret [32]byte
	rand.Read(secret[:])
	token := hex.EncodeToString(secret[:])
	w, err := startWorkers(g.processes, token)
	if err != nil {
		return nil, err
	}
	stores := storeReports.expect()
	defer storeReports.forget()
	opts := g.session
	opts.Transport, opts.WorldSize, opts.Store = pipe.TransportTCP, g.processes, "127.0.0.1:0"
	opts.Token, opts.CommTimeout = token, commTimeout
	type created struct {
		gen *pipe.Generator
		err error
	}
	done := make(chan created, 1)
	go func() {
		gen, err := g.plan.NewGenerator(&opts, &g.options)
		done <- created{gen, err}
	}()
	var c created
	select {
	case addr := <-stores:
		// A worker that cannot be told has ended: libpipe then waits for it until commTimeout,
		// and the creation fails.
		w.tell(addr)
		c = <-done
	case c = <-done: // failed before its store listened
	}
	if c.err != nil {
		w.reap(0)
		return nil, c.err
	}
	return &backend{gen: c.gen, workers: w}, nil
}

// close frees the plan (the source makes no more generators).
func (g *generatorSource) close() { g.plan.Close() }

// workers are the worker processes of one session, ranks 1 .. N-1.
type workers struct {
	procs  []*workerProcess
	exited chan struct{} // closed when the first of them has ended
	once   sync.Once
}

type workerProcess struct {
	rank  int
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{} // closed once it has ended and been reaped
}

// startWorkers starts ranks 1 .. world-1 in worker mode; each waits for the store's address.
func startWorkers(world int, token string) (*workers, error) {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, workerEnv+"=") || strings.HasPrefix(kv, "LIBPIPE_TOKEN=")
	})
	w := &workers{exited: make(chan struct{})}
	for rank := 1; rank < world; rank++ {
		spec := fmt.Sprintf("%d/%d", rank, world)
		cmd := exec.Command("/proc/self/exe")
		cmd.Args = []string{os.Args[0], "worker", spec} // for ps; worker mode reads only its environment
		cmd.Env = append(slices.Clip(env), workerEnv+"="+spec, "LIBPIPE_TOKEN="+token)
		cmd.Stdout = os.Stderr // the service's stdout says where it listens, and nothing else
		cmd.Stderr = os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		stdin, err := cmd.StdinPipe()
		if err == nil {
			err = cmd.Start()
		}
		if err != nil {
			w.reap(0)
			return nil, fmt.Errorf("starting worker process %s: %w", spec, err)
		}
		p := &workerProcess{rank: rank, cmd: cmd, stdin: stdin, done: make(chan struct{})}
		w.procs = append(w.procs, p)
		log.Printf("worker %s started (pid %d)", spec, cmd.Process.Pid)
		go func() {
			err := cmd.Wait()
			if err != nil {
				log.Printf("worker %s (pid %d) ended: %v", spec, cmd.Process.Pid, err)
			}
			close(p.done)
			w.once.Do(func() { close(w.exited) })
		}()
	}
	return w, nil
}

// tell gives every worker the store's address.
func (w *workers) tell(store string) {
	for _, p := range w.procs {
		io.WriteString(p.stdin, store+"\n")
		p.stdin.Close()
	}
}

// ended is the first worker that has ended (nil while all run), for the log.
func (w *workers) ended() *workerProcess {
	for _, p := range w.procs {
		select {
		case <-p.done:
			return p
		default:
		}
	}
	return nil
}

// reap waits up to wait for every worker to end, then kills those left, and returns once all
// are reaped.
func (w *workers) reap(wait time.Duration) {
	deadline := time.Now().Add(wait)
	for _, p := range w.procs {
		select {
		case <-p.done:
			continue
		default:
		}
		select {
		case <-p.done:
			continue
		case <-time.After(time.Until(deadline)):
		}
		if wait > 0 {
			log.Printf("worker %d (pid %d) did not end within %v: killing it", p.rank, p.cmd.Process.Pid, wait)
		}
		p.cmd.Process.Kill()
		<-p.done
	}
}

// storeReports passes libpipe's report of its store's address ("store listening on HOST:PORT",
// logged at LogInfo) to the build waiting for it. libpipe's log is one per process, so the
// callback is installed once (routeLibpipeLog) and builds, one at a time, take turns.
var storeReports = &storeRoute{}

type storeRoute struct {
	mu     sync.Mutex
	waiter chan string
}

// expect makes a new channel the one that receives the next address, and returns it.
func (r *storeRoute) expect() <-chan string {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waiter = make(chan string, 1)
	return r.waiter
}

// forget stops passing addresses to the last channel expect returned.
func (r *storeRoute) forget() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waiter = nil
}

func (r *storeRoute) report(addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case r.waiter <- addr:
	default: // nobody waits (or the address came already): libpipe's thread never blocks here
	}
}

var storeListening = regexp.MustCompile(`^store listening on (\S+)$`)

// routeLibpipeLog sends libpipe's log through Go's (every message at LogInfo and above: the few
// info messages a driver writes say how its session is spread and why it broke), and the store's
// address to the build waiting for it.
func routeLibpipeLog() error {
	return pipe.SetLogCallback(func(level pipe.LogLevel, message string) {
		if m := storeListening.FindStringSubmatch(message); m != nil && level == pipe.LogInfo {
			storeReports.report(m[1])
		}
		log.Printf("libpipe %v: %s", level, message)
	}, pipe.LogInfo)
}
