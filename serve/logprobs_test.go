package main

// Log-probabilities (logprobs.go) against the reference (server_test.go's referenceCase): the
// greedy reply's tokens each get an entry, in order, whose token is that token's text, whose
// log-probability is the likeliest alternative's (greedy), and a stream carries the same entries
// across its chunks as the whole response; the legacy completions' form holds the same numbers;
// bad values are refused naming the field.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"testing"
)

type chatLP struct {
	Token       string   `json:"token"`
	Logprob     float64  `json:"logprob"`
	Bytes       []int    `json:"bytes"`
	TopLogprobs []chatLP `json:"top_logprobs"`
}

type chatLPs struct {
	Content []chatLP `json:"content"`
}

type legacyLPs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

// postJSON posts body to path and decodes the 200 response into v.
func postJSON(t *testing.T, s *service, path string, body map[string]any, v any) {
	t.Helper()
	resp, err := postTo(context.Background(), s, path, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %s (%v)", path, resp.Status, err)
	}
}

// streamEvents posts body to path and returns the data of every event before [DONE].
func streamEvents(t *testing.T, s *service, path string, body map[string]any) []string {
	t.Helper()
	resp, err := postTo(context.Background(), s, path, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s, streaming: %s", path, resp.Status)
	}
	var out []string
	scanner := bufio.NewScanner(resp.Body)
	scanner.Buffer(nil, 1<<20)
	done := false
	for scanner.Scan() {
		data, ok := strings.CutPrefix(scanner.Text(), "data: ")
		switch {
		case !ok:
			continue
		case data == "[DONE]":
			done = true
		default:
			out = append(out, data)
		}
	}
	if err := scanner.Err(); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	if !done {
		t.Fatalf("%s: the stream ended without [DONE]", path)
	}
	return out
}

// jsonText is text as a client reads it from JSON (each byte of invalid UTF-8 becomes U+FFFD).
func jsonText(t *testing.T, text string) string {
	data, err := json.Marshal(text)
	if err == nil {
		err = json.Unmarshal(data, &text)
	}
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// checkChatEntries checks the chat entries of a greedy reply of ids with top alternatives each.
func checkChatEntries(t *testing.T, what string, got []chatLP, ids []int64, top int, ref *reference) {
	t.Helper()
	if len(got) != len(ids) {
		t.Fatalf("%s: %d entries for the %d tokens %v: %+v", what, len(got), len(ids), ids, got)
	}
	for i, e := range got {
		text := ref.token(t, ids[i])
		if e.Token != jsonText(t, text) || !slices.Equal(e.Bytes, tokenBytes(text)) {
			t.Fatalf("%s: entry %d is %+v, want token %q (id %d) and its bytes", what, i, e, text, ids[i])
		}
		if !(e.Logprob <= 0) || math.IsInf(e.Logprob, 0) || len(e.TopLogprobs) != top {
			t.Fatalf("%s: entry %d is %+v: want a log-probability and %d alternatives", what, i, e, top)
		}
		for j, alt := range e.TopLogprobs {
			if alt.TopLogprobs != nil || len(alt.Bytes) == 0 || j > 0 && alt.Logprob > e.TopLogprobs[j-1].Logprob {
				t.Fatalf("%s: entry %d's alternatives %+v are not in order, or not tokens", what, i, e.TopLogprobs)
			}
		}
		if top > 0 && (e.TopLogprobs[0].Token != e.Token || math.Abs(e.TopLogprobs[0].Logprob-e.Logprob) > 1e-6) {
			t.Fatalf("%s: entry %d is %+v: the greedy token is not the likeliest", what, i, e)
		}
	}
}

// near says whether a and b are the same log-probabilities, within what batching may change.
func near(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Abs(a[i]-b[i]) > 1e-3 {
			return false
		}
	}
	return true
}

