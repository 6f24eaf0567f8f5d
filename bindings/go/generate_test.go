package pipe_test

// Token generation (Generator, Generation) on the tiny decoder fixtures of
// tests/models/decoder_models.py: a 2-layer Llama-architecture decoder with random weights (vocab
// 128, 4 slots, 64 tokens each), whose greedy continuations of a few prompts were computed by
// transformers' generate (tiny_decoder.expected.json: the independent reference), and the same
// decoder with a test gate between its layers (gated_decoder.pt), which holds the prefill step of
// a prompt whose first token is 119 + key at the gate of "stage1" until the test opens the key.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
	"github.com/libpipe/libpipe/bindings/go/internal/capi"
	"github.com/libpipe/libpipe/bindings/go/internal/testgate"
)

// decoderKeys gate keys (1 .. decoderKeys) are kept for the gated decoder by TestMain, which puts
// them in decoderKeyPool. A test takes one per sequence it holds and gives it back once that
// sequence's step has passed the gate, so that the tests can run again in one process (-count).
const decoderKeys = 8

var decoderKeyPool = make(chan int64, decoderKeys)

// decoderKey is a key of the gated decoder that no sequence holds; it is opened when the test
// ends, before the generator is closed (cleanups run last-in first-out), and given back to the
// pool once the step it held has left the gate. The test must see that step arrive at the gate.
func decoderKey(t *testing.T) int64 {
	t.Helper()
	if gateErr != nil {
		t.Fatalf("no test gate: %v (set LIBPIPE_TEST_GATE_LIB, or put libpipe_test_gate.so in LIBPIPE_FIXTURES)",
			gateErr)
	}
	var k int64
	select {
	case k = <-decoderKeyPool:
	default:
		t.Fatalf("all %d keys of the gated decoder are in use", decoderKeys)
	}
	t.Cleanup(func() { releaseDecoderKey(t, k) })
	return k
}

// releaseDecoderKey opens key k and, once its held step has left the gate, removes its gate files
// and gives it back. A key whose step never arrived (the test failed before) stays open and out
// of the pool: its step may still arrive, and must then pass.
func releaseDecoderKey(t *testing.T, k int64) {
	if err := gate.Open(k, ""); err != nil {
		t.Error(err)
		return
	}
	arrived, err := gate.Count(k, "stage1", testgate.Arrived)
	if err != nil || arrived == 0 {
		return
	}
	if err := gate.Wait(k, "stage1", testgate.Left, arrived); err != nil {
		t.Error(err)
		return
	}
	files, err := filepath.Glob(filepath.Join(gate.Dir(), fmt.Sprintf("gate-%d.*", k)))
	if err != nil {
		t.Error(err)
		return
	}
	for _, f := range files {
		if err := os.Remove(f); err != nil {
			t.Error(err)
			return
		}
	}
	decoderKeyPool <- k
}

// heldPrompt is a prompt whose prefill step the gated decoder holds at key's gate.
func heldPrompt(key int64, rest ...int64) []int64 { return append([]int64{119 + key}, rest...) }

// decoderFixture is the path of a decoder fixture: in LIBPIPE_FIXTURES (where
// tests/bindings/stage.cmake copies them) or else in PIPE_TEST_MODELS (where the generator writes
// them).
func decoderFixture(t testing.TB, name string) string {
	t.Helper()
	for _, env := range []string{"LIBPIPE_FIXTURES", "PIPE_TEST_MODELS"} {
		if dir := os.Getenv(env); dir != "" {
			path := filepath.Join(dir, name)
			if _, err := os.Stat(path); err == nil {
				return path
			}
		}
	}
	t.Fatalf("%s is in neither LIBPIPE_FIXTURES (%q) nor PIPE_TEST_MODELS (%q); "+
		"tests/models/decoder_models.py writes it", name, os.Getenv("LIBPIPE_FIXTURES"), os.Getenv("PIPE_TEST_MODELS"))
	return ""
}

