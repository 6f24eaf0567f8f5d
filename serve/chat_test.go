package main

// The chat endpoint and stop strings against the reference (server_test.go's referenceCase): a
// conversation's reply must be the reference's greedy continuation of the conversation as the
// reference rendered it (transformers' apply_chat_template for SmolLM2, the fixture's prompt for
// the tiny model), and a stop string must cut the reference text where it begins.

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// referenceFinish is the finish reason of a greedy reference of at most maxTokens tokens: "stop"
// when it ended early, at the model's end token (which it then includes).
func referenceFinish(ids []int64, maxTokens int) string {
	if len(ids) < maxTokens {
		return "stop"
	}
	return "length"
}

// chatStreamed is a chat stream read to its end.
type chatStreamed struct {
	roles   []string // the roles the deltas named
	pieces  []string // the content deltas that were not empty
	finish  string
	done    bool // `data: [DONE]` closed it
	leading bool // the first event named the assistant's role
	usage   usageSeen
}

func readChatStream(t *testing.T, body io.Reader) chatStreamed {
	t.Helper()
	var out chatStreamed
	scanner := bufio.NewScanner(body)
	events := 0
	for scanner.Scan() {
		line := scanner.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || out.done {
			t.Fatalf("not an event line, or one after [DONE]: %q", line)
		}
		if data == "[DONE]" {
			out.done = true
			continue
		}
		if out.usage.add(t, data) {
			continue
		}
		var c struct {
			Object  string `json:"object"`
			Choices []struct {
				Delta *struct {
					Role    string  `json:"role"`
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Object != "chat.completion.chunk" ||
			len(c.Choices) != 1 || c.Choices[0].Delta == nil {
			t.Fatalf("event %q: %v", data, err)
		}
		if out.finish != "" {
			t.Fatalf("an event after the one with finish_reason %q: %q", out.finish, data)
		}
		d := c.Choices[0].Delta
		if d.Role != "" {
			out.roles = append(out.roles, d.Role)
			out.leading = out.leading || (events == 0 && d.Role == "assistant")
		}
		if d.Content != nil && *d.Content != "" {
			out.pieces = append(out.pieces, *d.Content)
		}
		if f := c.Choices[0].FinishReason; f != nil {
			out.finish = *f
		}
		events++
	}
	if err := scanner.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// chatWhole is a chat.completion object.
type chatWhole struct {
	Object  string `json:"object"`
	Choices []struct {
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func postChat(t *testing.T, s *service, body map[string]any) chatWhole {
	t.Helper()
	resp, err := postTo(context.Background(), s, "/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var whole chatWhole
	if err := json.NewDecoder(resp.Body).Decode(&whole); err != nil || resp.StatusCode != http.StatusOK ||
		whole.Object != "chat.completion" || len(whole.Choices) != 1 || whole.Choices[0].Message.Role != "assistant" {
		t.Fatalf("chat, not streaming: %s, %+v (%v)", resp.Status, whole, err)
	}
	return whole
}

func streamChat(t *testing.T, s *service, body map[string]any) chatStreamed {
	t.Helper()
	resp, err := postTo(context.Background(), s, "/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("chat, streaming: %s, Content-Type %q", resp.Status, resp.Header.Get("Content-Type"))
	}
	return readChatStream(t, resp.Body)
}

// chatReply is the reference reply's text and finish reason.
func chatReply(t *testing.T, c completionCase) (string, string) {
	t.Helper()
	return c.ref.decode(t, c.chat.expectedIDs), referenceFinish(c.chat.expectedIDs, c.chat.maxTokens)
}

// The conversation renders, through libpipe's chat template and tokenizer, as the reference's
// prompt (transformers' apply_chat_template); the streamed reply (after a first delta naming the
// assistant's role) and the reply not streamed (its user message given as text parts, without
// max_tokens) are the reference's, ending at the end of the turn; max_completion_tokens limits the
// reply, ahead of max_tokens.
func checkChat(t *testing.T, s *service, c completionCase) {
	ch := c.chat
	want, wantFinish := chatReply(t, c)
	codec, err := loadText(c.modelDir)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	var messages []pipe.ChatMessage
	for _, m := range ch.messages {
		messages = append(messages, pipe.ChatMessage{Role: m["role"].(string), Content: m["content"].(string)})
	}
	text, err := codec.RenderChat(messages)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := codec.Encode(text); err != nil || !slices.Equal(ids, ch.promptIDs) {
		t.Fatalf("the conversation renders as %q = %v (%v); the reference's prompt is %v", text, ids, err, ch.promptIDs)
	}

	got := streamChat(t, s, map[string]any{"model": c.model, "messages": ch.messages, "max_tokens": ch.maxTokens,
		"temperature": 0, "seed": 5, "stream": true})
	if text := strings.Join(got.pieces, ""); text != want || !got.leading || len(got.roles) != 1 ||
		got.finish != wantFinish || !got.done {
		t.Fatalf("streamed %q in %d deltas (roles %v, first %v), finish %q, [DONE] %v; want %q, finish %q",
			text, len(got.pieces), got.roles, got.leading, got.finish, got.done, want, wantFinish)
	}
	t.Logf("%s replied %q in %d deltas", c.model, want, len(got.pieces))

	// The last message as text parts, cut at its newlines: the service joins parts with newlines.
	parted := slices.Clone(ch.messages)
	last := parted[len(parted)-1]
	var parts []map[string]any
	for _, p := range strings.Split(last["content"].(string), "\n") {
		parts = append(parts, map[string]any{"type": "text", "text": p})
	}
	parted[len(parted)-1] = map[string]any{"role": last["role"], "content": parts}
	whole := postChat(t, s, map[string]any{"messages": parted, "temperature": 0})
	if r := whole.Choices[0]; r.Message.Content != want || r.FinishReason != wantFinish ||
		whole.Usage.PromptTokens != len(ch.promptIDs) || whole.Usage.CompletionTokens != len(ch.expectedIDs) {
		t.Fatalf("not streaming, %d parts: %+v; want %q, finish %q, %d+%d tokens", len(parts), whole, want, wantFinish,
			len(ch.promptIDs), len(ch.expectedIDs))
	}
	// The same conversation again, after the streamed one ended (its cache slot is free by the time
	// its end reaches the service): all of its prompt but the last token is found in that slot.
	if cached := whole.Usage.PromptTokensDetails.CachedTokens; cached != len(ch.promptIDs)-1 {
		t.Fatalf("the conversation asked again found %d of its %d prompt tokens cached; want all but the last",
			cached, len(ch.promptIDs))
	}

	if len(ch.expectedIDs) < 3 {
		t.Fatalf("the reference reply %v is too short to cut", ch.expectedIDs)
	}
	whole = postChat(t, s, map[string]any{"messages": ch.messages, "temperature": 0, "max_tokens": ch.maxTokens,
		"max_completion_tokens": 2})
	if r, cut := whole.Choices[0], c.ref.decode(t, ch.expectedIDs[:2]); r.Message.Content != cut ||
		r.FinishReason != "length" || whole.Usage.CompletionTokens != 2 {
		t.Fatalf("max_completion_tokens 2: %+v; want %q, finish length", whole, cut)
	}
}

// stopAcross is a stop string of two characters around the boundary between the texts of the
// reference's first tokens and the rest (so that a service which sent each token's text at once
// would send its first character), and the text before its first occurrence.
func stopAcross(t *testing.T, ref *reference, ids []int64, want string) (string, string) {
	t.Helper()
	head := ref.decode(t, ids[:len(ids)/2])
	b := len(head)
	if b == 0 || b >= len(want) || !strings.HasPrefix(want, head) {
		t.Fatalf("the text %q of the reference's first tokens is not a proper start of %q", head, want)
	}
	_, before := utf8.DecodeLastRuneInString(want[:b])
	_, after := utf8.DecodeRuneInString(want[b:])
	stop := want[b-before : b+after]
	return stop, want[:strings.Index(want, stop)]
}

// A stop string ends the completion where it first begins, finish reason "stop", without it or
// anything after it, streamed or not, for both endpoints; stop strings that never appear change
// nothing.
func checkStop(t *testing.T, s *service, c completionCase) {
	want := c.ref.decode(t, c.expectedIDs)
	stop, cut := stopAcross(t, &c.ref, c.expectedIDs, want)
	body := map[string]any{"prompt": c.prompt, "max_tokens": c.maxTokens, "temperature": 0, "stop": stop}
	resp, err := post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	var whole chunk
	err = json.NewDecoder(resp.Body).Decode(&whole)
	resp.Body.Close()
	if err != nil || len(whole.Choices) != 1 || whole.Choices[0].Text != cut || whole.Choices[0].FinishReason == nil ||
		*whole.Choices[0].FinishReason != "stop" {
		t.Fatalf("stop %q, not streaming: %+v (%v); want %q, finish stop", stop, whole, err, cut)
	}

	body["stream"] = true
	body["stop"] = []string{"never in this text", stop}
	resp, err = post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	got := readStream(t, resp.Body)
	resp.Body.Close()
	if text := strings.Join(got.pieces, ""); text != cut || got.finish != "stop" || !got.done {
		t.Fatalf("stop %q, streaming: %q, finish %q, [DONE] %v; want %q, finish stop", stop, text, got.finish, got.done,
			cut)
	}
	t.Logf("stop %q: %q of %q", stop, cut, want)

	body["stop"] = []string{"never in this text", "nor this"}
	resp, err = post(context.Background(), s, body)
	if err != nil {
		t.Fatal(err)
	}
	got = readStream(t, resp.Body)
	resp.Body.Close()
	if text := strings.Join(got.pieces, ""); text != want || got.finish != referenceFinish(c.expectedIDs, c.maxTokens) {
		t.Fatalf("stop strings that never appear: %q, finish %q; want %q", text, got.finish, want)
	}

	reply, _ := chatReply(t, c)
	stop, cut = stopAcross(t, &c.ref, c.chat.expectedIDs, reply)
	chat := streamChat(t, s, map[string]any{"messages": c.chat.messages, "max_tokens": c.chat.maxTokens,
		"temperature": 0, "stream": true, "stop": []string{stop}})
	if text := strings.Join(chat.pieces, ""); text != cut || chat.finish != "stop" || !chat.done {
		t.Fatalf("chat, stop %q: %q, finish %q; want %q, finish stop", stop, text, chat.finish, cut)
	}
}
