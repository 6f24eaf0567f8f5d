package main

// POST /v1/chat/completions, in the shape of OpenAI's chat completions API:
//
//	{"messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "stream": true, ...}
//
// The conversation becomes a prompt through the model's chat template (libpipe renders it as
// transformers' apply_chat_template does: tokenizer.go), ending where the assistant's reply
// begins; the reply ends at the model's end token or the template's end-of-turn token
// (tokenizer_config.json's eos_token: both are the tokenizer's stop ids), a stop string, or its
// length. Streaming
// sends chat.completion.chunk events: the first with the delta {"role": "assistant"}, then the
// text as {"content": ...} deltas, a last one with the finish reason, then `data: [DONE]`;
// otherwise one chat.completion object with the message and "usage". stream_options.include_usage
// adds a chunk with no choice and the usage before [DONE] (server.go's streamUsage).

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// chatRoles are the roles a message may have: the ones chat templates know. Tool calls (the
// "tool" role, tool_calls) are not served.
var chatRoles = []string{"system", "user", "assistant"}

// chatRequest is the part of OpenAI's chat request this service reads.
type chatRequest struct {
	generationFields
	Messages            json.RawMessage `json:"messages"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"` // the newer name of max_tokens
	Logprobs            *bool           `json:"logprobs"`              // logprobs.go
	TopLogprobs         *int            `json:"top_logprobs"`
}

// chatDelta, chatChoice and chatCompletion are OpenAI's chat.completion(.chunk) objects.
type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chatChoice struct {
	Index        int        `json:"index"`
	Message      *chatDelta `json:"message,omitempty"`
	Delta        *chatDelta `json:"delta,omitempty"`
	Logprobs     any        `json:"logprobs"`
	FinishReason *string    `json:"finish_reason"`
}

type chatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   any          `json:"usage,omitempty"` // nil, *usage, or jsonNull (see streamUsage)
}

