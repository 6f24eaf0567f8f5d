package main

// /metrics as Prometheus reads it: scraped and parsed with Prometheus' own text parser (expfmt),
// before and after a few requests to the reference service, whose counters must have moved by
// exactly what the responses said (their usage, their status codes, one time to first token per
// completion and one inter-token gap per token after the first). The API key's rule for /metrics
// is checked on the limits service (abuse_test.go) and, for -metrics-public, on the guard alone.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scraped is one scrape of /metrics, parsed.
type scraped map[string]*dto.MetricFamily

// scrape reads /metrics, with the API key when key is not "".
func scrape(t *testing.T, s *service, key string) scraped {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, s.base+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Fatalf("/metrics: %s, Content-Type %q", resp.Status, resp.Header.Get("Content-Type"))
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("/metrics is not Prometheus' text format: %v", err)
	}
	return families
}

// metric is the sample of family name whose labels include labels (name=value pairs); nil if
// there is none.
func (m scraped) metric(name string, labels ...string) *dto.Metric {
	f := m[name]
	if f == nil {
		return nil
	}
	for _, metric := range f.Metric {
		have := map[string]string{}
		for _, l := range metric.Label {
			have[l.GetName()] = l.GetValue()
		}
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			match = match && have[labels[i]] == labels[i+1]
		}
		if match {
			return metric
		}
	}
	return nil
}

// value is a counter's or a gauge's value, a histogram's count of observations; 0 for a sample
// not there (a counter with labels appears once it is first counted).
func (m scraped) value(name string, labels ...string) float64 {
	metric := m.metric(name, labels...)
	switch {
	case metric == nil:
		return 0
	case metric.Counter != nil:
		return metric.Counter.GetValue()
	case metric.Gauge != nil:
		return metric.Gauge.GetValue()
	case metric.Histogram != nil:
		return float64(metric.Histogram.GetSampleCount())
	}
	return 0
}

// stages is how many stages the scrape has statistics of.
func (m scraped) stages() int {
	if f := m["pipe_serve_stage_microbatches_total"]; f != nil {
		return len(f.Metric)
	}
	return 0
}