// decoderExpected is tiny_decoder.expected.json: transformers' greedy continuation of each prompt.
type decoderExpected struct {
	Prompts      [][]int64 `json:"prompts"`
	MaxNewTokens int       `json:"max_new_tokens"`
	Greedy       [][]int64 `json:"greedy"`
	// Per prompt: each greedy token's log-probability and the 5 likeliest tokens at its position,
	// from transformers' logits.
	GreedyLogprobs []struct {
		Logprob     []float64   `json:"logprob"`
		TopIDs      [][]int64   `json:"top_ids"`
		TopLogprobs [][]float64 `json:"top_logprobs"`
	} `json:"greedy_logprobs"`
	// Per prompt: the same of each prompt token from position 1 on, given those before it.
	PromptLogprobs []struct {
		Logprob     []float64   `json:"logprob"`
		TopIDs      [][]int64   `json:"top_ids"`
		TopLogprobs [][]float64 `json:"top_logprobs"`
	} `json:"prompt_logprobs"`
	// Every token the cache has room for after MaxLenPrompt.
	MaxLenPrompt []int64 `json:"max_len_prompt"`
	MaxLenGreedy []int64 `json:"max_len_greedy"`
	// The decoder's shape.
	Vocab  int `json:"vocab"`
	Slots  int `json:"slots"`
	MaxLen int `json:"max_len"`
}

func readDecoderExpected(t testing.TB) decoderExpected {
	t.Helper()
	var e decoderExpected
	data := must(os.ReadFile(decoderFixture(t, "tiny_decoder.expected.json")))(t)
	if err := json.Unmarshal(data, &e); err != nil {
		t.Fatalf("tiny_decoder.expected.json: %v", err)
	}
	if len(e.Prompts) == 0 || len(e.Prompts) != len(e.Greedy) || e.MaxNewTokens < 2 {
		t.Fatalf("tiny_decoder.expected.json holds %d prompts, %d continuations, max_new_tokens %d",
			len(e.Prompts), len(e.Greedy), e.MaxNewTokens)
	}
	for i, p := range e.Prompts {
		if len(p) == 0 || p[0] >= 119 {
			t.Fatalf("prompt %d of tiny_decoder.expected.json starts with %v: the gated decoder would hold it", i, p)
		}
	}
	return e
}

// newDecoderGenerator is a generator of decoder fixture `name`, cut between its two layers.
func newDecoderGenerator(t testing.TB, name string, opts *pipe.GeneratorOptions) *pipe.Generator {
	t.Helper()
	model := must(pipe.LoadModel(decoderFixture(t, name)))(t)
	t.Cleanup(func() { model.Close() })
	plan := must(model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"model.layers.1:begin"}}))(t)
	t.Cleanup(func() { plan.Close() })
	gen := must(plan.NewGenerator(nil, opts))(t)
	t.Cleanup(func() { gen.Close() })
	return gen
}

// collect receives every token of g until its channel closes. Each token must come within the
// gate's wait limit: a bound for a hung test only (the test has made sure that the end comes).
func collect(t testing.TB, g *pipe.Generation, what string) ([]int64, error) {
	t.Helper()
	var out []int64
	for {
		select {
		case tok, open := <-g.Tokens():
			if !open {
				return out, g.Err()
			}
			out = append(out, tok)
		case <-time.After(testgate.WaitLimit):
			t.Fatalf("%s: the generation gave %d tokens and then nothing for %v", what, len(out), testgate.WaitLimit)
		}
	}
}

// eventHandles records the generation event registry before a test: afterwards every handle is
// gone (none leaked once its generation ended) and libpipe never called a handle after its end.
type eventHandles struct {
	pending int
	stray   int64
}

func recordEvents() eventHandles {
	return eventHandles{pending: capi.PendingEvents(), stray: capi.StrayEvents()}
}

func (b eventHandles) check(t *testing.T, when string) {
	t.Helper()
	err := testgate.Until(func() (bool, error) { return capi.PendingEvents() == b.pending, nil },
		func() string {
			return fmt.Sprintf("%s: %d event handles registered, %d before", when, capi.PendingEvents(), b.pending)
		})
	if err != nil {
		t.Fatal(err)
	}
	if n := capi.StrayEvents(); n != b.stray {
		t.Fatalf("%s: libpipe announced %d events after a generation's end", when, n-b.stray)
	}
}

func checkInfo(t *testing.T, what string, g *pipe.Generation, reason pipe.FinishReason, prompt, generated int) {
	t.Helper()
	info := must(g.Info())(t)
	if info.FinishReason != reason || info.PromptTokens != prompt || info.GeneratedTokens != generated {
		t.Fatalf("%s: info %+v, want finish %v, %d prompt tokens, %d generated", what, info, reason, prompt, generated)
	}
	if generated > 0 && (info.TimeToFirstToken < 0 || info.Queued < 0) {
		t.Fatalf("%s: info %+v: no time to first token or queueing time after %d tokens", what, info, generated)
	}
}

