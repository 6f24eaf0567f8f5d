package pipe_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/libpipe/libpipe/bindings/go/internal/capi"
	"github.com/libpipe/libpipe/bindings/go/internal/testgate"
)

// The fixtures (demo.pt, gated.scripted.pt and their safetensors files, the test gate's
// libpipe_test_gate.so) come from the project's generators; run-tests.sh points
// LIBPIPE_FIXTURES at them.
func fixture(t testing.TB, name string) string {
	t.Helper()
	dir := os.Getenv("LIBPIPE_FIXTURES")
	if dir == "" {
		t.Fatal("LIBPIPE_FIXTURES is not set: point it at the directory holding demo.pt " +
			"(bindings/go/run-tests.sh does)")
	}
	path := filepath.Join(dir, name)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("fixture: %v", err)
	}
	return path
}

// must(f())(t) is f's value, failing the test if f returned an error.
func must[T any](v T, err error) func(testing.TB) T {
	return func(t testing.TB) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// asError checks that err is a *pipe.Error with the given status and a message.
func asError(t testing.TB, err error, want pipe.Status) *pipe.Error {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v", want)
	}
	var pe *pipe.Error
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T) is not a *pipe.Error", err, err)
	}
	if pe.Status != want || !errors.Is(err, want) {
		t.Fatalf("status %v, want %v (error: %v)", pe.Status, want, err)
	}
	if pe.Message == "" {
		t.Fatalf("error %v has no message", err)
	}
	return pe
}

func maxAbsDiff(t testing.TB, got, want *pipe.Tensor) float64 {
	t.Helper()
	if got == nil || want == nil {
		t.Fatalf("missing tensor: got %v, want %v", got, want)
	}
	if !slices.Equal(got.Shape(), want.Shape()) || got.DType() != want.DType() {
		t.Fatalf("got %v, want %v", got, want)
	}
	a, b := got.Float32s(), want.Float32s()
	d := 0.0
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i])-float64(b[i])))
	}
	return d
}

// demo is the 4-block MLP cut before blocks.2, as every example does.
type demo struct {
	model    *pipe.Model
	plan     *pipe.Plan
	session  *pipe.Session
	x        *pipe.Tensor
	expected *pipe.Tensor
}

func newDemo(t testing.TB, microbatches int) *demo {
	t.Helper()
	d := &demo{}
	d.model = must(pipe.LoadModel(fixture(t, "demo.pt")))(t)
	t.Cleanup(func() { d.model.Close() })
	d.plan = must(d.model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.2:begin"}}))(t)
	t.Cleanup(func() { d.plan.Close() })
	d.session = must(d.plan.NewSession(&pipe.SessionOptions{Microbatches: microbatches}))(t)
	t.Cleanup(func() { d.session.Close() })
	d.x = must(pipe.ReadSafetensors(fixture(t, "demo.inputs.safetensors")))(t).Get("x")
	d.expected = must(pipe.ReadSafetensors(fixture(t, "demo.expected.safetensors")))(t).Get("output")
	if d.x == nil || d.expected == nil {
		t.Fatal("fixture files lack x or output")
	}
	return d
}

func TestVersionMatchesHeader(t *testing.T) {
	// The library loaded at run time must be the one whose header SWIG wrapped.
	want := fmt.Sprintf("%d.%d.%d", capi.PIPE_VERSION_MAJOR, capi.PIPE_VERSION_MINOR, capi.PIPE_VERSION_PATCH)
	if v := pipe.Version(); v != want {
		t.Fatalf("Version() = %q, header says %q", v, want)
	}
}

func TestDemoMatchesReference(t *testing.T) {
	d := newDemo(t, 4)
	if got := d.plan.NumStages(); got != 2 {
		t.Fatalf("plan has %d stages, want 2", got)
	}
	if got := d.session.NumStages(); got != 2 {
		t.Fatalf("session has %d stages, want 2", got)
	}
	if names := d.model.InputNames(); !slices.Equal(names, []string{"x"}) {
		t.Fatalf("input names %v, want [x]", names)
	}

	// context.Background() takes pipe_session_run; a cancellable context takes submit + wait.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, c := range []context.Context{context.Background(), ctx} {
		out := must(d.session.Run(c, d.x))(t)
		if names := out.Names(); !slices.Equal(names, []string{"output"}) {
			t.Fatalf("output names %v, want [output]", names)
		}
		if diff := maxAbsDiff(t, out.Get("output"), d.expected); diff > 1e-4 {
			t.Fatalf("max |diff| vs PyTorch = %g", diff)
		}
	}

	// Two calls of 4 micro-batches went through both stages: with adaptive micro-batching (the
	// default) a call that finds the pipeline empty, as each of these sequential calls does,
	// still gets all 4.
	stats := must(d.session.Stats())(t)
	for i, s := range stats {
		if s.Microbatches != 8 || s.Failures != 0 || s.Busy <= 0 {
			t.Errorf("stage %d stats %+v, want 8 micro-batches, no failures, some busy time", i, s)
		}
	}
}