// A completion not streamed, a chat reply streamed with its usage and a bad request move the
// counters by what their responses said.
func checkMetrics(t *testing.T, s *service, c completionCase) {
	before := scrape(t, s, "")
	for _, name := range []string{"pipe_serve_slots", "pipe_serve_slots_in_use", "pipe_serve_queue_depth",
		"pipe_serve_generator_steps_total", "pipe_serve_prompt_tokens_total", "pipe_serve_time_to_first_token_seconds",
		"pipe_serve_inter_token_seconds", "process_open_fds", "go_goroutines"} {
		if before[name] == nil {
			t.Fatalf("/metrics has no %s", name)
		}
	}
	if n := before.stages(); n != 2 {
		t.Fatalf("/metrics has statistics of %d stages; the service runs 2 (-split %s)", n, c.split)
	}

	// The completion, not streamed: its usage is in its object.
	resp, err := post(context.Background(), s, map[string]any{"prompt": c.prompt, "max_tokens": c.maxTokens,
		"temperature": 0})
	if err != nil {
		t.Fatal(err)
	}
	var whole chunk
	err = json.NewDecoder(resp.Body).Decode(&whole)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || whole.Usage == nil {
		t.Fatalf("completion: %s, %+v (%v)", resp.Status, whole, err)
	}
	// The chat reply, streamed: its usage is its last chunk's.
	chat := streamChat(t, s, map[string]any{"messages": c.chat.messages, "max_tokens": c.chat.maxTokens,
		"temperature": 0, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	if chat.usage.final == nil || !chat.done {
		t.Fatalf("the chat stream ended without its usage chunk: %+v", chat.usage)
	}
	expectBadRequest(t, s, "/v1/completions", "an empty prompt", `{"prompt": ""}`, "prompt")

	// A stream's handler returns (and is counted) just after its last event: the requests' counts
	// are awaited, then asserted exact.
	var after scraped
	until(t, "/metrics to count the chat request", func() bool {
		after = scrape(t, s, "")
		return after.value("pipe_serve_requests_total", "endpoint", "/v1/chat/completions", "code", "200") >=
			before.value("pipe_serve_requests_total", "endpoint", "/v1/chat/completions", "code", "200")+1
	})
	delta := func(name string, labels ...string) float64 {
		return after.value(name, labels...) - before.value(name, labels...)
	}
	promptTokens := whole.Usage.PromptTokens + chat.usage.final.PromptTokens
	generated := whole.Usage.CompletionTokens + chat.usage.final.CompletionTokens
	if promptTokens != c.promptTokens+len(c.chat.promptIDs) {
		t.Fatalf("the responses report %d prompt tokens; the references have %d and %d", promptTokens,
			c.promptTokens, len(c.chat.promptIDs))
	}
	for _, want := range []struct {
		what  string
		value float64
		name  string
		label []string
	}{
		{"completions answered 200", 1, "pipe_serve_requests_total", []string{"endpoint", "/v1/completions", "code", "200"}},
		{"completions answered 400", 1, "pipe_serve_requests_total", []string{"endpoint", "/v1/completions", "code", "400"}},
		{"chat requests answered 200", 1, "pipe_serve_requests_total",
			[]string{"endpoint", "/v1/chat/completions", "code", "200"}},
		{"completion requests timed", 2, "pipe_serve_request_duration_seconds", []string{"endpoint", "/v1/completions"}},
		{"chat requests timed", 1, "pipe_serve_request_duration_seconds", []string{"endpoint", "/v1/chat/completions"}},
		{"prompt tokens (the responses' usage)", float64(promptTokens), "pipe_serve_prompt_tokens_total", nil},
		{"generated tokens (the responses' usage)", float64(generated), "pipe_serve_generated_tokens_total", nil},
		{"first tokens", 2, "pipe_serve_time_to_first_token_seconds", nil},
		{"gaps between tokens", float64(generated - 2), "pipe_serve_inter_token_seconds", nil},
		{"completions ended", 2, "pipe_serve_generator_sequences_finished_total", nil},
	} {
		if got := delta(want.name, want.label...); got != want.value {
			t.Errorf("%s: %s%v moved by %g, want %g", want.what, want.name, want.label, got, want.value)
		}
	}
	// How they ended: OpenAI's finish reasons are the generator's here (no stop string, no error).
	ended := map[string]float64{}
	ended[*whole.Choices[0].FinishReason]++
	ended[chat.finish]++
	for _, reason := range []string{"stop", "length", "cancelled", "error"} {
		if got := delta("pipe_serve_sequences_finished_total", "reason", reason); got != ended[reason] {
			t.Errorf("completions ended by %s: moved by %g, want %g", reason, got, ended[reason])
		}
	}
	for _, gauge := range []string{"pipe_serve_slots_in_use", "pipe_serve_queue_depth"} {
		if v := after.value(gauge); v != 0 {
			t.Errorf("%s is %g with no request in progress", gauge, v)
		}
	}
	if slots := after.value("pipe_serve_slots"); slots < 1 {
		t.Errorf("pipe_serve_slots is %g", slots)
	}
	// Every token took a step (the requests ran one after the other), and every step ran on each
	// stage, which was busy for some of the time.
	steps := delta("pipe_serve_generator_steps_total")
	if steps < float64(generated) {
		t.Errorf("%g steps for %d tokens generated one request at a time", steps, generated)
	}
	for i := range 2 {
		stage := fmt.Sprint(i)
		if mb := delta("pipe_serve_stage_microbatches_total", "stage", stage); mb != steps {
			t.Errorf("stage %s ran %g micro-batches for %g steps", stage, mb, steps)
		}
		if busy := delta("pipe_serve_stage_busy_seconds_total", "stage", stage); !(busy > 0) {
			t.Errorf("stage %s was busy for %g s", stage, busy)
		}
	}
	t.Logf("%d prompt and %d generated tokens counted, %g steps", promptTokens, generated, steps)
}

// -metrics-public opens /metrics, and only it, to requests without the key.
func TestMetricsPublic(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	for _, c := range []struct {
		public bool
		path   string
		want   int
	}{
		{false, "/metrics", http.StatusUnauthorized},
		{true, "/metrics", http.StatusOK},
		{true, "/v1/models", http.StatusUnauthorized},
		{false, "/health", http.StatusOK},
	} {
		w := httptest.NewRecorder()
		newAPIKey("key", c.public).guard(ok).ServeHTTP(w, httptest.NewRequest(http.MethodGet, c.path, nil))
		if w.Code != c.want {
			t.Errorf("-metrics-public=%v, GET %s without the key: %d, want %d", c.public, c.path, w.Code, c.want)
		}
	}
}
