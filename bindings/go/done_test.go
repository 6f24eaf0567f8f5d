package pipe_test

// Completion without a waiting thread: libpipe reports a finished call through a callback
// (Request.Done) and a pollable descriptor (Request.FD), so goroutines waiting for calls wait on
// channels instead of holding an OS thread each inside libpipe. Every test holds its calls at the
// test gate, so "not finished yet" is a state the test has seen, not a guess about timing.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/libpipe/libpipe/bindings/go/internal/capi"
	"github.com/libpipe/libpipe/bindings/go/internal/testgate"
)

// osThreads is the number of OS threads of this process now.
func osThreads(t *testing.T) int {
	t.Helper()
	return len(must(os.ReadDir("/proc/self/task"))(t))
}

// readable reports whether fd can be read from now, without waiting (select with a zero timeout).
func readable(t *testing.T, fd int) bool {
	t.Helper()
	if fd < 0 || fd >= syscall.FD_SETSIZE {
		t.Fatalf("descriptor %d is outside what select can watch", fd)
	}
	for {
		var set syscall.FdSet
		set.Bits[fd/64] |= 1 << (uint(fd) % 64)
		var now syscall.Timeval
		n, err := syscall.Select(fd+1, &set, nil, nil, &now)
		if errors.Is(err, syscall.EINTR) {
			continue // Go's runtime signals its threads; ask again
		}
		if err != nil {
			t.Fatalf("select on descriptor %d: %v", fd, err)
		}
		return n == 1
	}
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// doneCallbacks records the completion registry before a test, to check it afterwards: every
// handle a request registered is gone once the call finished or the request was closed (none
// leaked), and libpipe never called back for a handle it had called already (none twice).
type doneCallbacks struct{ pending, stray int64 }

func recordDone() doneCallbacks {
	return doneCallbacks{pending: int64(capi.PendingDone()), stray: capi.StrayDone()}
}

func (b doneCallbacks) check(t *testing.T, when string) {
	t.Helper()
	if n := int64(capi.PendingDone()); n != b.pending {
		t.Fatalf("%s: %d completion handles registered, %d before the test", when, n, b.pending)
	}
	if n := capi.StrayDone(); n != b.stray {
		t.Fatalf("%s: libpipe called back %d times for handles it had called already", when, n-b.stray)
	}
}

func TestDoneClosesWhenTheCallFinishes(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	before := recordDone()
	key := g.key(t)
	req := must(g.session.Submit(context.Background(), g.inputs(key)...))(t)
	defer req.Close()
	fd := must(req.FD())(t)
	if again := must(req.FD())(t); again != fd {
		t.Fatalf("FD gave %d, then %d: want the same descriptor", fd, again)
	}

	// Held in stage 0: the call cannot have finished.
	waitGate(t, key, "stage0", testgate.Arrived, 1)
	if isClosed(req.Done()) {
		t.Fatal("Done is closed while the call is held in stage 0")
	}
	if readable(t, fd) {
		t.Fatal("the descriptor is readable while the call is held in stage 0")
	}
	if n := int64(capi.PendingDone()); n != before.pending+1 {
		t.Fatalf("%d completion handles registered while the call runs, want %d", n, before.pending+1)
	}

	openGate(t, key, "")
	receive(t, req.Done(), "Done after the gate opened")
	// Finished: collecting it does not wait, and gives the same outputs every time.
	g.checkOutput(t, "WaitTimeout(0) once Done is closed", must(req.WaitTimeout(0))(t))
	g.checkOutput(t, "Wait again", must(req.Wait())(t))
	err := testgate.Until(func() (bool, error) { return readable(t, fd), nil },
		func() string { return fmt.Sprintf("descriptor %d of a finished call is not readable", fd) })
	if err != nil {
		t.Fatal(err)
	}
	if !readable(t, fd) {
		t.Fatal("the descriptor stopped being readable (it is level-triggered)")
	}
	// The callback released its handle when the call finished, before Close.
	before.check(t, "after the call finished")

	req.Close()
	if !isClosed(req.Done()) {
		t.Fatal("Done reopened after Close")
	}
	if _, err := req.FD(); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("FD of a closed request: %v", err)
	}
	if _, err := req.Wait(); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("Wait on a closed request: %v", err)
	}
	before.check(t, "after Close")
}

