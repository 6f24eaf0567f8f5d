package pipe_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// traceSlice is a complete event ("ph": "X") of pipe_session_trace_stop's Chrome trace, with the
// args the tests read.
type traceSlice struct {
	Name string  `json:"name"`
	Ph   string  `json:"ph"`
	Tid  int     `json:"tid"`
	Dur  float64 `json:"dur"`
	Args struct {
		Name string `json:"name"` // a thread_name event's: its track's name
		// Numbers: the engine's args are written as floating point ("request": 2.0).
		Request     float64            `json:"request"`
		Tokens      float64            `json:"tokens"`
		OperatorsUS map[string]float64 `json:"operators_us"`
	} `json:"args"`
}

// readTraceTracks reads the trace at path into its slices by track name ("stage 0", "engine").
func readTraceTracks(t *testing.T, path string) map[string][]traceSlice {
	t.Helper()
	var trace struct {
		TraceEvents []traceSlice `json:"traceEvents"`
	}
	if err := json.Unmarshal(must(os.ReadFile(path))(t), &trace); err != nil {
		t.Fatal(err)
	}
	names := map[int]string{}
	for _, e := range trace.TraceEvents {
		if e.Ph == "M" && e.Name == "thread_name" {
			names[e.Tid] = e.Args.Name
		}
	}
	tracks := map[string][]traceSlice{}
	for _, e := range trace.TraceEvents {
		if e.Ph != "X" {
			continue
		}
		name, ok := names[e.Tid]
		if !ok {
			t.Fatalf("slice %q is on track %d, which has no thread_name", e.Name, e.Tid)
		}
		tracks[name] = append(tracks[name], e)
	}
	return tracks
}

// checkOperators asserts that each of a stage's slices holds its time per operator, no more in all
// than the slice lasted (+1 µs: the slice's bounds are whole microseconds), and that the stage's
// linear layers are keyed by exactly the weight shapes in want ("out x in").
func checkOperators(t *testing.T, stage string, slicesRun []traceSlice, want []string) {
	t.Helper()
	if len(slicesRun) == 0 {
		t.Fatalf("%s has no slices", stage)
	}
	var shapes []string
	for _, e := range slicesRun {
		if len(e.Args.OperatorsUS) == 0 {
			t.Fatalf("%s slice %q has no operators_us", stage, e.Name)
		}
		sum := 0.0
		for key, us := range e.Args.OperatorsUS {
			if us < 0 {
				t.Fatalf("%s slice %q: %s took %g µs", stage, e.Name, key, us)
			}
			sum += us
			op, shape, _ := strings.Cut(key, " [")
			if !strings.HasSuffix(op, "linear") && !strings.HasSuffix(op, "linear_group") {
				continue
			}
			// A group of products of one input (q, k, v; gate, up) is one key: "[64x64+32x64+32x64]".
			for _, s := range strings.Split(strings.TrimSuffix(shape, "]"), "+") {
				if !slices.Contains(shapes, s) {
					shapes = append(shapes, s)
				}
			}
		}
		if sum > e.Dur+1 {
			t.Fatalf("%s slice %q: operators take %g µs of a %g µs slice: %v", stage, e.Name, sum, e.Dur,
				e.Args.OperatorsUS)
		}
	}
	slices.Sort(shapes)
	want = slices.Sorted(slices.Values(want))
	if !slices.Equal(shapes, want) {
		t.Fatalf("%s's linear layers have weights %v, want %v", stage, shapes, want)
	}
}

// Operator timing on the demo: every slice of each stage holds its operators' time, and its linear
// layers are the demo's (make_demo_model.py: blocks of up 256 -> 1024 and down 1024 -> 256, the
// head 256 -> 10; cut before blocks.2, so the head is stage 1's).
func TestTraceWithOperators(t *testing.T) {
	d := newDemo(t, 4)
	if err := d.session.TraceStartWithOperators(); err != nil {
		t.Fatal(err)
	}
	must(d.session.Run(context.Background(), d.x))(t)
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := d.session.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	tracks := readTraceTracks(t, path)
	want := map[string][]string{
		"stage 0": {"1024x256", "256x1024"},
		"stage 1": {"1024x256", "256x1024", "10x256"},
	}
	for stage, shapes := range want {
		if n := len(tracks[stage]); n != 4 {
			t.Fatalf("%s has %d slices, want one per micro-batch (4)", stage, n)
		}
		checkOperators(t, stage, tracks[stage], shapes)
	}
	if len(tracks) != 2 {
		t.Fatalf("tracks %v, want the 2 stages' only (a session that is not a generator's has no engine)",
			slices.Sorted(maps.Keys(tracks)))
	}

	// A plain trace after it times no operators.
	if err := d.session.TraceStart(); err != nil {
		t.Fatal(err)
	}
	must(d.session.Run(context.Background(), d.x))(t)
	if err := d.session.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	for stage, run := range readTraceTracks(t, path) {
		for _, e := range run {
			if e.Args.OperatorsUS != nil {
				t.Fatalf("%s slice %q of a trace without operators has operators_us", stage, e.Name)
			}
		}
	}

	d.session.Close()
	if err := d.session.TraceStartWithOperators(); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("trace with operators on a closed session: %v", err)
	}
}

// A generator's trace with operators: the engine's track holds one "launch step" slice per step,
// whose tokens are every token the sequences fed in (each prompt, then each generated token but
// the last), and each stage one slice per step with the tiny decoder's linear layers
// (decoder_models.py: hidden 64, 4 query and 2 key-value heads of 16, MLP 128, vocabulary 128).
func TestGeneratorTraceWithOperators(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	if err := gen.TraceStartWithOperators(); err != nil {
		t.Fatal(err)
	}
	gens := make([]*pipe.Generation, len(want.Prompts))
	for i, p := range want.Prompts {
		gens[i] = must(gen.Generate(context.Background(), p, &pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t)
	}
	fed := 0
	for i, g := range gens {
		got, err := collect(t, g, fmt.Sprintf("prompt %d", i))
		if err != nil || !slices.Equal(got, want.Greedy[i]) {
			t.Fatalf("prompt %d: %v (error %v), want %v", i, got, err, want.Greedy[i])
		}
		fed += len(want.Prompts[i]) + len(got) - 1
	}
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := gen.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	tracks := readTraceTracks(t, path)
	var launched []float64
	tokens := 0.0
	for _, e := range tracks["engine"] {
		if strings.HasPrefix(e.Name, "launch step ") {
			launched = append(launched, e.Args.Request)
			tokens += e.Args.Tokens
		}
	}
	if len(launched) == 0 || tokens != float64(fed) {
		t.Fatalf("the engine's track has %d launch step slices feeding %g tokens, want some feeding %d",
			len(launched), tokens, fed)
	}
	slices.Sort(launched)
	layer := []string{"64x64", "32x64", "128x64", "64x128"} // q and o, k and v, gate and up, down
	for _, stage := range []string{"stage 0", "stage 1"} {
		var requests []float64
		for _, e := range tracks[stage] {
			requests = append(requests, e.Args.Request)
		}
		slices.Sort(requests)
		if !slices.Equal(requests, launched) {
			t.Fatalf("%s ran requests %v, the engine launched %v", stage, requests, launched)
		}
		// Stage 1 also holds the LM head, 128x64 like gate and up.
		checkOperators(t, stage, tracks[stage], layer)
	}
}