// Every prompt of the reference at once (so their steps batch), greedy: token for token what
// transformers generated, on a channel that closes with a nil Err.
func TestGenerateGreedyMatchesTransformers(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	info := gen.Info()
	if info.Slots != want.Slots || info.MaxLen != want.MaxLen || info.Vocab != want.Vocab || info.CacheBytesPerSlot == 0 {
		t.Fatalf("generator info %+v, want %d slots of %d tokens, vocabulary %d, cache bytes", info, want.Slots,
			want.MaxLen, want.Vocab)
	}
	if gen.NumStages() != 2 {
		t.Fatalf("%d stages, want 2", gen.NumStages())
	}
	before := recordEvents()
	gens := make([]*pipe.Generation, len(want.Prompts))
	for i, p := range want.Prompts {
		gens[i] = must(gen.Generate(context.Background(), p, &pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t)
	}
	total := 0
	for i, g := range gens {
		got, err := collect(t, g, fmt.Sprintf("prompt %d", i))
		if err != nil {
			t.Fatalf("prompt %d: %v", i, err)
		}
		if !slices.Equal(got, want.Greedy[i]) {
			t.Fatalf("prompt %d %v:\n got %v\nwant %v (transformers)", i, want.Prompts[i], got, want.Greedy[i])
		}
		checkInfo(t, fmt.Sprintf("prompt %d", i), g, pipe.FinishLength, len(want.Prompts[i]), len(got))
		total += len(got)
	}
	before.check(t, "after every generation ended")
	stats := must(gen.Stats())(t)
	if stats.SlotsInUse != 0 || stats.Queued != 0 || stats.SequencesFinished != uint64(len(gens)) ||
		stats.GeneratedTokens != uint64(total) || stats.Steps == 0 || stats.StepsInFlight < 1 ||
		stats.StepsOneAtATime+stats.StepsPipelined != stats.Steps {
		t.Fatalf("stats %+v after %d sequences of %d tokens in all", stats, len(gens), total)
	}
	if _, err := gen.StageStats(1); err != nil {
		t.Fatal(err)
	}
	if err := gen.Check(); err != nil {
		t.Fatal(err)
	}
}

// A sequence ends with FinishLength once the cache's max_len is full, whatever MaxNewTokens asks.
func TestGenerateEndsWhenTheCacheIsFull(t *testing.T) {
	want := readDecoderExpected(t)
	if len(want.MaxLenPrompt) == 0 || len(want.MaxLenGreedy) == 0 {
		t.Fatal("tiny_decoder.expected.json has no max_len_prompt / max_len_greedy")
	}
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	g := must(gen.Generate(context.Background(), want.MaxLenPrompt, &pipe.GenerationOptions{MaxNewTokens: 1000}))(t)
	got, err := collect(t, g, "up to max_len")
	if err != nil || !slices.Equal(got, want.MaxLenGreedy) {
		t.Fatalf("after a prompt of %d tokens: %v, %v; want %v", len(want.MaxLenPrompt), got, err, want.MaxLenGreedy)
	}
	checkInfo(t, "up to max_len", g, pipe.FinishLength, len(want.MaxLenPrompt), len(got))
}

// A step that fails (the gated decoder raises for a prompt starting with 119) ends its sequence
// with ErrExecution and FinishError; the generator keeps serving.
func TestGenerateFailingStep(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "gated_decoder.pt", nil)
	g := must(gen.Generate(context.Background(), append([]int64{119}, want.Prompts[0]...), nil))(t)
	got, err := collect(t, g, "a failing step")
	pe := asError(t, err, pipe.StatusExecution)
	if len(got) != 0 {
		t.Fatalf("%d tokens from a sequence whose prefill failed", len(got))
	}
	t.Logf("the failing step: %s", pe.Message)
	checkInfo(t, "a failing step", g, pipe.FinishError, len(want.Prompts[0])+1, 0)
	got, err = collect(t, must(gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t), "after the failure")
	if err != nil || !slices.Equal(got, want.Greedy[0]) {
		t.Fatalf("after the failure: %v, %v; want %v", got, err, want.Greedy[0])
	}
}

