package main

// The fault contract: what clients see when the pipeline breaks, and what the service does then.
//
// The pipeline breaks when a worker process (-processes N > 1, workers.go) dies or hangs: libpipe
// fails every step that was in its stages with ErrCommunication and reports the session broken
// (Generator.Check), for good. Then:
//
//   - a stream already begun ends with one error event, `data: {"error": {..., "code":
//     "pipeline_failed"}}`, and no finish_reason or [DONE]: a cut reply never looks finished;
//   - a request not answered yet (waiting for a cache slot, in its prefill, or not streamed) gets
//     503 with Retry-After, as does every request until the pipeline works again;
//   - /health answers 503 until then;
//   - the service rebuilds the pipeline: it ends the broken generator, waits for the workers
//     that survived it to end (at most commTimeout, then kills them: new workers must not compete
//     with them for memory or a GPU), starts a fresh set and a new generator. If that fails
//     rebuildAttempts times in a row, the service exits non-zero for its supervisor to start it
//     again: it never stays up answering 503 for ever.
//
// With -processes 1 every stage is a thread of pipe-serve: a local session never breaks, and a
// stage that crashes takes the process with it (the supervisor's case). Should libpipe ever
// report that pipeline broken all the same, the service fails its requests as above and exits
// non-zero, as it cannot start stages it does not own afresh.
//
// The watch is the generator's own report (Check), the worker processes' exits (each is waited
// for, so a death is seen at once) and the generations that fail with ErrCommunication, each of
// which pokes the watcher; a slow tick catches the rest (a session broken by a missed heartbeat
// while idle).

