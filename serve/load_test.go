package main

// Load: many clients at once, and a witness stream for the abuse tests (abuse_test.go).
//
// Every verdict is a state: each of 64 concurrent streams got its reference text and usage; once
// they all ended, every sequence the service took has ended and /metrics says no slot is held and
// none waits; a witness stream received tokens while an abusive client was being handled (until
// the server cut that client off, which is the service's timeout, not the test's).

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// checkConcurrentStreams: 64 clients stream completions at once, asking for usage, while 8 more
// leave after their first event. Each of the 64 gets its prompt's reference continuation, finish
// "length", [DONE] and the usage of its prompt and max_tokens; then every sequence has ended and
// freed its slot (the service's finished count grew by 72; /metrics' slots-in-use and queue
// gauges are 0). The service must let 72 sequences queue (-max-queued).
func checkConcurrentStreams(t *testing.T, s *service, e tinyExpected) {
	const clients, leavers = 64, 8
	before := s.health(t)
	stream := func(ctx context.Context, i int) *call {
		p := i % len(e.Prompts)
		return ask(ctx, s, "", "/v1/completions", map[string]any{"prompt": tinyText(e.Prompts[p]),
			"max_tokens": e.MaxNewTokens, "temperature": 0, "stream": true,
			"stream_options": map[string]any{"include_usage": true}})
	}
	calls := make([]*call, clients)
	for i := range calls {
		calls[i] = stream(context.Background(), i)
	}
	var left sync.WaitGroup
	var leftEarly atomic.Int64
	for i := range leavers {
		left.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			c := stream(ctx, i)
			for c.pieces.Load() == 0 {
				select {
				case <-c.ended:
					cancel()
					return // answered before it could leave (it is not one of the 64 checked)
				default:
				}
				<-c.begun // then poll the events it reads
				yieldBriefly()
			}
			cancel()
			<-c.ended
			leftEarly.Add(1)
		})
	}
	for i, c := range calls {
		o := c.wait(t, fmt.Sprintf("stream %d", i))
		p := i % len(e.Prompts)
		want := usageCounts{len(e.Prompts[p]), e.MaxNewTokens, len(e.Prompts[p]) + e.MaxNewTokens}
		if o.err != nil || o.status != http.StatusOK || o.text() != tinyText(e.Greedy[p]) || o.finish != "length" ||
			!o.done || o.failure != nil || o.usage == nil || *o.usage != want {
			t.Fatalf("stream %d of %d: %d %q, finish %q, [DONE] %v, usage %+v, error event %+v (%v %.300s); "+
				"want %q, length, usage %+v", i, clients, o.status, o.text(), o.finish, o.done, o.usage, o.failure,
				o.err, o.body, tinyText(e.Greedy[p]), want)
		}
	}
	left.Wait()
	until(t, "every sequence to end and free its slot", func() bool {
		h := s.health(t)
		return sumFinished(h)-sumFinished(before) == clients+leavers && h.SlotsInUse == 0 && h.Queued == 0
	})
	m := scrape(t, s, "")
	if m.metric("pipe_serve_slots_in_use") == nil || m.value("pipe_serve_slots_in_use") != 0 ||
		m.value("pipe_serve_queue_depth") != 0 {
		t.Fatalf("/metrics after the streams: %g slots in use, %g queued; want 0 and 0",
			m.value("pipe_serve_slots_in_use"), m.value("pipe_serve_queue_depth"))
	}
	h := s.health(t)
	t.Logf("%d streams got their reference text and usage; %d clients left mid-stream (the service saw %d "+
		"disconnects, %d cut-off writes); every slot free", clients, leftEarly.Load(),
		h.Disconnects-before.Disconnects, h.WriteFailures-before.WriteFailures)
}

// yieldBriefly is the pause between two looks at a call's progress.
func yieldBriefly() { time.Sleep(2 * time.Millisecond) }

func sumFinished(h health) uint64 {
	var n uint64
	for _, v := range h.Finished {
		n += v
	}
	return n
}

// witness is a client streaming completions one after the other in the background, counting the
// events it receives: the stream that must keep going while another client misbehaves.
type witness struct {
	events   atomic.Int64
	stopping atomic.Bool
	done     chan struct{}
	problem  atomic.Pointer[string] // what went wrong, if anything did
}

// startWitness starts streaming with send (one completion per call, read to its end) and
// returns once the first event came. It stops when the test ends, if not before.
func startWitness(t *testing.T, send func() *call) *witness {
	t.Helper()
	w := &witness{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for !w.stopping.Load() {
			c := send()
			seen := int64(0)
			for {
				select {
				case <-c.ended:
				default:
					if n := c.pieces.Load(); n > seen {
						w.events.Add(n - seen)
						seen = n
					}
					yieldBriefly()
					continue
				}
				break
			}
			w.events.Add(c.pieces.Load() - seen)
			if o := c.out; o.err != nil || o.status != http.StatusOK || o.failure != nil || !o.done {
				problem := fmt.Sprintf("a witness stream: %d, error event %+v, [DONE] %v (%v %.200s)", o.status,
					o.failure, o.done, o.err, o.body)
				w.problem.Store(&problem)
				return
			}
		}
	}()
	t.Cleanup(func() { w.stop(t) })
	until(t, "the witness stream's first event", func() bool { return w.events.Load() > 0 || w.failed() })
	w.check(t)
	return w
}

func (w *witness) failed() bool { return w.problem.Load() != nil }

func (w *witness) check(t *testing.T) {
	t.Helper()
	if p := w.problem.Load(); p != nil {
		t.Fatal(*p)
	}
}

// stop lets the stream under way end by itself (no disconnect for the service to count) and
// waits for it.
func (w *witness) stop(t *testing.T) {
	t.Helper()
	w.stopping.Store(true)
	until(t, "the witness stream to end", func() bool {
		select {
		case <-w.done:
			return true
		default:
			return false
		}
	})
	w.check(t)
}

// during runs abuse, which returns once the service has dealt with the abusive client, and fails
// the test unless the witness received events meanwhile. abuse runs again (up to 3 times) when
// the witness received none: a state not seen yet, not a verdict.
func (w *witness) during(t *testing.T, what string, abuse func(t *testing.T)) {
	t.Helper()
	for try := 1; ; try++ {
		before := w.events.Load()
		abuse(t)
		w.check(t)
		if during := w.events.Load() - before; during > 0 {
			t.Logf("the witness stream received %d events while %s", during, what)
			return
		}
		if try == 3 {
			t.Fatalf("the witness stream received nothing while %s, %d times", what, try)
		}
	}
}
