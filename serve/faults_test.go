package main

// The service over worker processes (-processes 3: the gated decoder cut in three, stage 0 in the
// service, stage 1 with the test gate in worker 1/3, stage 2 in worker 2/3): 64 concurrent
// streams through it (load_test.go), then the fault contract (faults.go) with a real worker
// killed by SIGKILL mid-stream.
//
// The test holds the pipeline where it wants it with the gate, so that every verdict is a state:
//
//  1. a held prompt (gate 1) stops stage 1; behind it the test queues a stream A, a request C not
//     streamed, a chat stream F (the four cache slots are taken), a held stream H2 (gate 2) and two
//     more requests, which wait for a slot;
//  2. gate 1 opens: the held prompt ends after its one token and H2 takes its slot; A's prefill,
//     already past stage 0, goes through before H2's, so A receives its first token, and every
//     later step of A waits behind H2 at gate 2: A is mid-stream, C and F are being served, two
//     requests wait for a slot;
//  3. worker 2/3 gets SIGKILL. A, F and H2 end with an error event and no finish_reason; C and the
//     two queued requests get 503 with Retry-After; /health answers 503, and so does a new request:
//     worker 1/3 is still held at gate 2, and the service waits for the survivors of a broken
//     pipeline to end before it starts new workers;
//  4. gate 2 opens: worker 1/3 ends, the service starts two new workers and a new generator,
//     /health answers 200 and counts one rebuild, and a stream gets its reference text again.
//
// LIBPIPE_STEPS_IN_FLIGHT=pipelined keeps one step per stage in flight (the generator would
// otherwise choose by measurement), so that A's prefill is in the pipeline while gate 1 holds.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

func TestWorkerProcesses(t *testing.T) {
	e := readTinyExpected(t)
	gateDir := t.TempDir()
	s := startService(t, []string{"LD_PRELOAD=" + fixture(t, "libpipe_test_gate.so"), "LIBPIPE_TEST_GATE_DIR=" + gateDir,
		"LIBPIPE_STEPS_IN_FLIGHT=pipelined"},
		"-decoder", fixture(t, "gated_decoder.pt"), "-model-dir", contentChatModelDir(t),
		"-split", "model.layers.1:begin,model.norm:begin", "-processes", "3", "-max-queued", "128", "-name", "gated")
	s.gateDir = gateDir
	if w := workerPIDs(t, s); len(w) != 2 || w["1/3"] == 0 || w["2/3"] == 0 {
		t.Fatalf("the service runs the worker processes %v, want 1/3 and 2/3; its log:\n%s", w, s.stderr.String())
	}

	t.Run("ConcurrentStreams", func(t *testing.T) { checkConcurrentStreams(t, s, e) })
	t.Run("WorkerKilledMidStream", func(t *testing.T) { checkWorkerKilled(t, s, e) })
}