func TestTrace(t *testing.T) {
	d := newDemo(t, 4)
	if err := d.session.TraceStart(); err != nil {
		t.Fatal(err)
	}
	must(d.session.Run(context.Background(), d.x))(t)
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := d.session.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	// Chrome trace: one slice per micro-batch per stage, 4 x 2 here.
	var trace struct {
		TraceEvents []struct {
			Ph string `json:"ph"`
		} `json:"traceEvents"`
	}
	if err := json.Unmarshal(must(os.ReadFile(path))(t), &trace); err != nil {
		t.Fatal(err)
	}
	slicesRun := 0
	for _, e := range trace.TraceEvents {
		if e.Ph == "X" {
			slicesRun++
		}
	}
	if slicesRun != 8 {
		t.Fatalf("trace has %d complete events, want 8", slicesRun)
	}
	// "" discards (pipe_session_trace_stop with NULL).
	if err := d.session.TraceStart(); err != nil {
		t.Fatal(err)
	}
	if err := d.session.TraceStop(""); err != nil {
		t.Fatal(err)
	}
}

func TestPlanIntrospection(t *testing.T) {
	d := newDemo(t, 1)
	var desc struct {
		NumStages int    `json:"num_stages"`
		Method    string `json:"method"`
		Stages    []struct {
			Parameters []string `json:"parameters"`
		} `json:"stages"`
	}
	if err := json.Unmarshal([]byte(must(d.plan.Describe())(t)), &desc); err != nil {
		t.Fatal(err)
	}
	if desc.NumStages != 2 || len(desc.Stages) != 2 || desc.Method != "split points" {
		t.Fatalf("describe: %+v", desc)
	}
	// Stage 0 holds blocks 0-1, stage 1 blocks 2-3: the cut was where we asked.
	for i := 0; i < 2; i++ {
		info := must(d.plan.Stage(i))(t)
		if !slices.Equal(info.Parameters, desc.Stages[i].Parameters) || len(info.Parameters) == 0 || info.ParamBytes == 0 {
			t.Fatalf("stage %d: %+v vs describe %v", i, info, desc.Stages[i].Parameters)
		}
		for _, p := range info.Parameters {
			inLater := strings.HasPrefix(p, "blocks.2.") || strings.HasPrefix(p, "blocks.3.")
			inEarlier := strings.HasPrefix(p, "blocks.0.") || strings.HasPrefix(p, "blocks.1.")
			if (i == 0 && inLater) || (i == 1 && inEarlier) {
				t.Errorf("stage %d holds %s", i, p)
			}
		}
	}
	mods := must(d.model.Modules())(t)
	if len(mods) == 0 || mods[0].Path != "" || mods[0].Depth != 0 || mods[0].NumParams == 0 ||
		!slices.ContainsFunc(mods, func(m pipe.ModuleInfo) bool { return m.Path == "blocks.2" && m.Depth == 2 }) {
		t.Fatalf("modules: %+v", mods)
	}
	path := filepath.Join(t.TempDir(), "stage1.pt")
	if err := d.plan.SaveStage(1, path, nil); err != nil {
		t.Fatal(err)
	}
	// The saved stage is itself a loadable TorchScript model.
	stage := must(pipe.LoadModel(path))(t)
	stage.Close()
}

func TestMarkersAndPolicies(t *testing.T) {
	model := must(pipe.LoadModel(fixture(t, "demo.pt")))(t)
	defer model.Close()
	x := must(pipe.ReadSafetensors(fixture(t, "demo.inputs.safetensors")))(t).Get("x")
	expected := must(pipe.ReadSafetensors(fixture(t, "demo.expected.safetensors")))(t).Get("output")
	for _, tc := range []struct {
		opts   *pipe.PlanOptions
		stages int
	}{
		{nil, 4}, // the three pipe::split() markers
		{&pipe.PlanOptions{Stages: 2, Policy: "params"}, 2},
		{&pipe.PlanOptions{Stages: 2, Policy: "time", ExampleInputs: []*pipe.Tensor{x}}, 2},
	} {
		plan := must(model.NewPlan(tc.opts))(t)
		if plan.NumStages() != tc.stages {
			t.Fatalf("%+v: %d stages, want %d", tc.opts, plan.NumStages(), tc.stages)
		}
		if tc.opts != nil && tc.opts.Policy == "time" {
			if ms := must(plan.Stage(0))(t).EstimatedMS; ms < 0 {
				t.Fatalf("policy time gave no estimate (%g)", ms)
			}
		}
		session := must(plan.NewSession(&pipe.SessionOptions{Microbatches: 2}))(t)
		out := must(session.Run(context.Background(), x))(t)
		if diff := maxAbsDiff(t, out.Get("output"), expected); diff > 1e-4 {
			t.Fatalf("%+v: max |diff| = %g", tc.opts, diff)
		}
		session.Close()
		plan.Close()
	}
}