// A stop id ends the sequence at its first occurrence, which is the last token.
func TestGenerateStopsAtAStopID(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	greedy := want.Greedy[0]
	stop := greedy[len(greedy)/2]
	end := slices.Index(greedy, stop) + 1
	g := must(gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens, StopIDs: []int64{stop, 127}}))(t)
	got, err := collect(t, g, "with a stop id")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, greedy[:end]) {
		t.Fatalf("stop id %d: got %v, want %v", stop, got, greedy[:end])
	}
	checkInfo(t, "with a stop id", g, pipe.FinishStop, len(want.Prompts[0]), end)
}

// With Logprobs, each greedy token's log-probability and the 5 likeliest tokens at its position
// equal the log-softmax of transformers' logits, the greedy token first; without, Logprobs is nil;
// TopLogprobs outside 0..20, or without Logprobs, is refused.
func TestGenerateLogprobsMatchTransformers(t *testing.T) {
	want := readDecoderExpected(t)
	if len(want.GreedyLogprobs) != len(want.Prompts) {
		t.Fatalf("tiny_decoder.expected.json has %d greedy_logprobs for %d prompts", len(want.GreedyLogprobs),
			len(want.Prompts))
	}
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	const tol = 1e-4
	near := func(got float32, want float64) bool { return math.Abs(float64(got)-want) <= tol }
	gens := make([]*pipe.Generation, len(want.Prompts))
	for i, p := range want.Prompts {
		gens[i] = must(gen.Generate(context.Background(), p,
			&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens, Logprobs: true, TopLogprobs: 5}))(t)
	}
	for i, g := range gens {
		got, err := collect(t, g, fmt.Sprintf("prompt %d", i))
		if err != nil {
			t.Fatalf("prompt %d: %v", i, err)
		}
		if !slices.Equal(got, want.Greedy[i]) {
			t.Fatalf("prompt %d: got %v, want %v (transformers)", i, got, want.Greedy[i])
		}
		lps, ref := g.Logprobs(), want.GreedyLogprobs[i]
		if len(lps) != len(got) || len(ref.Logprob) != len(got) {
			t.Fatalf("prompt %d: %d log-probabilities for %d tokens (reference: %d)", i, len(lps), len(got),
				len(ref.Logprob))
		}
		for k, lp := range lps {
			if !near(lp.Logprob, ref.Logprob[k]) {
				t.Fatalf("prompt %d token %d: log-probability %v, want %v", i, k, lp.Logprob, ref.Logprob[k])
			}
			if len(lp.Top) != 5 || lp.Top[0].ID != got[k] {
				t.Fatalf("prompt %d token %d (%d): top %+v, want 5 with the greedy token first", i, k, got[k], lp.Top)
			}
			for j, alt := range lp.Top {
				if !near(alt.Logprob, ref.TopLogprobs[k][j]) {
					t.Fatalf("prompt %d token %d: top %+v, want log-probabilities %v (ids %v)", i, k, lp.Top,
						ref.TopLogprobs[k], ref.TopIDs[k])
				}
			}
			if !near(lp.Top[0].Logprob, float64(lp.Logprob)) {
				t.Fatalf("prompt %d token %d: greedy token's %v, top[0]'s %v", i, k, lp.Logprob, lp.Top[0].Logprob)
			}
		}
	}
	// Logprobs alone: no alternatives.
	g := must(gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{MaxNewTokens: 2, Logprobs: true}))(t)
	if _, err := collect(t, g, "logprobs without top"); err != nil {
		t.Fatal(err)
	}
	if lps := g.Logprobs(); len(lps) != 2 || lps[0].Top != nil || !near(lps[0].Logprob, want.GreedyLogprobs[0].Logprob[0]) {
		t.Fatalf("Logprobs without TopLogprobs: %+v", lps)
	}
	plain := must(gen.Generate(context.Background(), want.Prompts[0], &pipe.GenerationOptions{MaxNewTokens: 1}))(t)
	if _, err := collect(t, plain, "without logprobs"); err != nil {
		t.Fatal(err)
	}
	if lps := plain.Logprobs(); lps != nil {
		t.Fatalf("Logprobs without GenerationOptions.Logprobs: %+v", lps)
	}
	for _, bad := range []pipe.GenerationOptions{{Logprobs: true, TopLogprobs: 21}, {Logprobs: true, TopLogprobs: -1},
		{TopLogprobs: 3}} {
		if _, err := gen.Generate(context.Background(), want.Prompts[0], &bad); !errors.Is(err, pipe.ErrInvalidArgument) {
			t.Fatalf("%+v: %v, want ErrInvalidArgument", bad, err)
		}
	}
}