func checkWorkerKilled(t *testing.T, s *service, e tinyExpected) {
	before := s.health(t)
	old := workerPIDs(t, s)
	ctx := context.Background()
	completion := func(prompt string, maxTokens int, stream bool) *call {
		return ask(ctx, s, "", "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": maxTokens,
			"temperature": 0, "stream": stream})
	}
	inGenerator := func(what string, n int) {
		until(t, what, func() bool { h := s.health(t); return h.SlotsInUse+h.Queued == n })
	}

	// 1. Stage 1 held; A, C, F in the other slots; H2 and two more requests waiting for a slot.
	opener := completion(s.heldPrompt(t, 1, e.Prompts[0]), 1, false)
	until(t, "the opener at gate 1", func() bool { return s.gateArrived(1) })
	a := completion(tinyText(e.Prompts[0]), 50, true)
	inGenerator("A in the generator", 2)
	c := completion(tinyText(e.Prompts[1]), 50, false)
	inGenerator("C in the generator", 3)
	f := ask(ctx, s, "", "/v1/chat/completions", map[string]any{"max_tokens": 40, "temperature": 0, "stream": true,
		"messages": []map[string]any{{"role": "user", "content": tinyText(e.Prompts[3])}}})
	inGenerator("F in the generator", 4)
	h2 := completion(s.heldPrompt(t, 2, e.Prompts[2]), 4, true)
	inGenerator("H2 queued", 5)
	queued := []*call{completion(tinyText(e.Prompts[3]), 4, false), completion(tinyText(e.Prompts[4]), 4, false)}
	inGenerator("two more requests queued", 7)

	// 2. The opener ends and H2 takes its slot: A has a token, and waits behind H2 at gate 2.
	s.openGate(t, 1)
	if o := opener.wait(t, "the opener"); o.status != http.StatusOK || !strings.Contains(o.body, `"length"`) {
		t.Fatalf("the opener: %d %.300s (%v)", o.status, o.body, o.err)
	}
	until(t, "A's first token, H2 streaming and held at gate 2, two requests queued", func() bool {
		return a.pieces.Load() > 0 && h2.hasBegun() && s.gateArrived(2) && s.health(t).Queued == 2
	})
	if !a.hasBegun() || !f.hasBegun() {
		t.Fatal("A or F has no response yet, though each holds a slot")
	}

	// 3. Worker 2/3 is killed.
	if err := syscall.Kill(old["2/3"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cut := func(what string, c *call, minPieces int) {
		t.Helper()
		o := c.wait(t, what)
		if o.err != nil || o.status != http.StatusOK || o.failure == nil || deref(o.failure.Code) != pipelineCode ||
			o.failure.Type != "server_error" || o.finish != "" || o.done || len(o.pieces) < minPieces {
			t.Fatalf("%s: %d, %d text events, finish %q, [DONE] %v, error event %+v (%v); want a stream cut off by "+
				"an error event with code %q after at least %d text events, without finish_reason or [DONE]",
				what, o.status, len(o.pieces), o.finish, o.done, o.failure, o.err, pipelineCode, minPieces)
		}
		t.Logf("%s: %d text events, then %q", what, len(o.pieces), o.failure.Message)
	}
	cut("A, mid-stream", a, 1)
	cut("H2, held in its prefill", h2, 0)
	cut("F, a chat stream", f, 0)
	if o := f.wait(t, "F"); !o.role {
		t.Fatal("F's stream had no assistant role event before its error event")
	}
	retry := func(what string, c *call) {
		t.Helper()
		o := c.wait(t, what)
		if o.err != nil || o.status != http.StatusServiceUnavailable || o.retryAfter == "" ||
			!strings.Contains(o.body, `"`+pipelineCode+`"`) {
			t.Fatalf("%s: %d, Retry-After %q, %.300s (%v); want 503 with Retry-After and code %q", what, o.status,
				o.retryAfter, o.body, o.err, pipelineCode)
		}
	}
	retry("C, not streamed", c)
	for i, q := range queued {
		retry(fmt.Sprintf("queued request %d", i), q)
	}
	// Worker 1/3 is held at gate 2: the service waits for it to end before starting new workers,
	// and meanwhile says it cannot serve.
	if code, h := s.healthStatus(t); code != http.StatusServiceUnavailable || h.Status != "unavailable" {
		t.Fatalf("/health with the pipeline broken: %d %+v, want 503 unavailable", code, h)
	}
	retry("a request while the pipeline is broken", completion(tinyText(e.Prompts[1]), 4, true))
	if w := workerPIDs(t, s); w["1/3"] != old["1/3"] || w["2/3"] != 0 {
		t.Fatalf("the worker processes while worker 1/3 is held: %v (before the kill: %v)", w, old)
	}

	// 4. Worker 1/3 ends; the service rebuilds the pipeline.
	s.openGate(t, 2)
	until(t, "the pipeline to be rebuilt", func() bool {
		code, h := s.healthStatus(t)
		return code == http.StatusOK && h.Rebuilds == before.Rebuilds+1
	})
	fresh := workerPIDs(t, s)
	if len(fresh) != 2 || fresh["1/3"] == 0 || fresh["2/3"] == 0 || fresh["1/3"] == old["1/3"] {
		t.Fatalf("the worker processes after the rebuild: %v (before: %v)", fresh, old)
	}
	o := completion(tinyText(e.Prompts[1]), e.MaxNewTokens, true).wait(t, "a stream after the rebuild")
	if o.err != nil || o.status != http.StatusOK || o.text() != tinyText(e.Greedy[1]) || o.finish != "length" || !o.done {
		t.Fatalf("after the rebuild: %d %q, finish %q, [DONE] %v, error event %+v (%v %.300s); want %q", o.status,
			o.text(), o.finish, o.done, o.failure, o.err, o.body, tinyText(e.Greedy[1]))
	}
	t.Logf("workers %v replaced by %v; the service serves again", old, fresh)
}

// workerPIDs are the service's worker processes by "RANK/WORLD" (their command line is
// `pipe-serve worker RANK/WORLD`); a worker that has ended, reaped or not, is not among them.
func workerPIDs(t *testing.T, s *service) map[string]int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	workers := map[string]int{}
	for _, entry := range entries {
		pid, err := strconv.Atoi(entry.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", entry.Name(), "stat"))
		if err != nil {
			continue // ended meanwhile
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses, so fields start after the last ')'.
		fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		if len(fields) < 2 || fields[0] == "Z" || fields[1] != strconv.Itoa(s.pid) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", entry.Name(), "cmdline"))
		if args := strings.Split(string(cmdline), "\x00"); len(args) >= 3 && args[1] == "worker" {
			workers[args[2]] = pid
		}
	}
	return workers
}

// inProcessBackend is a backend of the tiny decoder in the test process (no worker processes):
// the rebuild rules below need a generator to close, not a broken one.
func inProcessBackend(t *testing.T) *backend {
	t.Helper()
	model, err := pipe.LoadModel(fixture(t, "tiny_decoder.pt"))
	if err != nil {
		t.Fatal(err)
	}
	defer model.Close()
	plan, err := model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"model.layers.1:begin"}})
	if err != nil {
		t.Fatal(err)
	}
	defer plan.Close()
	gen, err := plan.NewGenerator(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gen.Close() })
	return &backend{gen: gen}
}