func TestStageOptions(t *testing.T) {
	d := newDemo(t, 2)
	// bfloat16 weights: the same result to bfloat16's precision, and a float32 result
	// (inputs are converted, outputs come back in the stage's dtype).
	bf16 := &pipe.StageOptions{DType: pipe.BFloat16}
	session := must(d.plan.NewSession(&pipe.SessionOptions{Microbatches: 2, Stage: bf16}))(t)
	defer session.Close()
	out := must(session.Run(context.Background(), d.x))(t).Get("output")
	if out == nil {
		t.Fatal("no output")
	}
	if out.DType() != pipe.BFloat16 || !slices.Equal(out.Shape(), d.expected.Shape()) {
		t.Fatalf("bfloat16 run gave %v", out)
	}
	got := pipe.MustTensor(out.AsFloat32(), out.Shape()...)
	if diff := maxAbsDiff(t, got, d.expected); diff > 0.1 || diff == 0 {
		t.Fatalf("bfloat16 run: max |diff| = %g, want small but non-zero", diff)
	}

	missing := filepath.Join(t.TempDir(), "weights.safetensors")
	_, err := d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{Weights: missing}})
	if pe := asError(t, err, pipe.StatusNotFound); !strings.Contains(pe.Message, "weights.safetensors") {
		t.Fatalf("missing checkpoint not named: %q", pe.Message)
	}
	_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{DType: pipe.Int8}})
	asError(t, err, pipe.StatusInvalidArgument)

	// 8-bit linear weights: the same result to int8's precision, in float32. (CPUs without AVX-512 refuse them.)
	int8 := &pipe.StageOptions{Quantize: pipe.QuantizeInt8}
	quantized, err := d.plan.NewSession(&pipe.SessionOptions{Microbatches: 2, Stage: int8})
	if err != nil {
		asError(t, err, pipe.StatusUnsupported)
	} else {
		defer quantized.Close()
		out := must(quantized.Run(context.Background(), d.x))(t).Get("output")
		if out == nil || out.DType() != pipe.Float32 {
			t.Fatalf("int8 run gave %v", out)
		}
		if diff := maxAbsDiff(t, out, d.expected); diff > 0.1 || diff == 0 {
			t.Fatalf("int8 run: max |diff| = %g, want small but non-zero", diff)
		}
	}
	// 4-bit linear weights in groups of 64 (libpipe >= 0.14): further from the float result, still close.
	int4 := &pipe.StageOptions{Quantize: pipe.QuantizeInt4, QuantizeGroup: 64}
	quantized4, err := d.plan.NewSession(&pipe.SessionOptions{Microbatches: 2, Stage: int4})
	if err != nil {
		asError(t, err, pipe.StatusUnsupported)
	} else {
		defer quantized4.Close()
		out := must(quantized4.Run(context.Background(), d.x))(t).Get("output")
		if out == nil || out.DType() != pipe.Float32 {
			t.Fatalf("int4 run gave %v", out)
		}
		if diff := maxAbsDiff(t, out, d.expected); diff > 0.5 || diff == 0 {
			t.Fatalf("int4 run: max |diff| = %g, want small but non-zero", diff)
		}
	}
	_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{Quantize: pipe.QuantizeInt4, QuantizeGroup: 48}})
	asError(t, err, pipe.StatusInvalidArgument)
	_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{Quantize: 7}})
	asError(t, err, pipe.StatusInvalidArgument)

	// The output head's storage (libpipe >= 0.16): each choice passes with quantized weights (the demo's last
	// layer is its head), is libpipe's InvalidArgument without them, and an unknown one is refused here.
	for _, head := range []pipe.HeadQuantization{pipe.QuantizeHeadInt8, pipe.QuantizeHeadInt4, pipe.QuantizeHeadNone} {
		s, err := d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{Quantize: pipe.QuantizeInt8, QuantizeHead: head}})
		if err != nil {
			asError(t, err, pipe.StatusUnsupported)
		} else {
			out := must(s.Run(context.Background(), d.x))(t).Get("output")
			if diff := maxAbsDiff(t, out, d.expected); diff > 0.5 {
				t.Fatalf("int8 weights, head %d: max |diff| = %g", head, diff)
			}
			s.Close()
		}
		_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{QuantizeHead: head}})
		if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, "quantize_head") {
			t.Fatalf("head %d without quantized weights: %q", head, pe.Message)
		}
	}
	_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{Quantize: pipe.QuantizeInt8, QuantizeHead: 9}})
	asError(t, err, pipe.StatusInvalidArgument)

	// The embedding's storage (libpipe >= 0.17) reaches libpipe without quantized weights: the demo has no
	// embedding table, so its results are the float model's; an unknown value is refused here.
	{
		s := must(d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{QuantizeEmbedding: pipe.QuantizeEmbeddingInt8}}))(t)
		out := must(s.Run(context.Background(), d.x))(t).Get("output")
		if diff := maxAbsDiff(t, out, d.expected); diff > 1e-4 {
			t.Fatalf("int8 embedding: max |diff| = %g", diff)
		}
		s.Close()
		_, err = d.plan.NewSession(&pipe.SessionOptions{Stage: &pipe.StageOptions{QuantizeEmbedding: 2}})
		if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, "QuantizeEmbeddingInt8") {
			t.Fatalf("embedding quantization 2: %q", pe.Message)
		}
	}

	// The bytes a stage stores (libpipe >= 0.16): float panels hold at least the model's bytes, 8-bit codes fewer
	// (where the CPU stores them at all); options a session refuses are refused here too.
	last := d.plan.NumStages() - 1
	info := must(d.plan.Stage(last))(t)
	plain := must(d.plan.StageWeightBytes(last, nil))(t)
	if plain < info.ParamBytes {
		t.Fatalf("stage %d stores %d bytes as float panels, fewer than its %d", last, plain, info.ParamBytes)
	}
	if int8Bytes, err := d.plan.StageWeightBytes(last, &pipe.StageOptions{Quantize: pipe.QuantizeInt8}); err != nil {
		asError(t, err, pipe.StatusUnsupported)
	} else if int8Bytes >= plain {
		t.Fatalf("stage %d stores %d bytes as int8, not fewer than %d as float", last, int8Bytes, plain)
	}
	_, err = d.plan.StageWeightBytes(last, &pipe.StageOptions{QuantizeHead: pipe.QuantizeHeadInt4})
	asError(t, err, pipe.StatusInvalidArgument)
}

func TestErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-such-model.pt")
	_, err := pipe.LoadModel(missing)
	pe := asError(t, err, pipe.StatusNotFound)
	if pe.Op != "pipe_model_load" || !errors.Is(err, pipe.ErrNotFound) || errors.Is(err, pipe.ErrInput) ||
		!strings.Contains(pe.Message, missing) {
		t.Fatalf("missing model: %#v", pe)
	}
	if want := "pipe: pipe_model_load: " + pe.Message + " (PIPE_ERR_NOT_FOUND)"; err.Error() != want {
		t.Fatalf("Error() = %q, want %q", err.Error(), want)
	}

	// A safetensors file is not a TorchScript archive.
	_, err = pipe.LoadModel(fixture(t, "demo.inputs.safetensors"))
	asError(t, err, pipe.StatusInvalidFormat)

	_, err = pipe.ReadSafetensors(missing)
	asError(t, err, pipe.StatusNotFound)

	d := newDemo(t, 4)
	// Unknown module: the message names it.
	_, err = d.model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.99:begin"}})
	if pe := asError(t, err, pipe.StatusSplit); !strings.Contains(pe.Message, "blocks.99") {
		t.Fatalf("message does not name the split point: %q", pe.Message)
	}
	// Bad syntax is refused when the option is added.
	_, err = d.model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.2"}})
	asError(t, err, pipe.StatusInvalidArgument)
	_, err = d.model.NewPlan(&pipe.PlanOptions{Stages: 2, Policy: "no-such-policy"})
	asError(t, err, pipe.StatusInvalidArgument)

	// Wrong input count, through both paths of Run and through Submit.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, c := range []context.Context{context.Background(), ctx} {
		_, err = d.session.Run(c)
		asError(t, err, pipe.StatusInput)
		_, err = d.session.Run(c, d.x, d.x)
		asError(t, err, pipe.StatusInput)
	}
	_, err = d.session.Submit(ctx, d.x, d.x)
	asError(t, err, pipe.StatusInput)
	_, err = d.session.Run(ctx, nil)
	asError(t, err, pipe.StatusInvalidArgument)

	// A stage that raises (a 255-wide input for a 256-wide layer) fails the call with
	// ErrExecution naming the stage, in the blocking call and in Wait after Submit.
	bad := pipe.MustTensor(make([]float32, 32*255), 32, 255)
	for _, c := range []context.Context{context.Background(), ctx} {
		_, err = d.session.Run(c, bad)
		if pe := asError(t, err, pipe.StatusExecution); !strings.Contains(pe.Message, "stage 0") {
			t.Fatalf("execution error does not name the stage: %q", pe.Message)
		}
	}
	if st := must(d.session.StageStats(0))(t); st.Failures == 0 {
		t.Fatalf("stage 0 stats show no failures: %+v", st)
	}

	// The session stays usable after failed calls.
	out := must(d.session.Run(ctx, d.x))(t)
	if diff := maxAbsDiff(t, out.Get("output"), d.expected); diff > 1e-4 {
		t.Fatalf("after errors: max |diff| = %g", diff)
	}

	// Closed handles fail cleanly, and Close is idempotent.
	d.session.Close()
	d.session.Close()
	_, err = d.session.Run(context.Background(), d.x)
	if !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("run on a closed session: %v", err)
	}
	d.plan.Close()
	_, err = d.plan.Describe()
	if !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("describe on a closed plan: %v", err)
	}
}