// With PromptLogprobs, each prompt token's log-probability given those before it, and the 5
// likeliest tokens there, equal the log-softmax of transformers' logits of the whole prompt; entry
// 0 is empty; the tokens that follow stay transformers' greedy ones. Several scored prompts at
// once, beside a plain one, so that their one-token rows share steps. Without the option
// PromptLogprobs is nil; TopLogprobs with PromptLogprobs alone is allowed.
func TestGeneratePromptLogprobsMatchTransformers(t *testing.T) {
	want := readDecoderExpected(t)
	if len(want.PromptLogprobs) != len(want.Prompts) {
		t.Fatalf("tiny_decoder.expected.json has %d prompt_logprobs for %d prompts (an old fixture: "+
			"tests/models/decoder_models.py writes them)", len(want.PromptLogprobs), len(want.Prompts))
	}
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	const tol = 1e-4
	near := func(got float32, want float64) bool { return math.Abs(float64(got)-want) <= tol }
	gens := make([]*pipe.Generation, len(want.Prompts))
	for i, p := range want.Prompts {
		gens[i] = must(gen.Generate(context.Background(), p,
			&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens, PromptLogprobs: true, TopLogprobs: 5}))(t)
	}
	plain := must(gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t)
	for i, g := range gens {
		got, err := collect(t, g, fmt.Sprintf("prompt %d", i))
		if err != nil {
			t.Fatalf("prompt %d: %v", i, err)
		}
		if !slices.Equal(got, want.Greedy[i]) {
			t.Fatalf("prompt %d: got %v, want %v (transformers)", i, got, want.Greedy[i])
		}
		if info := must(g.Info())(t); info.CachedTokens != 0 {
			t.Fatalf("prompt %d: %d prompt tokens from the cache, yet it was scored", i, info.CachedTokens)
		}
		if g.Logprobs() != nil {
			t.Fatalf("prompt %d: Logprobs without GenerationOptions.Logprobs: %+v", i, g.Logprobs())
		}
		lps, ref, prompt := g.PromptLogprobs(), want.PromptLogprobs[i], want.Prompts[i]
		if len(lps) != len(prompt) || len(ref.Logprob) != len(prompt)-1 {
			t.Fatalf("prompt %d: %d entries for %d prompt tokens (reference: %d positions)", i, len(lps), len(prompt),
				len(ref.Logprob))
		}
		if lps[0].Logprob != 0 || lps[0].Top != nil {
			t.Fatalf("prompt %d: entry 0 is %+v, want the zero TokenLogprobs", i, lps[0])
		}
		for k, lp := range lps[1:] {
			if !near(lp.Logprob, ref.Logprob[k]) {
				t.Fatalf("prompt %d position %d: log-probability %v, want %v", i, k+1, lp.Logprob, ref.Logprob[k])
			}
			if len(lp.Top) != 5 {
				t.Fatalf("prompt %d position %d: top %+v, want 5", i, k+1, lp.Top)
			}
			for j, alt := range lp.Top {
				if !near(alt.Logprob, ref.TopLogprobs[k][j]) {
					t.Fatalf("prompt %d position %d: top %+v, want log-probabilities %v (ids %v)", i, k+1, lp.Top,
						ref.TopLogprobs[k], ref.TopIDs[k])
				}
			}
		}
	}
	if got, err := collect(t, plain, "without prompt logprobs"); err != nil || !slices.Equal(got, want.Greedy[0]) {
		t.Fatalf("beside the scored prompts: %v (%v), want %v", got, err, want.Greedy[0])
	}
	if lps := plain.PromptLogprobs(); lps != nil {
		t.Fatalf("PromptLogprobs without GenerationOptions.PromptLogprobs: %+v", lps)
	}
	// Both at once, no alternatives: the prompt's scores and the tokens'.
	i := len(want.Prompts) - 1
	g := must(gen.Generate(context.Background(), want.Prompts[i],
		&pipe.GenerationOptions{MaxNewTokens: 2, Logprobs: true, PromptLogprobs: true}))(t)
	if _, err := collect(t, g, "logprobs and prompt logprobs"); err != nil {
		t.Fatal(err)
	}
	lps, plps := g.Logprobs(), g.PromptLogprobs()
	if len(lps) != 2 || !near(lps[0].Logprob, want.GreedyLogprobs[i].Logprob[0]) || len(plps) != len(want.Prompts[i]) ||
		plps[1].Top != nil || !near(plps[1].Logprob, want.PromptLogprobs[i].Logprob[0]) {
		t.Fatalf("Logprobs and PromptLogprobs without TopLogprobs: %+v, %+v", lps, plps)
	}
	if _, err := gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{PromptLogprobs: true, TopLogprobs: 21}); !errors.Is(err, pipe.ErrInvalidArgument) {
		t.Fatalf("TopLogprobs 21: %v, want ErrInvalidArgument", err)
	}
}

