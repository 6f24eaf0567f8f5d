package main

// stream_options.include_usage (OpenAI's streaming usage): the stream ends with one more chunk,
// its choices an empty array and its usage the token counts, every other chunk saying "usage":
// null; without it no chunk has usage. The counts are checked against the reference's
// tokenization of the prompt and its continuation's tokens.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

type usageCounts struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// usageSeen is what a stream said about usage: its events (before [DONE]), those with "usage":
// null, and the usage chunk's counts (nil without one).
type usageSeen struct {
	events, nulls int
	final         *usageCounts
}

// add reads one event's data and says whether it was the usage chunk, which the caller's checks
// of the other chunks skip. It fails the test on an event after the usage chunk, a usage chunk
// with choices or without counts, or counts on a chunk with choices.
func (u *usageSeen) add(t *testing.T, data string) bool {
	t.Helper()
	if u.final != nil {
		t.Fatalf("an event after the usage chunk: %q", data)
	}
	u.events++
	var e struct {
		Choices []json.RawMessage `json:"choices"`
		Usage   json.RawMessage   `json:"usage"` // nil: absent; "null": null
	}
	if err := json.Unmarshal([]byte(data), &e); err != nil {
		t.Fatalf("event %q: %v", data, err)
	}
	switch {
	case e.Choices != nil && len(e.Choices) == 0:
		var c usageCounts
		if err := json.Unmarshal(e.Usage, &c); err != nil || string(e.Usage) == "null" {
			t.Fatalf("a chunk without choices and without usage counts: %q (%v)", data, err)
		}
		u.final = &c
		return true
	case string(e.Usage) == "null":
		u.nulls++
	case e.Usage != nil:
		t.Fatalf("usage on a chunk with choices: %q", data)
	}
	return false
}

func streamCompletion(t *testing.T, s *service, body map[string]any) streamed {
	t.Helper()
	resp, err := post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("streaming: %s", resp.Status)
	}
	return readStream(t, resp.Body)
}

// checkUsage asserts that a stream asked for usage ended with the given counts, every other
// chunk saying "usage": null.
func checkUsage(t *testing.T, what string, u usageSeen, promptTokens, completionTokens int) {
	t.Helper()
	want := usageCounts{promptTokens, completionTokens, promptTokens + completionTokens}
	if u.final == nil || *u.final != want || u.nulls != u.events-1 {
		t.Fatalf("%s: usage %+v, %d of %d other chunks with \"usage\": null; want %+v and all", what, u.final,
			u.nulls, u.events-1, want)
	}
	t.Logf("%s: %+v after %d chunks", what, want, u.events-1)
}

func checkNoUsage(t *testing.T, what string, u usageSeen) {
	t.Helper()
	if u.final != nil || u.nulls != 0 {
		t.Fatalf("%s: a usage chunk %+v, %d chunks with \"usage\": null; want no usage", what, u.final, u.nulls)
	}
}

// stopTokens is how many of ids a completion takes that a stop string ends: up to the first
// token whose text (as the service decodes a stream: whole characters) holds the stop string.
func stopTokens(t *testing.T, ref *reference, ids []int64, stop string) int {
	t.Helper()
	for k := 1; k <= len(ids); k++ {
		if text := ref.decode(t, ids[:k]); !strings.HasSuffix(text, "\uFFFD") && strings.Contains(text, stop) {
			return k
		}
	}
	t.Fatalf("stop %q is not in the reference's text", stop)
	return 0
}

// Both endpoints, streamed with include_usage: the usage chunk counts the reference's prompt
// tokens and the tokens of its continuation (all of them; with a stop string, those up to the
// stop string's, as the same request unstreamed counts them), the text being the reference's;
// include_usage false or no stream_options: no usage.
func checkStreamUsage(t *testing.T, s *service, c completionCase) {
	want := c.ref.decode(t, c.expectedIDs)
	body := map[string]any{"prompt": c.prompt, "max_tokens": c.maxTokens, "temperature": 0, "stream": true,
		"stream_options": map[string]any{"include_usage": true}}
	got := streamCompletion(t, s, body)
	if text := strings.Join(got.pieces, ""); text != want || !got.done ||
		got.finish != referenceFinish(c.expectedIDs, c.maxTokens) {
		t.Fatalf("include_usage: %q, finish %q, [DONE] %v; want %q", text, got.finish, got.done, want)
	}
	checkUsage(t, "completions", got.usage, c.promptTokens, len(c.expectedIDs))

	stop, cut := stopAcross(t, &c.ref, c.expectedIDs, want)
	body["stop"] = stop
	got = streamCompletion(t, s, body)
	if text := strings.Join(got.pieces, ""); text != cut || got.finish != "stop" {
		t.Fatalf("include_usage, stop %q: %q, finish %q; want %q", stop, text, got.finish, cut)
	}
	tokens := stopTokens(t, &c.ref, c.expectedIDs, stop)
	checkUsage(t, fmt.Sprintf("completions, stop %q", stop), got.usage, c.promptTokens, tokens)
	delete(body, "stream_options")
	body["stream"] = false
	resp, err := post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	var whole chunk
	err = json.NewDecoder(resp.Body).Decode(&whole)
	resp.Body.Close()
	if err != nil || whole.Usage == nil || whole.Usage.PromptTokens != c.promptTokens ||
		whole.Usage.CompletionTokens != tokens {
		t.Fatalf("stop %q, not streaming: %+v (%v); want %d+%d tokens", stop, whole, err, c.promptTokens, tokens)
	}

	delete(body, "stop")
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": false}
	checkNoUsage(t, "include_usage false", streamCompletion(t, s, body).usage)
	delete(body, "stream_options")
	checkNoUsage(t, "no stream_options", streamCompletion(t, s, body).usage)

	reply, finish := chatReply(t, c)
	chatBody := map[string]any{"messages": c.chat.messages, "max_tokens": c.chat.maxTokens, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true}}
	chat := streamChat(t, s, chatBody)
	if text := strings.Join(chat.pieces, ""); text != reply || chat.finish != finish || !chat.done {
		t.Fatalf("chat, include_usage: %q, finish %q, [DONE] %v; want %q, finish %q", text, chat.finish, chat.done,
			reply, finish)
	}
	checkUsage(t, "chat", chat.usage, len(c.chat.promptIDs), len(c.chat.expectedIDs))
	delete(chatBody, "stream_options")
	checkNoUsage(t, "chat, no stream_options", streamChat(t, s, chatBody).usage)
}