// pipe_last_error is per thread; the binding must read it on the thread whose call failed, even
// though the scheduler moves goroutines between threads around cgo calls. Each goroutine's
// failures name something of its own, so a message read on the wrong thread shows. (Without
// the binding's thread locking this fails most runs, not every run: a goroutine only moves when
// the runtime takes its P during the C call, which slower failing calls make likely.)
func TestErrorMessagesPerGoroutine(t *testing.T) {
	model := must(pipe.LoadModel(fixture(t, "demo.pt")))(t)
	defer model.Close()
	dir := t.TempDir()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 30; i++ {
				// A missing file (fast) and an unknown module (slower: the graph is inlined).
				name := fmt.Sprintf("missing-%d-%d.pt", g, i)
				_, err := pipe.LoadModel(filepath.Join(dir, name))
				var pe *pipe.Error
				if !errors.As(err, &pe) || !strings.Contains(pe.Message, name) {
					errs <- fmt.Errorf("goroutine %d: error %v does not name %s", g, err, name)
					return
				}
				module := fmt.Sprintf("nosuch%d_%d", g, i)
				_, err = model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{module + ":begin"}})
				if !errors.As(err, &pe) || !strings.Contains(pe.Message, module) {
					errs <- fmt.Errorf("goroutine %d: error %v does not name %s", g, err, module)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// A call ended by its context, a deadline or Cancel returns while its micro-batch is still held
// in stage 0 (its gate is shut): stage 1 has run nothing when the call returns, which a call that
// finished could not show.
func checkEndedEarly(t *testing.T, session *pipe.Session) {
	t.Helper()
	if st := must(session.StageStats(1))(t); st.Microbatches != 0 {
		t.Fatalf("stage 1 ran %d micro-batches: the call was not stopped early", st.Microbatches)
	}
}

func TestCancelViaContext(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	key := g.key(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := g.session.Run(ctx, g.inputs(key)...)
		done <- err
	}()
	// The call is running in stage 0, held at its gate: it cannot finish before it is cancelled.
	waitGate(t, key, "stage0", testgate.Arrived, 1)
	cancel()
	err := receive(t, done, "Run after its context was cancelled")
	asError(t, err, pipe.StatusCancelled)
	if !errors.Is(err, context.Canceled) || errors.Is(err, pipe.ErrDeadlineExceeded) {
		t.Fatalf("error %v should match ErrCancelled and context.Canceled only", err)
	}
	checkEndedEarly(t, g.session)
	g.afterFailed(t, key)
}

func TestDeadlineViaContext(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	key := g.key(t)
	// The gate stays shut, so the call cannot finish before its deadline, however long the
	// deadline is and wherever it finds the call (queued for stage 0 or held in it): the deadline
	// is the one way this call can end. Run returns once the deadline has passed.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := g.session.Run(ctx, g.inputs(key)...)
	asError(t, err, pipe.StatusDeadlineExceeded)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, pipe.ErrDeadlineExceeded) {
		t.Fatalf("error %v should match both deadline sentinels", err)
	}
	checkEndedEarly(t, g.session)

	// A context past its deadline fails before anything is submitted: the gate of a new key
	// never sees a micro-batch (it would hold it).
	<-ctx.Done()
	late := g.key(t)
	_, err = g.session.Run(ctx, g.inputs(late)...)
	asError(t, err, pipe.StatusDeadlineExceeded)
	g.afterFailed(t, key)
	if n := gateCount(t, late, "stage0", testgate.Arrived); n != 0 {
		t.Fatalf("a call past its deadline reached stage 0 (%d micro-batches)", n)
	}
}

func TestSubmitWaitTimeoutCancel(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	key := g.key(t)
	req := must(g.session.Submit(context.Background(), g.inputs(key)...))(t)
	defer req.Close()
	waitGate(t, key, "stage0", testgate.Arrived, 1)
	// Held in stage 0: a check and a bounded wait both find it still running.
	_, err := req.WaitTimeout(0)
	asError(t, err, pipe.StatusTimeout)
	_, err = req.WaitTimeout(20 * time.Millisecond)
	asError(t, err, pipe.StatusTimeout)
	if err := req.Cancel(); err != nil {
		t.Fatal(err)
	}
	_, err = req.Wait()
	asError(t, err, pipe.StatusCancelled)
	if errors.Is(err, context.Canceled) {
		t.Fatalf("an explicit Cancel is not a context cancellation: %v", err)
	}
	checkEndedEarly(t, g.session)
	// A finished call gives the same result again.
	_, err = req.Wait()
	asError(t, err, pipe.StatusCancelled)
	req.Close()
	_, err = req.Wait()
	if !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("wait on a closed request: %v", err)
	}
	g.afterFailed(t, key)
}