// Sampling with a seed: the same seed gives the same tokens, all inside the vocabulary.
func TestGenerateSamplingIsReproducible(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	opts := &pipe.GenerationOptions{MaxNewTokens: 12, Temperature: 0.9, TopK: 40, TopP: 0.95, Seed: 1234}
	var runs [2][]int64
	for i := range runs {
		g := must(gen.Generate(context.Background(), want.Prompts[0], opts))(t)
		got, err := collect(t, g, "sampling")
		if err != nil {
			t.Fatal(err)
		}
		runs[i] = got
	}
	if !slices.Equal(runs[0], runs[1]) || len(runs[0]) != 12 {
		t.Fatalf("seed 1234 twice: %v and %v", runs[0], runs[1])
	}
	for _, tok := range runs[0] {
		if tok < 0 || tok >= 128 {
			t.Fatalf("sampled token %d is outside the vocabulary", tok)
		}
	}
}

// Bad prompts and options are refused by Generate with ErrInvalidArgument and libpipe's message;
// the generator keeps serving.
func TestGenerateRefusesBadPrompts(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "tiny_decoder.pt", nil)
	long := make([]int64, gen.Info().MaxLen)
	ok := want.Prompts[0]
	cases := []struct {
		what   string
		prompt []int64
		opts   *pipe.GenerationOptions
	}{
		{"empty prompt", nil, nil},
		{"id = vocab", []int64{1, int64(want.Vocab), 2}, nil},
		{"negative id", []int64{-1}, nil},
		{"prompt filling max_len", long, nil},
		{"negative max_new_tokens", ok, &pipe.GenerationOptions{MaxNewTokens: -1}},
		{"negative temperature", ok, &pipe.GenerationOptions{Temperature: -0.5}},
		{"top_p above 1", ok, &pipe.GenerationOptions{Temperature: 1, TopP: 1.5}},
		{"negative top_k", ok, &pipe.GenerationOptions{Temperature: 1, TopK: -3}},
		{"negative timeout", ok, &pipe.GenerationOptions{Timeout: -time.Second}},
	}
	for _, c := range cases {
		g, err := gen.Generate(context.Background(), c.prompt, c.opts)
		if g != nil {
			g.Cancel()
			t.Fatalf("%s: accepted", c.what)
		}
		pe := asError(t, err, pipe.StatusInvalidArgument)
		t.Logf("%s: %s", c.what, pe.Message)
	}
	got, err := collect(t, must(gen.Generate(context.Background(), ok,
		&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t), "after the refusals")
	if err != nil || !slices.Equal(got, want.Greedy[0]) {
		t.Fatalf("after the refusals: %v, %v; want %v", got, err, want.Greedy[0])
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := gen.Generate(ctx, ok, nil); !errors.Is(err, pipe.ErrCancelled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Generate with an ended context: %v", err)
	}
	gen.Close()
	if _, err := gen.Generate(context.Background(), ok, nil); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("Generate on a closed generator: %v", err)
	}
	if _, err := gen.Stats(); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("Stats of a closed generator: %v", err)
	}
	if _, err := gen.StageStats(0); !errors.Is(err, pipe.ErrClosed) {
		t.Fatalf("StageStats of a closed generator: %v", err)
	}
}