// chatMessages reads OpenAI's messages: a non-empty array of {"role", "content"}, the content a
// string or an array of text parts ({"type": "text", "text"}), which are joined with newlines
// (as vLLM does) since chat templates take a message's content as one string.
func chatMessages(raw json.RawMessage) ([]pipe.ChatMessage, *badRequest) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, bad("messages",
			"messages is missing; give the conversation as [{\"role\": \"user\", \"content\": \"...\"}]")
	}
	var list []struct {
		Role    *string         `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, bad("messages", "messages must be an array of {\"role\", \"content\"} objects")
	}
	if len(list) == 0 {
		return nil, bad("messages", "messages is empty; give at least one message")
	}
	out := make([]pipe.ChatMessage, len(list))
	for i, m := range list {
		switch {
		case m.Role == nil:
			return nil, bad(fmt.Sprintf("messages[%d].role", i), "messages[%d] has no role; give one of %s",
				i, strings.Join(chatRoles, ", "))
		case !slices.Contains(chatRoles, *m.Role):
			return nil, bad(fmt.Sprintf("messages[%d].role", i), "messages[%d].role is %q; give one of %s",
				i, *m.Role, strings.Join(chatRoles, ", "))
		}
		content, berr := messageContent(i, m.Content)
		if berr != nil {
			return nil, berr
		}
		out[i] = pipe.ChatMessage{Role: *m.Role, Content: content}
	}
	return out, nil
}

// messageContent is a message's content as text: a string, or the text of an array of text parts.
func messageContent(i int, raw json.RawMessage) (string, *badRequest) {
	param := fmt.Sprintf("messages[%d].content", i)
	if len(raw) == 0 || string(raw) == "null" {
		return "", bad(param, "messages[%d] has no content; give a string or an array of text parts", i)
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return text, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", bad(param, "%s must be a string or an array of {\"type\": \"text\", \"text\": \"...\"} parts", param)
	}
	texts := make([]string, len(parts))
	for j, p := range parts {
		if p.Type == "text" && p.Text == nil {
			return "", bad(param, "%s[%d] is a text part without \"text\"", param, j)
		}
		if p.Type != "text" {
			return "", bad(param, "%s[%d] is a %q part; this service reads text parts ({\"type\": \"text\", \"text\": ...})",
				param, j, p.Type)
		}
		texts[j] = *p.Text
	}
	return strings.Join(texts, "\n"), nil
}

func (s *server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	began := time.Now()
	s.requests.Add(1)
	var req chatRequest
	if berr := decodeRequest(w, r, &req); berr != nil {
		s.refuse(w, berr)
		return
	}
	if s.text.noChat != nil {
		// libpipe's reason: "DIR has no chat template (neither chat_template.jinja nor ...)", or
		// the template's syntax error.
		s.refuse(w, bad("model", "model %q cannot serve chat: %v; use /v1/completions with a prompt", s.model,
			s.text.noChat))
		return
	}
	messages, berr := chatMessages(req.Messages)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	text, err := s.text.RenderChat(messages)
	if err != nil {
		// The template's own checks (raise_exception: roles that do not alternate, ...), or a
		// message holding a NUL byte.
		s.refuse(w, bad("messages", "the model's chat template cannot render these messages: %v", err))
		return
	}
	prompt, berr := s.encode(text, "messages")
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	maxParam := "max_tokens"
	if req.MaxCompletionTokens != nil {
		req.MaxTokens, maxParam = req.MaxCompletionTokens, "max_completion_tokens"
	}
	// Without a limit a reply runs to its end of turn, or until the cache is full.
	opts, stops, berr := s.options(&req.generationFields, maxParam, s.info.MaxLen)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	includeUsage, berr := req.streamUsage()
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	if berr := chatLogprobs(req.Logprobs, req.TopLogprobs, opts); berr != nil {
		s.refuse(w, berr)
		return
	}
	ctx := r.Context() // when the client disconnects, the sequence is cancelled
	gen := s.start(ctx, w, prompt, opts, "messages", began)
	if gen == nil {
		return
	}
	c := chatCompletion{
		ID:      fmt.Sprintf("chatcmpl-%x", time.Now().UnixNano()),
		Object:  "chat.completion",
		Created: time.Now().Unix(),
		Model:   s.model,
	}
	logprobs := func(tokens []tokenLogprob) any {
		if !opts.Logprobs {
			return nil
		}
		return s.chatLogprobsOf(tokens)
	}
	if !req.Stream {
		var reply strings.Builder
		var tokens []tokenLogprob
		end := s.follow(ctx, gen, stops, func(piece string, lps []tokenLogprob) error {
			reply.WriteString(piece)
			tokens = append(tokens, lps...)
			return nil
		})
		if ctx.Err() != nil || s.failed(w, end) {
			return
		}
		content := reply.String()
		c.Choices = []chatChoice{{Message: &chatDelta{Role: "assistant", Content: &content},
			Logprobs: logprobs(append(tokens, end.logprobs...)), FinishReason: &end.finish}}
		c.Usage = tokenUsage(len(prompt), end)
		writeJSON(w, http.StatusOK, c)
		return
	}
	c.Object = "chat.completion.chunk"
	events := s.startEvents(w, gen.gen)
	if includeUsage {
		c.Usage = jsonNull
	}
	empty := ""
	c.Choices = []chatChoice{{Delta: &chatDelta{Role: "assistant", Content: &empty}}}
	if events.send(c) != nil {
		gen.gen.Cancel()
	}
	end := s.follow(ctx, gen, stops, func(piece string, lps []tokenLogprob) error {
		c.Choices = []chatChoice{{Delta: &chatDelta{Content: &piece}, Logprobs: logprobs(lps)}}
		return events.send(c)
	})
	if ctx.Err() != nil || events.failed(end) {
		return
	}
	c.Choices = []chatChoice{{Delta: &chatDelta{}, FinishReason: &end.finish}}
	if len(end.logprobs) > 0 {
		c.Choices[0].Logprobs = logprobs(end.logprobs)
	}
	events.send(c)
	if includeUsage {
		c.Choices, c.Usage = []chatChoice{}, tokenUsage(len(prompt), end)
		events.send(c)
	}
	events.done()
}