// Closing a session fails the calls still in flight with ErrCancelled, except that a stage
// already running a micro-batch finishes it; their requests outlive the session. Three calls,
// each with a gate key of its own: the first is held in stage 0, the other two queue behind it.
// The session is closed while stage 0's gates are opened; stage 1's stay shut, so a call that
// reaches stage 1 before the closing session stops taking work is held there, in view, and then
// let through: it must finish with the right result, and every call that was not seen in stage 1
// must fail with ErrCancelled. (Close cannot be observed between its start and its end, so how
// many calls reach stage 1 is not fixed; each call's outcome follows from where it was seen.)
func TestCloseSessionWithCallsInFlight(t *testing.T) {
	g := gatedSession(t, 1, pipe.MicrobatchingAdaptive)
	var keys []int64
	var reqs []*pipe.Request
	for i := 0; i < 3; i++ {
		keys = append(keys, g.key(t))
		reqs = append(reqs, must(g.session.Submit(context.Background(), g.inputs(keys[i])...))(t))
		defer reqs[i].Close()
	}
	waitGate(t, keys[0], "stage0", testgate.Arrived, 1)

	closed := make(chan error, 1)
	go func() { closed <- g.session.Close() }()
	for _, k := range keys {
		openGate(t, k, "stage0")
	}
	reached := map[int64]bool{} // calls seen held in stage 1, then let through
	closeErr := error(nil)
	err := testgate.Until(func() (bool, error) {
		select {
		case closeErr = <-closed:
			return true, nil
		default:
		}
		for _, k := range keys {
			if !reached[k] && gateCount(t, k, "stage1", testgate.Arrived) > 0 {
				reached[k] = true
				openGate(t, k, "stage1")
			}
		}
		return false, nil
	}, func() string { return fmt.Sprintf("Close has not returned; calls let through stage 1: %v", reached) })
	if err != nil {
		t.Fatal(err)
	}
	if closeErr != nil {
		t.Fatal(closeErr)
	}
	t.Logf("calls that reached stage 1 before the session stopped: %v", reached)

	for i, r := range reqs {
		out, err := r.Wait()
		if reached[keys[i]] {
			if err != nil {
				t.Fatalf("request %d was running in the last stage, which finishes it: %v", i, err)
			}
			g.checkOutput(t, fmt.Sprintf("request %d", i), out)
			continue
		}
		if pe := asError(t, err, pipe.StatusCancelled); errors.Is(err, context.Canceled) {
			t.Fatalf("request %d: %#v", i, pe)
		}
	}
	_, err = g.session.Submit(context.Background(), g.inputs(0)...)
	if !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("submit on a closed session: %v", err)
	}
}

func TestSubmitManyThenWait(t *testing.T) {
	d := newDemo(t, 4)
	var reqs []*pipe.Request
	for i := 0; i < 6; i++ {
		reqs = append(reqs, must(d.session.Submit(context.Background(), d.x))(t))
	}
	for _, r := range reqs {
		out := must(r.Wait())(t)
		if diff := maxAbsDiff(t, out.Get("output"), d.expected); diff > 1e-4 {
			t.Fatalf("max |diff| = %g", diff)
		}
		r.Close()
	}
}

// runConcurrently runs goroutines x calls calls of the demo input on session at once and checks
// every result against the reference.
func runConcurrently(t *testing.T, d *demo, session *pipe.Session, goroutines, calls int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*calls)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Half the goroutines use the blocking call, half submit + wait (the path a context
			// that can end takes; this one has no deadline, so no clock can fail a call).
			ctx := context.Background()
			if g%2 == 1 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				defer cancel()
			}
			for i := 0; i < calls; i++ {
				// Each goroutine owns its input tensor (a copy), as a server's requests would.
				x := pipe.MustTensor(slices.Clone(d.x.Float32s()), d.x.Shape()...)
				out, err := session.Run(ctx, x)
				if err != nil {
					errs <- err
					return
				}
				var diff float64
				a, b := out.Get("output").Float32s(), d.expected.Float32s()
				for j := range b {
					diff = math.Max(diff, math.Abs(float64(a[j])-float64(b[j])))
				}
				if diff > 1e-4 {
					errs <- fmt.Errorf("goroutine %d call %d: max |diff| = %g", g, i, diff)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// Many goroutines on one session: every result equals the reference. With fixed micro-batching
// every call is cut into exactly M micro-batches, however the calls overlap; with adaptive
// micro-batching (the default) a call that overlaps others gets between 1 and M, depending on
// timing, and the results are the same.
func TestConcurrentRuns(t *testing.T) {
	const goroutines, calls, m = 8, 3, 4
	const total = goroutines * calls
	d := newDemo(t, 1)
	for _, mode := range []pipe.Microbatching{pipe.MicrobatchingFixed, pipe.MicrobatchingAdaptive} {
		t.Run(mode.String(), func(t *testing.T) {
			opts := &pipe.SessionOptions{Microbatches: m}
			if mode != pipe.MicrobatchingAdaptive {
				opts.Microbatching = mode // adaptive: the zero value, i.e. the default
			}
			session := must(d.plan.NewSession(opts))(t)
			defer session.Close()
			runConcurrently(t, d, session, goroutines, calls)
			for i, s := range must(session.Stats())(t) {
				switch {
				case mode == pipe.MicrobatchingFixed && s.Microbatches != m*total:
					t.Errorf("stage %d ran %d micro-batches, want %d", i, s.Microbatches, m*total)
				case s.Microbatches < total || s.Microbatches > m*total:
					t.Errorf("stage %d ran %d micro-batches, want %d to %d", i, s.Microbatches, total, m*total)
				}
				t.Logf("%s: stage %d ran %d micro-batches for %d calls", mode, i, s.Microbatches, total)
			}
		})
	}
}

// The rule itself, on states the test has seen: a call submitted while another one's 4
// micro-batches are in the 2-stage pipeline (held at stage 0's gate) is cut into just 1
// micro-batch when adaptive (the pipeline already holds more than one per stage), into 4 when
// fixed. Both calls' results equal the reference either way.
func TestAdaptiveMicrobatching(t *testing.T) {
	const m = 4
	for _, tc := range []struct {
		mode pipe.Microbatching
		want uint64 // micro-batches each stage runs for both calls
	}{
		{pipe.MicrobatchingAdaptive, m + 1},
		{pipe.MicrobatchingFixed, m + m},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			g := gatedSession(t, m, tc.mode)
			key := g.key(t)
			busy := must(g.session.Submit(context.Background(), g.inputs(key)...))(t)
			defer busy.Close()
			waitGate(t, key, "stage0", testgate.Arrived, 1)
			late := must(g.session.Submit(context.Background(), g.inputs(0)...))(t)
			defer late.Close()
			if _, err := busy.WaitTimeout(0); !errors.Is(err, pipe.ErrTimeout) {
				t.Fatalf("the held call is not running: %v", err)
			}
			openGate(t, key, "")
			g.checkOutput(t, "late call", must(late.Wait())(t))
			g.checkOutput(t, "first call", must(busy.Wait())(t))
			if n := gateCount(t, key, "stage1", testgate.Left); n != m {
				t.Fatalf("%d of the first call's micro-batches passed stage 1, want %d", n, m)
			}
			for i, s := range must(g.session.Stats())(t) {
				if s.Microbatches != tc.want {
					t.Errorf("stage %d ran %d micro-batches, want %d (%d for the first call, the rest for the late one)",
						i, s.Microbatches, tc.want, m)
				}
			}
		})
	}
}