// 64 goroutines each wait in Run for a call held at the gate. Waiting inside libpipe would hold
// one OS thread per call (a goroutine blocked in a cgo call keeps its thread); waiting on Done
// holds none, so the process gains far fewer threads than there are calls. (Only a few are
// allowed for, which Go may start while the goroutines are inside pipe_session_submit.)
func TestRunWaitsWithoutAThreadPerCall(t *testing.T) {
	const calls = 64
	// Room for every call's one micro-batch: Submit then never waits for room inside libpipe.
	g := gatedSessionWith(t, pipe.SessionOptions{Microbatches: 1, MaxInflight: 2 * calls})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// One call first, so that threads libpipe starts once (e.g. LibTorch's) are already there.
	g.checkOutput(t, "first call", must(g.session.Run(ctx, g.inputs(0)...))(t))
	before := recordDone()
	threads := osThreads(t)

	key := g.key(t)
	type result struct {
		out pipe.TensorList
		err error
	}
	results := make(chan result, calls)
	for range calls {
		go func() {
			out, err := g.session.Run(ctx, g.inputs(key)...)
			results <- result{out, err}
		}()
	}
	// Every call is in libpipe: one held at stage 0's gate, the others queued for stage 0.
	err := testgate.Until(func() (bool, error) {
		st, err := g.session.StageStats(0)
		return err == nil && st.QueueDepth == calls-1 && gateCount(t, key, "stage0", testgate.Arrived) == 1, err
	}, func() string {
		st, _ := g.session.StageStats(0)
		return fmt.Sprintf("%d calls queued for stage 0, want %d", st.QueueDepth, calls-1)
	})
	if err != nil {
		t.Fatal(err)
	}
	grown := osThreads(t) - threads
	t.Logf("%d calls held: %d OS threads before, %d more now", calls, threads, grown)
	if grown >= calls/2 {
		t.Fatalf("%d calls held in libpipe added %d OS threads: the waiting goroutines hold threads", calls, grown)
	}
	if n := int64(capi.PendingDone()); n != before.pending+calls {
		t.Fatalf("%d completion handles registered with %d calls held, want %d", n, calls, before.pending+calls)
	}

	openGate(t, key, "")
	for i := range calls {
		r := receive(t, results, "a held Run after the gate opened")
		if r.err != nil {
			t.Fatalf("call %d: %v", i, r.err)
		}
		g.checkOutput(t, fmt.Sprintf("call %d", i), r.out)
	}
	before.check(t, "after every call returned")
}

// Cancelling the context of a held call ends it with ErrCancelled and closes Done; closing a held
// request closes Done by the time Close returns; neither leaves a completion handle behind.
func TestCancelHeldCallClosesDone(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	before := recordDone()
	key := g.key(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req := must(g.session.Submit(ctx, g.inputs(key)...))(t)
	defer req.Close()
	waitGate(t, key, "stage0", testgate.Arrived, 1)
	if isClosed(req.Done()) {
		t.Fatal("Done is closed while the call is held in stage 0")
	}
	cancel()
	receive(t, req.Done(), "Done after the context was cancelled")
	_, err := req.Wait()
	asError(t, err, pipe.StatusCancelled)
	if !errors.Is(err, context.Canceled) || errors.Is(err, pipe.ErrDeadlineExceeded) {
		t.Fatalf("error %v should match ErrCancelled and context.Canceled only", err)
	}
	checkEndedEarly(t, g.session)
	before.check(t, "after the cancelled call finished")
	req.Close()
	before.check(t, "after Close")
	// The cancelled call's micro-batch is still held in stage 0 (libpipe does not interrupt a
	// stage): let it go before the next call needs stage 0.
	g.afterFailed(t, key)

	// Closed while held, with nothing else ending it: pipe_request_destroy cancels the call and
	// calls back before it returns.
	held := g.key(t)
	req = must(g.session.Submit(context.Background(), g.inputs(held)...))(t)
	waitGate(t, held, "stage0", testgate.Arrived, 1)
	if isClosed(req.Done()) {
		t.Fatal("Done is closed while the second call is held in stage 0")
	}
	req.Close()
	if !isClosed(req.Done()) {
		t.Fatal("Done is still open after Close returned")
	}
	before.check(t, "after closing a held request")
	g.afterFailed(t, held)
	before.check(t, "at the end")
}

// A held call whose context deadline passes finishes on its own (the gate stays shut), with
// ErrDeadlineExceeded. Whatever the deadline, the call cannot finish otherwise; if Submit itself
// took longer than the deadline (a loaded machine), it is tried again with a longer one.
func TestDeadlineEndsHeldCall(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	before := recordDone()
	key := g.key(t)
	var req *pipe.Request
	for timeout := 50 * time.Millisecond; req == nil; timeout *= 2 {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		r, err := g.session.Submit(ctx, g.inputs(key)...)
		if errors.Is(err, pipe.ErrDeadlineExceeded) && timeout < testgate.WaitLimit {
			t.Logf("Submit took longer than %v; again with twice that", timeout)
			continue
		}
		req = must(r, err)(t)
	}
	defer req.Close()
	receive(t, req.Done(), "Done of a held call whose deadline passed")
	_, err := req.Wait()
	asError(t, err, pipe.StatusDeadlineExceeded)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v should match context.DeadlineExceeded too", err)
	}
	if n := gateCount(t, key, "stage0", testgate.Left); n != 0 {
		t.Fatalf("%d micro-batches passed stage 0's shut gate", n)
	}
	checkEndedEarly(t, g.session)
	before.check(t, "after the call's deadline")
	g.afterFailed(t, key)
}

// A request dropped without Close is freed by its cleanup, which cancels a held call and so
// releases its completion handle.
func TestAbandonedRequestReleasesItsHandle(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	before := recordDone()
	key := g.key(t)
	func() {
		req := must(g.session.Submit(context.Background(), g.inputs(key)...))(t)
		waitGate(t, key, "stage0", testgate.Arrived, 1)
		if isClosed(req.Done()) {
			t.Fatal("Done is closed while the call is held in stage 0")
		}
	}()
	err := testgate.Until(func() (bool, error) {
		runtime.GC() // the request is unreachable: a collection runs its cleanup
		return capi.PendingDone() == int(before.pending), nil
	}, func() string { return "the abandoned request's completion handle is still registered" })
	if err != nil {
		t.Fatal(err)
	}
	before.check(t, "after the cleanup")
	checkEndedEarly(t, g.session)
	g.afterFailed(t, key)
}