import (
	"errors"
	"fmt"
	"log"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// rebuildAttempts is how many times in a row a broken pipeline is rebuilt before the service
// gives up and exits; rebuildBackoff the wait after the first failure, doubled after each (a
// variable only for the test of giving up).
const rebuildAttempts = 3

var rebuildBackoff = time.Second

// watchTick is how often the watcher asks the generator whether its session still works when
// nothing told it sooner.
const watchTick = time.Second

// backend is one generator and the worker processes its session runs on.
type backend struct {
	gen     *pipe.Generator
	workers *workers // nil: every stage in this process
	// broken is set before the generator is closed for breaking: its requests' errors
	// (ErrCancelled among them, from the close) are the pipeline's, not the requests'.
	broken atomic.Bool
}

// failing says whether err, from a call on b or one of its generations, is b's pipeline failing.
func (b *backend) failing(err error) bool {
	return err != nil && (errors.Is(err, pipe.ErrCommunication) || errors.Is(err, pipe.ErrClosed) || b.broken.Load())
}

// unhealthy is why b no longer works (nil while it does): a worker process has ended, or libpipe
// reports its session broken.
func (b *backend) unhealthy() error {
	if b.broken.Load() {
		return errors.New("the pipeline broke")
	}
	if b.workers != nil {
		if p := b.workers.ended(); p != nil {
			return fmt.Errorf("worker %d (pid %d) ended", p.rank, p.cmd.Process.Pid)
		}
	}
	return b.gen.Check()
}

// close ends the generator (its generations that are left end cancelled) and waits for its
// workers: those of a working session end once told to; a broken session's survivors end once
// their stages return, or are killed after commTimeout.
func (b *backend) close() {
	b.gen.Close()
	if b.workers != nil {
		b.workers.reap(commTimeout)
	}
}

// pipeline is the backend the service works on, replaced when it breaks.
type pipeline struct {
	rebuild func() (*backend, error) // nil: the stages are this process's threads and cannot be restarted

	mu      sync.Mutex
	current *backend // nil from a break until the rebuild is done, and once closed
	closed  bool

	rebuilds atomic.Uint64 // for /health and /metrics
	poke     chan struct{} // capacity 1: look now
	failed   chan error    // capacity 1: the pipeline is broken for good; the service must end
	stop     chan struct{} // closed by Close
}

// newPipeline serves on first, and watches it.
func newPipeline(first *backend, rebuild func() (*backend, error)) *pipeline {
	p := &pipeline{rebuild: rebuild, current: first, poke: make(chan struct{}, 1), failed: make(chan error, 1),
		stop: make(chan struct{})}
	go p.watch()
	return p
}

// acquire is the backend to serve a request on; nil while the pipeline is broken.
func (p *pipeline) acquire() *backend {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.current
}

// report tells the watcher that a request saw the pipeline fail.
func (p *pipeline) report() {
	select {
	case p.poke <- struct{}{}:
	default:
	}
}

// Failed delivers the error that must end the service: the pipeline broke and cannot be rebuilt.
func (p *pipeline) Failed() <-chan error { return p.failed }

// Close ends the backend served on (at shutdown, once the HTTP server has finished its
// requests) and the watch. A rebuild under way is abandoned: its workers die with the process.
func (p *pipeline) Close() {
	p.mu.Lock()
	b := p.current
	p.current, p.closed = nil, true
	p.mu.Unlock()
	close(p.stop)
	if b != nil {
		b.close()
	}
}

func (p *pipeline) watch() {
	tick := time.NewTicker(watchTick)
	defer tick.Stop()
	for {
		b := p.acquire()
		if b == nil {
			return // closed
		}
		var exited <-chan struct{}
		if b.workers != nil {
			exited = b.workers.exited
		}
		select {
		case <-p.stop:
			return
		case <-p.poke:
		case <-exited:
		case <-tick.C:
		}
		if why := b.unhealthy(); why != nil && !p.recover(b, why) {
			return
		}
	}
}

// recover replaces the broken backend b, and says whether the service goes on; when it cannot,
// Failed says why.
func (p *pipeline) recover(b *backend, why error) bool {
	p.mu.Lock()
	if p.current != b {
		p.mu.Unlock()
		return !p.closed
	}
	p.current = nil // from now on requests get 503, and /health says so
	b.broken.Store(true)
	p.mu.Unlock()
	log.Printf("the pipeline is broken (%v): its requests fail, new ones get 503 until it works again", why)
	b.close()
	if p.rebuild == nil {
		p.failed <- fmt.Errorf("the pipeline broke (%v); its stages run in this process and cannot be started "+
			"afresh: exiting, for the supervisor to start the service again", why)
		return false
	}
	wait := rebuildBackoff
	var err error
	for attempt := 1; attempt <= rebuildAttempts; attempt++ {
		var fresh *backend
		if fresh, err = p.rebuild(); err == nil {
			p.mu.Lock()
			closed := p.closed
			if !closed {
				p.current = fresh
			}
			p.mu.Unlock()
			if closed {
				fresh.close()
				return false
			}
			log.Printf("the pipeline works again (rebuild %d)", p.rebuilds.Add(1))
			return true
		}
		log.Printf("rebuilding the pipeline, attempt %d of %d: %v", attempt, rebuildAttempts, err)
		if attempt == rebuildAttempts {
			break
		}
		select {
		case <-p.stop:
			return false
		case <-time.After(wait):
		}
		wait *= 2
	}
	p.failed <- fmt.Errorf("the pipeline broke (%v) and could not be rebuilt in %d attempts (the last: %v): exiting, "+
		"for the supervisor to start the service again", why, rebuildAttempts, err)
	return false
}

// pipelineCode is OpenAI's error code this service gives for a request the broken pipeline
// failed: the request is not at fault, and may be sent again.
const pipelineCode = "pipeline_failed"

// unavailable answers a request that the pipeline cannot serve now (broken, or broke under it
// before its response began): 503 with Retry-After, for the client to send it again.
func (s *server) unavailable(w http.ResponseWriter) {
	s.pipeline.report()
	w.Header().Set("Retry-After", retryAfter)
	writeJSON(w, http.StatusServiceUnavailable, errorBody("server_error", "", pipelineCode,
		"the model's pipeline failed (a worker process ended or stopped answering) and is being restarted; "+
			"try again shortly"))
}

// cutOff is the error event that ends a stream the pipeline failed under.
func cutOff() map[string]apiError {
	return errorBody("server_error", "", pipelineCode,
		"the model's pipeline failed (a worker process ended or stopped answering) before the reply was "+
			"complete; send the request again")
}