func TestMicrobatchingOption(t *testing.T) {
	if pipe.MicrobatchingAdaptive != 0 || (pipe.SessionOptions{}).Microbatching != pipe.MicrobatchingAdaptive {
		t.Fatal("the zero value must be adaptive micro-batching, pipe.h's default")
	}
	if pipe.MicrobatchingFixed.String() != "fixed" || pipe.Microbatching(7).String() != "Microbatching(7)" {
		t.Fatalf("String(): %q, %q", pipe.MicrobatchingFixed, pipe.Microbatching(7))
	}
	// A value pipe.h does not define reaches libpipe, which refuses it.
	d := newDemo(t, 1)
	_, err := d.plan.NewSession(&pipe.SessionOptions{Microbatches: 2, Microbatching: 7})
	if pe := asError(t, err, pipe.StatusInvalidArgument); !strings.Contains(pe.Message, "microbatching") {
		t.Fatalf("message does not name the option: %q", pe.Message)
	}
}

func TestDevicesOption(t *testing.T) {
	d := newDemo(t, 1)
	// Every stage on the CPU, spelled out: the same result as the default placement.
	s, err := d.plan.NewSession(&pipe.SessionOptions{Microbatches: 2, Devices: "cpu,cpu"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out := must(s.Run(context.Background(), d.x))(t)
	if diff := maxAbsDiff(t, out.Get("output"), d.expected); diff > 1e-4 {
		t.Fatalf("max |diff| vs PyTorch = %g", diff)
	}
	// A GPU the machine does not have is named; a malformed list is refused.
	_, err = d.plan.NewSession(&pipe.SessionOptions{Devices: "cpu,cuda:64"})
	if pe := asError(t, err, pipe.StatusUnsupported); !strings.Contains(pe.Message, "stage 1 is on cuda:64") {
		t.Fatalf("message does not name the stage and device: %q", pe.Message)
	}
	_, err = d.plan.NewSession(&pipe.SessionOptions{Devices: "gpu"})
	asError(t, err, pipe.StatusInvalidArgument)
}

func TestSafetensorsRoundTrip(t *testing.T) {
	half, err := pipe.NewHalfTensor(pipe.Float16, []uint16{0x3c00, 0xc000}, 2) // 1.0, -2.0
	if err != nil {
		t.Fatal(err)
	}
	in := pipe.TensorList{
		{Name: "f32", Tensor: pipe.MustTensor([]float32{1, 2, 3, 4, 5, 6}, 2, 3)},
		{Name: "f64", Tensor: pipe.MustTensor([]float64{-1.5, math.Pi}, 2, 1)},
		{Name: "i64", Tensor: pipe.Scalar(int64(-7))},
		{Name: "i32", Tensor: pipe.MustTensor([]int32{1 << 30, -3}, 2)},
		{Name: "i16", Tensor: pipe.MustTensor([]int16{-2, 3}, 1, 2)},
		{Name: "i8", Tensor: pipe.MustTensor([]int8{-128, 127}, 2)},
		{Name: "u8", Tensor: pipe.MustTensor([]uint8{0, 255}, 2)},
		{Name: "bool", Tensor: pipe.MustTensor([]bool{true, false, true}, 3)},
		{Name: "f16", Tensor: half},
		{Name: "empty", Tensor: pipe.MustTensor([]float32{}, 0, 4)},
	}
	path := filepath.Join(t.TempDir(), "t.safetensors")
	if err := pipe.WriteSafetensors(path, in); err != nil {
		t.Fatal(err)
	}
	// Read back with libpipe's reader, which validates the file.
	out := must(pipe.ReadSafetensors(path))(t)
	if !slices.Equal(out.Names(), in.Names()) {
		t.Fatalf("names %v, want %v", out.Names(), in.Names())
	}
	for i := range in {
		a, b := in[i].Tensor, out[i].Tensor
		if a.DType() != b.DType() || !slices.Equal(a.Shape(), b.Shape()) || fmt.Sprint(a.Data()) != fmt.Sprint(b.Data()) {
			t.Errorf("%s: wrote %v %v, read %v %v", in[i].Name, a, a.Data(), b, b.Data())
		}
	}
	// libpipe copied the tensors: the caller's slices are untouched and still theirs.
	if got := in[0].Tensor.Float32s(); !slices.Equal(got, []float32{1, 2, 3, 4, 5, 6}) {
		t.Fatalf("the input changed: %v", got)
	}
}

func TestWriteSafetensorsErrors(t *testing.T) {
	a := pipe.MustTensor([]float32{1, 2}, 2)
	b := pipe.MustTensor([]int64{3}, 1)
	path := filepath.Join(t.TempDir(), "t.safetensors")
	if err := pipe.WriteSafetensors(path, pipe.TensorList{{Name: "kept", Tensor: a}}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		what    string
		list    pipe.TensorList
		status  pipe.Status
		message string // a piece of the message that says what was wrong
	}{
		// Refused by pipe_tensor_list_append, before anything is written.
		{"repeated name", pipe.TensorList{{Name: "a", Tensor: a}, {Name: "a", Tensor: b}}, pipe.StatusInvalidArgument, "'a'"},
		{"empty name", pipe.TensorList{{Name: "", Tensor: a}}, pipe.StatusInvalidArgument, "empty"},
		// Refused by libpipe's writer: the header key is reserved by the format.
		{"reserved name", pipe.TensorList{{Name: "__metadata__", Tensor: a}}, pipe.StatusInvalidArgument, "__metadata__"},
		// Refused by the binding: C would see "x" only.
		{"NUL in name", pipe.TensorList{{Name: "x\x00y", Tensor: a}}, pipe.StatusInvalidArgument, "NUL"},
		{"nil tensor", pipe.TensorList{{Name: "a", Tensor: a}, {Name: "b"}}, pipe.StatusInvalidArgument, "nil"},
	}
	for _, c := range cases {
		err := pipe.WriteSafetensors(path, c.list)
		// asError also checks errors.Is(err, c.status), i.e. pipe.ErrInvalidArgument.
		if pe := asError(t, err, c.status); !strings.Contains(pe.Message, c.message) {
			t.Errorf("%s: message %q does not contain %q", c.what, pe.Message, c.message)
		}
	}
	// None of the failed writes replaced the file that was there.
	if got := must(pipe.ReadSafetensors(path))(t); !slices.Equal(got.Names(), []string{"kept"}) {
		t.Fatalf("the file now holds %v", got.Names())
	}
	// A directory that does not exist cannot be written to.
	missing := filepath.Join(t.TempDir(), "missing", "t.safetensors")
	err := pipe.WriteSafetensors(missing, pipe.TensorList{{Name: "a", Tensor: a}})
	asError(t, err, pipe.StatusIO)
}

func TestAsFloat32(t *testing.T) {
	// 1, -2, 65504 (largest half), 2^-24 (smallest subnormal), +inf
	half := must(pipe.NewHalfTensor(pipe.Float16, []uint16{0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00}, 5))(t)
	want := []float32{1, -2, 65504, float32(math.Ldexp(1, -24)), float32(math.Inf(1))}
	if got := half.AsFloat32(); !slices.Equal(got, want) {
		t.Fatalf("float16: %v, want %v", got, want)
	}
	bf := must(pipe.NewHalfTensor(pipe.BFloat16, []uint16{0x3f80, 0xc040}, 2))(t) // 1, -3
	if got := bf.AsFloat32(); !slices.Equal(got, []float32{1, -3}) {
		t.Fatalf("bfloat16: %v", got)
	}
	if got := pipe.MustTensor([]bool{true, false}, 2).AsFloat32(); !slices.Equal(got, []float32{1, 0}) {
		t.Fatalf("bool: %v", got)
	}
}

func TestTensorConstruction(t *testing.T) {
	_, err := pipe.NewTensor([]float32{1, 2, 3}, 2, 2)
	asError(t, err, pipe.StatusInvalidArgument)
	s := pipe.Scalar(int64(5))
	if len(s.Shape()) != 0 || s.NumElements() != 1 || s.Int64s()[0] != 5 || s.Float32s() != nil {
		t.Fatalf("scalar: %v %v", s, s.Data())
	}
	if v, ok := pipe.Values[int64](s); !ok || v[0] != 5 {
		t.Fatal("Values[int64] on an int64 tensor")
	}
	if _, ok := pipe.Values[float32](s); ok {
		t.Fatal("Values[float32] on an int64 tensor")
	}
}