func checkLogprobs(t *testing.T, s *service, c completionCase) {
	ch := c.chat
	chat := map[string]any{"messages": ch.messages, "max_tokens": ch.maxTokens, "temperature": 0,
		"logprobs": true, "top_logprobs": 3}
	var whole struct {
		Choices []struct {
			Message  struct{ Content string } `json:"message"`
			Logprobs *chatLPs                 `json:"logprobs"`
		} `json:"choices"`
	}
	postJSON(t, s, "/v1/chat/completions", chat, &whole)
	if len(whole.Choices) != 1 || whole.Choices[0].Logprobs == nil {
		t.Fatalf("chat with logprobs: %+v", whole)
	}
	entries := whole.Choices[0].Logprobs.Content
	checkChatEntries(t, "chat", entries, ch.expectedIDs, 3, &c.ref)
	wantLPs := make([]float64, len(entries))
	for i, e := range entries {
		wantLPs[i] = e.Logprob
	}
	t.Logf("chat reply %q: log-probabilities %v", whole.Choices[0].Message.Content, wantLPs)

	// Streamed: the same entries, across the chunks that carry the text; the first (the role)
	// carries none.
	chat["stream"] = true
	var streamedEntries []chatLP
	for i, data := range streamEvents(t, s, "/v1/chat/completions", chat) {
		var ev struct {
			Choices []struct {
				Delta    struct{ Content *string } `json:"delta"`
				Logprobs *chatLPs                  `json:"logprobs"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || len(ev.Choices) != 1 {
			t.Fatalf("chat event %q: %v", data, err)
		}
		lp := ev.Choices[0].Logprobs
		if i == 0 && lp != nil {
			t.Fatalf("the role's chunk carries log-probabilities: %q", data)
		}
		if lp != nil {
			streamedEntries = append(streamedEntries, lp.Content...)
		}
	}
	checkChatEntries(t, "chat, streamed", streamedEntries, ch.expectedIDs, 3, &c.ref)
	got := make([]float64, len(streamedEntries))
	for i, e := range streamedEntries {
		got[i] = e.Logprob
	}
	if !near(got, wantLPs) {
		t.Fatalf("chat, streamed: log-probabilities %v, not streamed %v", got, wantLPs)
	}

	// Without logprobs: null. logprobs alone: no alternatives.
	delete(chat, "stream")
	delete(chat, "top_logprobs")
	postJSON(t, s, "/v1/chat/completions", chat, &whole)
	checkChatEntries(t, "chat without top_logprobs", whole.Choices[0].Logprobs.Content, ch.expectedIDs, 0, &c.ref)
	delete(chat, "logprobs")
	postJSON(t, s, "/v1/chat/completions", chat, &whole)
	if whole.Choices[0].Logprobs != nil {
		t.Fatalf("chat without logprobs: %+v", whole.Choices[0].Logprobs)
	}

	// The completions' form: tokens, their log-probabilities, up to logprobs+1 alternatives (the
	// sampled token's always), text offsets.
	body := map[string]any{"prompt": c.prompt, "max_tokens": c.maxTokens, "temperature": 0, "logprobs": 2}
	checkLegacy := func(what string, lp legacyLPs) {
		t.Helper()
		n := len(c.expectedIDs)
		if len(lp.Tokens) != n || len(lp.TokenLogprobs) != n || len(lp.TopLogprobs) != n || len(lp.TextOffset) != n {
			t.Fatalf("%s: %+v for the %d tokens %v", what, lp, n, c.expectedIDs)
		}
		offset := 0
		for i, tok := range lp.Tokens {
			text := c.ref.token(t, c.expectedIDs[i])
			if tok != jsonText(t, text) || lp.TextOffset[i] != offset {
				t.Fatalf("%s: token %d is %q at %d, want %q at %d", what, i, tok, lp.TextOffset[i], text, offset)
			}
			offset += len([]rune(tok))
			top := lp.TopLogprobs[i]
			if v, ok := top[tok]; !ok || len(top) > 3 || math.Abs(v-lp.TokenLogprobs[i]) > 1e-6 ||
				!(lp.TokenLogprobs[i] <= 0) {
				t.Fatalf("%s: token %d %q (%v): alternatives %v", what, i, tok, lp.TokenLogprobs[i], top)
			}
			for _, v := range top {
				if v > lp.TokenLogprobs[i]+1e-6 {
					t.Fatalf("%s: token %d %q (%v) was greedy, yet %v is likelier", what, i, tok, lp.TokenLogprobs[i], top)
				}
			}
		}
	}
	var completion struct {
		Choices []struct {
			Logprobs *legacyLPs `json:"logprobs"`
		} `json:"choices"`
	}
	postJSON(t, s, "/v1/completions", body, &completion)
	if len(completion.Choices) != 1 || completion.Choices[0].Logprobs == nil {
		t.Fatalf("completion with logprobs: %+v", completion)
	}
	checkLegacy("completion", *completion.Choices[0].Logprobs)
	body["stream"] = true
	var joined legacyLPs
	for _, data := range streamEvents(t, s, "/v1/completions", body) {
		var ev struct {
			Choices []struct {
				Logprobs *legacyLPs `json:"logprobs"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || len(ev.Choices) != 1 {
			t.Fatalf("completion event %q: %v", data, err)
		}
		if lp := ev.Choices[0].Logprobs; lp != nil {
			joined.Tokens = append(joined.Tokens, lp.Tokens...)
			joined.TokenLogprobs = append(joined.TokenLogprobs, lp.TokenLogprobs...)
			joined.TopLogprobs = append(joined.TopLogprobs, lp.TopLogprobs...)
			joined.TextOffset = append(joined.TextOffset, lp.TextOffset...)
		}
	}
	checkLegacy("completion, streamed", joined)
	if !near(joined.TokenLogprobs, completion.Choices[0].Logprobs.TokenLogprobs) {
		t.Fatalf("completion, streamed: %v, not streamed %v", joined.TokenLogprobs,
			completion.Choices[0].Logprobs.TokenLogprobs)
	}

	prompt, _ := json.Marshal(c.prompt) // one the model's tokenizer encodes (the tiny one has no "a")
	for _, bad := range []struct{ path, body, param string }{
		{"/v1/completions", fmt.Sprintf(`{"prompt": %s, "logprobs": 6}`, prompt), "logprobs"},
		{"/v1/completions", fmt.Sprintf(`{"prompt": %s, "logprobs": -1}`, prompt), "logprobs"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 21}`,
			"top_logprobs"},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}`, "top_logprobs"},
	} {
		expectBadRequest(t, s, bad.path, fmt.Sprintf("%s %s", bad.path, bad.body), bad.body, bad.param)
	}
}
