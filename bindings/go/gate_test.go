package pipe_test

// The gated model and its test gate (internal/testgate): calls that a test holds in a stage for
// as long as it wants, so that cancellation, deadlines and overlapping calls are tested on
// states the test has seen, not on how long some work happens to take.

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/libpipe/libpipe/bindings/go/internal/testgate"
)

// gate is this test process's gate folder, set up by TestMain before any test runs (it sets
// LIBPIPE_TEST_GATE_DIR, which must not change while other goroutines call into C). gateErr
// says why there is none; only the tests that use the gated model fail for it.
var (
	gate    *testgate.Gate
	gateErr error
)

func TestMain(m *testing.M) {
	gate, gateErr = testgate.Init(gateLibrary())
	if gate != nil {
		// The gated decoder takes its key from the prompt's first token (119 + key, at most
		// 127), so it can only be held at keys 1 .. decoderKeys: they are kept for it, before
		// any other test takes a key (a key another test opened would let it pass at once).
		for range decoderKeys {
			decoderKeyPool <- gate.NewKey()
		}
	}
	code := m.Run()
	if gate != nil {
		gate.Remove()
	}
	os.Exit(code)
}

// gateLibrary is LIBPIPE_TEST_GATE_LIB if set, else the copy in the fixtures folder (where
// run-tests.sh's caller, tests/bindings/stage.cmake, puts it beside the gated model).
func gateLibrary() string {
	if lib := os.Getenv("LIBPIPE_TEST_GATE_LIB"); lib != "" {
		return lib
	}
	if dir := os.Getenv("LIBPIPE_FIXTURES"); dir != "" {
		return filepath.Join(dir, "libpipe_test_gate.so")
	}
	return ""
}

// gated is gated.scripted.pt: forward(x float32 [B, 64], n int64 0-d), 2 stages, each passing
// through the gate with key n (n = 0: the gates pass at once). x is the fixture's input and
// expected eager PyTorch's output for it, whatever the key.
type gated struct {
	session  *pipe.Session
	x        *pipe.Tensor
	expected *pipe.Tensor
}

func gatedSession(t *testing.T, microbatches int, mode pipe.Microbatching) *gated {
	t.Helper()
	return gatedSessionWith(t, pipe.SessionOptions{Microbatches: microbatches, Microbatching: mode})
}

// gatedSessionWith is a session of the gated model with opts, whose InputSpecs it sets.
func gatedSessionWith(t *testing.T, opts pipe.SessionOptions) *gated {
	t.Helper()
	if gateErr != nil {
		t.Fatalf("no test gate: %v (set LIBPIPE_TEST_GATE_LIB, or put libpipe_test_gate.so in LIBPIPE_FIXTURES)",
			gateErr)
	}
	model := must(pipe.LoadModel(fixture(t, "gated.scripted.pt")))(t)
	t.Cleanup(func() { model.Close() })
	plan := must(model.NewPlan(nil))(t)
	t.Cleanup(func() { plan.Close() })
	if plan.NumStages() != 2 {
		t.Fatalf("gated has %d stages, want 2", plan.NumStages())
	}
	// n is replicated: every micro-batch carries the key.
	opts.InputSpecs = []pipe.ChunkSpec{{Kind: pipe.ChunkDefault}, pipe.Replicate}
	session := must(plan.NewSession(&opts))(t)
	t.Cleanup(func() { session.Close() })
	return &gated{
		session:  session,
		x:        must(pipe.ReadSafetensors(fixture(t, "gated.inputs.safetensors")))(t).Get("x"),
		expected: must(pipe.ReadSafetensors(fixture(t, "gated.expected.safetensors")))(t).Get("output"),
	}
}

// key is a new gate key whose gates are all opened when the test ends, before its session is
// closed (cleanups run last-in first-out): a test that fails with a call held must not leave
// Close waiting for the gate's own time limit.
func (g *gated) key(t *testing.T) int64 {
	k := gate.NewKey()
	t.Cleanup(func() { gate.Open(k, "") })
	return k
}

// inputs is the fixture's x with gate key n.
func (g *gated) inputs(n int64) []*pipe.Tensor { return []*pipe.Tensor{g.x, pipe.Scalar(n)} }

// checkOutput checks a call's outputs against eager PyTorch's.
func (g *gated) checkOutput(t *testing.T, what string, out pipe.TensorList) {
	t.Helper()
	if diff := maxAbsDiff(t, out.Get("output"), g.expected); diff > 1e-4 {
		t.Fatalf("%s: max |diff| vs PyTorch = %g", what, diff)
	}
}

// afterFailed opens the gates of key, whose call has already failed, and checks that the
// session still serves: a call with open gates gives eager PyTorch's result. That call's
// micro-batch goes through both stages after the failed call's, so by the time it returns the
// gate counts of key are final: the failed call's micro-batch was dropped before stage 1.
func (g *gated) afterFailed(t *testing.T, key int64) {
	t.Helper()
	openGate(t, key, "")
	g.checkOutput(t, "after a failed call", must(g.session.Run(context.Background(), g.inputs(0)...))(t))
	if n := gateCount(t, key, "stage1", testgate.Arrived); n != 0 {
		t.Fatalf("%d micro-batches of the failed call ran in stage 1", n)
	}
}

func openGate(t *testing.T, key int64, stage string) {
	t.Helper()
	if err := gate.Open(key, stage); err != nil {
		t.Fatal(err)
	}
}

func gateCount(t *testing.T, key int64, stage, what string) int {
	t.Helper()
	return must(gate.Count(key, stage, what))(t)
}

func waitGate(t *testing.T, key int64, stage, what string, count int) {
	t.Helper()
	if err := gate.Wait(key, stage, what, count); err != nil {
		t.Fatal(err)
	}
}

// receive is the value from c, failing the test if none comes within the gate's wait limit
// (a bound for a hung test only: the test has made sure that the value comes).
func receive[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(testgate.WaitLimit):
		t.Fatalf("%s: nothing after %v", what, testgate.WaitLimit)
		panic("unreachable")
	}
}