// A broken pipeline is rebuilt, retrying after a failed attempt; when every attempt fails the
// service is told to end (Failed), and it serves nothing meanwhile; without a way to rebuild
// (every stage in this process) it is told to end at once.
func TestPipelineRebuildRules(t *testing.T) {
	saved := rebuildBackoff
	rebuildBackoff = time.Millisecond
	t.Cleanup(func() { rebuildBackoff = saved })
	why := errors.New("worker 1 (pid 0) ended")

	first, fresh := inProcessBackend(t), inProcessBackend(t)
	attempts := 0
	p := newPipeline(first, func() (*backend, error) {
		if attempts++; attempts < 2 {
			return nil, errors.New("a worker could not start")
		}
		return fresh, nil
	})
	t.Cleanup(p.Close)
	if !p.recover(first, why) || attempts != 2 || p.acquire() != fresh || p.rebuilds.Load() != 1 ||
		!first.broken.Load() || !errors.Is(first.gen.Check(), pipe.ErrClosed) {
		t.Fatalf("after a failed and a good attempt: %d attempts, serving the fresh backend %v, %d rebuilds, "+
			"the broken one marked %v and closed (%v)", attempts, p.acquire() == fresh, p.rebuilds.Load(),
			first.broken.Load(), first.gen.Check())
	}

	attempts = 0
	doomed := newPipeline(inProcessBackend(t), func() (*backend, error) {
		attempts++
		return nil, errors.New("a worker could not start")
	})
	t.Cleanup(doomed.Close)
	if doomed.recover(doomed.acquire(), why) || attempts != rebuildAttempts || doomed.acquire() != nil {
		t.Fatalf("every attempt failing: went on, after %d attempts", attempts)
	}
	select {
	case err := <-doomed.Failed():
		t.Logf("the service is told to end: %v", err)
	default:
		t.Fatal("every attempt failed, and the service is not told to end")
	}

	local := newPipeline(inProcessBackend(t), nil)
	t.Cleanup(local.Close)
	if local.recover(local.acquire(), why) || local.acquire() != nil {
		t.Fatal("a pipeline of this process's threads broke, and the service goes on")
	}
	select {
	case err := <-local.Failed():
		t.Logf("in-process: %v", err)
	default:
		t.Fatal("a pipeline of this process's threads broke, and the service is not told to end")
	}
}