// Cancelling the context of a sequence held in the pipeline (its prefill step at the gate) ends
// it with ErrCancelled: no token (the held step's token is dropped), its slot is freed, and the
// generator keeps serving. Generation.Cancel does the same.
func TestGenerateCancelWhileHeld(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "gated_decoder.pt", nil)
	before := recordEvents()
	for _, how := range []string{"context", "Cancel"} {
		key := decoderKey(t)
		ctx, cancel := context.WithCancel(context.Background())
		prompt := heldPrompt(key, want.Prompts[0]...)
		g := must(gen.Generate(ctx, prompt, &pipe.GenerationOptions{MaxNewTokens: 8}))(t)
		waitGate(t, key, "stage1", testgate.Arrived, 1)
		if g.Err() != nil {
			t.Fatalf("%s: Err is %v while the sequence is held", how, g.Err())
		}
		checkInfo(t, how+", held", g, pipe.FinishNone, len(prompt), 0)
		if how == "context" {
			cancel()
		} else if err := g.Cancel(); err != nil {
			t.Fatal(err)
		}
		openGate(t, key, "")
		got, err := collect(t, g, how)
		cancel()
		asError(t, err, pipe.StatusCancelled)
		if (how == "context") != errors.Is(err, context.Canceled) {
			t.Fatalf("%s: %v should match context.Canceled only when the context was cancelled", how, err)
		}
		if len(got) != 0 {
			t.Fatalf("%s: %d tokens of a sequence cancelled in its prefill", how, len(got))
		}
		checkInfo(t, how, g, pipe.FinishCancelled, len(prompt), 0)
		err = testgate.Until(func() (bool, error) {
			st, err := gen.Stats()
			return err == nil && st.SlotsInUse == 0, err
		}, func() string { return how + ": the cancelled sequence's slot is still in use" })
		if err != nil {
			t.Fatal(err)
		}
		got, err = collect(t, must(gen.Generate(context.Background(), want.Prompts[1%len(want.Prompts)],
			&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t), how+": the next sequence")
		if err != nil || !slices.Equal(got, want.Greedy[1%len(want.Prompts)]) {
			t.Fatalf("%s: the next sequence gave %v, %v; want %v", how, got, err, want.Greedy[1%len(want.Prompts)])
		}
	}
	before.check(t, "after the cancelled sequences")
}

// A held sequence whose context deadline passes ends with ErrDeadlineExceeded, which also
// matches context.DeadlineExceeded.
func TestGenerateDeadlineWhileHeld(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "gated_decoder.pt", nil)
	key := decoderKey(t)
	var g *pipe.Generation
	for timeout := 100 * time.Millisecond; g == nil; timeout *= 2 {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		next, err := gen.Generate(ctx, heldPrompt(key, want.Prompts[0]...), nil)
		if errors.Is(err, pipe.ErrDeadlineExceeded) && timeout < testgate.WaitLimit {
			t.Logf("Generate took longer than %v; again with twice that", timeout)
			continue
		}
		g = must(next, err)(t)
	}
	// Its step reaches the gate whatever the deadline (a stage is not interrupted).
	waitGate(t, key, "stage1", testgate.Arrived, 1)
	got, err := collect(t, g, "past the deadline") // the gate stays shut: only the deadline ends it
	asError(t, err, pipe.StatusDeadlineExceeded)
	if !errors.Is(err, context.DeadlineExceeded) || len(got) != 0 {
		t.Fatalf("past the deadline: %d tokens, %v (should match context.DeadlineExceeded too)", len(got), err)
	}
	if reason := must(g.Info())(t).FinishReason; reason != pipe.FinishDeadline && reason != pipe.FinishCancelled {
		t.Fatalf("finish reason %v past the context's deadline", reason)
	}
}

// With every slot taken and MaxQueued sequences waiting, Generate refuses with ErrBusy; the
// sequences it accepted all finish correctly once the pipeline moves again, and then it accepts
// again. One step in flight, held at the gate, so that no sequence can finish meanwhile.
func TestGenerateBusy(t *testing.T) {
	want := readDecoderExpected(t)
	const maxQueued = 1
	gen := newDecoderGenerator(t, "gated_decoder.pt",
		&pipe.GeneratorOptions{MaxQueued: maxQueued, StepsInFlight: 1})
	key := decoderKey(t)
	held := must(gen.Generate(context.Background(), heldPrompt(key, want.Prompts[0]...), nil))(t)
	waitGate(t, key, "stage1", testgate.Arrived, 1)
	type accepted struct {
		g      *pipe.Generation
		prompt int
	}
	var ok []accepted
	var busy error
	for i := 0; busy == nil; i++ {
		if i > gen.Info().Slots+maxQueued {
			t.Fatalf("%d sequences accepted with one held and %d slots: no ErrBusy", i, gen.Info().Slots)
		}
		p := i % len(want.Prompts)
		g, err := gen.Generate(context.Background(), want.Prompts[p],
			&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens})
		if err != nil {
			busy = err
			break
		}
		ok = append(ok, accepted{g, p})
	}
	pe := asError(t, busy, pipe.StatusBusy)
	if !errors.Is(busy, pipe.ErrBusy) {
		t.Fatalf("%v does not match ErrBusy", busy)
	}
	t.Logf("%d accepted besides the held one, then: %s", len(ok), pe.Message)

	openGate(t, key, "")
	if _, err := collect(t, held, "the held sequence"); err != nil {
		t.Fatal(err)
	}
	for i, a := range ok {
		got, err := collect(t, a.g, fmt.Sprintf("accepted sequence %d", i))
		if err != nil || !slices.Equal(got, want.Greedy[a.prompt]) {
			t.Fatalf("accepted sequence %d: %v, %v; want %v", i, got, err, want.Greedy[a.prompt])
		}
	}
	got, err := collect(t, must(gen.Generate(context.Background(), want.Prompts[0],
		&pipe.GenerationOptions{MaxNewTokens: want.MaxNewTokens}))(t), "once the queue emptied")
	if err != nil || !slices.Equal(got, want.Greedy[0]) {
		t.Fatalf("once the queue emptied: %v, %v", got, err)
	}
}

// Closing the generator cancels the sequences still going on: their channels close with
// ErrCancelled (before Close returns, which waits for the held step).
func TestGeneratorCloseCancelsSequences(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "gated_decoder.pt", &pipe.GeneratorOptions{StepsInFlight: 1})
	before := recordEvents()
	key := decoderKey(t)
	held := must(gen.Generate(context.Background(), heldPrompt(key, want.Prompts[0]...), nil))(t)
	waitGate(t, key, "stage1", testgate.Arrived, 1)
	waiting := must(gen.Generate(context.Background(), want.Prompts[0], nil))(t)
	closed := make(chan struct{})
	go func() {
		gen.Close()
		close(closed)
	}()
	for _, s := range []struct {
		name   string
		g      *pipe.Generation
		prompt int
	}{{"held", held, len(want.Prompts[0]) + 1}, {"waiting", waiting, len(want.Prompts[0])}} {
		got, err := collect(t, s.g, s.name+" sequence of a closed generator")
		asError(t, err, pipe.StatusCancelled)
		if len(got) != 0 {
			t.Fatalf("%s sequence: %d tokens", s.name, len(got))
		}
		checkInfo(t, s.name, s.g, pipe.FinishCancelled, s.prompt, 0)
	}
	openGate(t, key, "")
	receive(t, closed, "Close once the held step passed")
	before.check(t, "after Close")
}

// Generations do not pile up goroutines or OS threads: while many sequences wait (held behind the
// gate), the process has no OS thread per sequence (no goroutine waits inside libpipe), and once
// they ended, the goroutines and event handles are back to what they were.
func TestGenerationsHoldNoThreads(t *testing.T) {
	want := readDecoderExpected(t)
	gen := newDecoderGenerator(t, "gated_decoder.pt", &pipe.GeneratorOptions{StepsInFlight: 1, MaxQueued: 64})
	// One sequence first, so that threads LibTorch starts once are there already.
	if _, err := collect(t, must(gen.Generate(context.Background(), want.Prompts[0], nil))(t), "first"); err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	goroutines, threads, events := runtime.NumGoroutine(), osThreads(t), recordEvents()

	key := decoderKey(t)
	const sequences = 48
	gens := []*pipe.Generation{must(gen.Generate(context.Background(), heldPrompt(key, want.Prompts[0]...), nil))(t)}
	waitGate(t, key, "stage1", testgate.Arrived, 1)
	for i := range sequences - 1 {
		p := want.Prompts[i%len(want.Prompts)]
		gens = append(gens, must(gen.Generate(context.Background(), p, &pipe.GenerationOptions{MaxNewTokens: 4}))(t))
	}
	grown := osThreads(t) - threads
	t.Logf("%d sequences waiting: %d OS threads before, %d more now; %d goroutines before, %d now",
		sequences, threads, grown, goroutines, runtime.NumGoroutine())
	if grown >= sequences/2 {
		t.Fatalf("%d waiting sequences added %d OS threads", sequences, grown)
	}

	openGate(t, key, "")
	var wg sync.WaitGroup
	errs := make(chan error, len(gens))
	for i, g := range gens {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := g.Collect(); err != nil {
				errs <- fmt.Errorf("sequence %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	events.check(t, "after every sequence ended")
	err := testgate.Until(func() (bool, error) { return runtime.NumGoroutine() <= goroutines, nil },
		func() string {
			return fmt.Sprintf("%d goroutines after %d sequences ended, %d before", runtime.NumGoroutine(),
				sequences, goroutines)
		})
	if err != nil {
		t.Fatal(err)
	}
}
