package main

// The HTTP API, in the shape of OpenAI's completions API:
//
//	POST /v1/completions  {"prompt": "...", "max_tokens": 16, "temperature": 1, "top_p": 1,
//	                       "seed": 7, "stream": true}
//	    stream: server-sent events, one `data: {"choices":[{"text": "...", "index": 0,
//	    "finish_reason": null}], ...}` per piece of text, a last one with "finish_reason"
//	    ("stop" or "length"), then `data: [DONE]`; otherwise one JSON object with the whole text
//	    and "usage".
//	GET /v1/models        the one model served
//	GET /health           {"status": "ok", slots, queue, counters}
//
// Bad requests get 400 with an OpenAI-style error object naming the field; a full queue (every
// cache slot taken and GeneratorOptions.MaxQueued sequences waiting) gets 503 with Retry-After. A
// client that disconnects cancels its sequence, which frees its slot at once or when its step
// returns.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// maxBody bounds a request's body: a prompt longer than any model's context fits easily.
const maxBody = 4 << 20

type server struct {
	gen     *pipe.Generator
	text    *textCodec
	model   string  // the name /v1/models gives and responses carry
	stopIDs []int64 // the model's end-of-sequence ids: a completion ends there ("stop")

	// Counters for /health: what operators want to see, and what the test observes.
	requests      atomic.Uint64
	rejectedBusy  atomic.Uint64
	badRequests   atomic.Uint64
	disconnects   atomic.Uint64 // clients that left before their completion ended
	finished      [pipe.FinishError + 1]atomic.Uint64
	finishedOther atomic.Uint64
}

func (s *server) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.completions)
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /health", s.health)
	return mux
}

// apiError is OpenAI's error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(v); err != nil {
		log.Printf("writing a response: %v", err)
	}
}

func writeError(w http.ResponseWriter, status int, typ, param, format string, args ...any) {
	e := apiError{Message: fmt.Sprintf(format, args...), Type: typ}
	if param != "" {
		e.Param = &param
	}
	writeJSON(w, status, map[string]apiError{"error": e})
}

// completionRequest is the part of OpenAI's request this service reads; other fields are ignored,
// as OpenAI's clients send some with their defaults (null or their neutral value).
type completionRequest struct {
	Model       string          `json:"model"`
	Prompt      json.RawMessage `json:"prompt"`
	MaxTokens   *int            `json:"max_tokens"`
	Temperature *float64        `json:"temperature"`
	TopP        *float64        `json:"top_p"`
	Seed        *int64          `json:"seed"`
	Stream      bool            `json:"stream"`
	N           *int            `json:"n"`
	Stop        json.RawMessage `json:"stop"`
}

// badRequest is a request the service refuses: which field, and why.
type badRequest struct{ param, message string }

func (b *badRequest) Error() string { return b.message }

func bad(param, format string, args ...any) *badRequest {
	return &badRequest{param, fmt.Sprintf(format, args...)}
}

// parse checks the request and turns it into a prompt and libpipe's options.
func (s *server) parse(r *http.Request) (completionRequest, []int64, *pipe.GenerationOptions, *badRequest) {
	var req completionRequest
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxBody))
	if err := dec.Decode(&req); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return req, nil, nil, bad("", "the request body is over %d bytes", maxBody)
		}
		return req, nil, nil, bad("", "the body is not a JSON completion request: %v", err)
	}
	if dec.More() {
		return req, nil, nil, bad("", "the body holds more than one JSON value")
	}
	prompt, perr := s.prompt(req.Prompt)
	if perr != nil {
		return req, nil, nil, perr
	}
	opts := &pipe.GenerationOptions{MaxNewTokens: 16, Temperature: 1, TopP: 1, StopIDs: s.stopIDs}
	if req.MaxTokens != nil {
		if *req.MaxTokens < 1 {
			return req, nil, nil, bad("max_tokens", "max_tokens is %d; give at least 1", *req.MaxTokens)
		}
		opts.MaxNewTokens = *req.MaxTokens
	}
	if req.Temperature != nil {
		if t := *req.Temperature; t < 0 || t > 2 {
			return req, nil, nil, bad("temperature", "temperature is %g; give 0 (greedy) to 2", t)
		}
		opts.Temperature = *req.Temperature
	}
	if req.TopP != nil {
		if p := *req.TopP; !(p > 0 && p <= 1) {
			return req, nil, nil, bad("top_p", "top_p is %g; give a number in (0, 1]", p)
		}
		opts.TopP = *req.TopP
	}
	if req.Seed != nil {
		opts.Seed = uint64(*req.Seed)
	} else {
		// OpenAI's sampling without a seed differs from call to call.
		var b [8]byte
		rand.Read(b[:])
		opts.Seed = binary.LittleEndian.Uint64(b[:])
	}
	if req.N != nil && *req.N != 1 {
		return req, nil, nil, bad("n", "n is %d; this service makes one completion per request", *req.N)
	}
	if len(req.Stop) > 0 && string(req.Stop) != "null" {
		return req, nil, nil, bad("stop", "stop sequences are not supported yet; the model's own end token ends a completion")
	}
	if req.Model != "" && req.Model != s.model {
		return req, nil, nil, bad("model", "model %q is not served here; this service serves %q", req.Model, s.model)
	}
	return req, prompt, opts, nil
}

// prompt reads OpenAI's prompt forms: a string, an array of one string, or an array of token ids.
func (s *server) prompt(raw json.RawMessage) ([]int64, *badRequest) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, bad("prompt", "prompt is missing; give the text to complete")
	}
	var text string
	if err := json.Unmarshal(raw, &text); err != nil {
		var texts []string
		var ids []int64
		switch {
		case json.Unmarshal(raw, &texts) == nil:
			if len(texts) != 1 {
				return nil, bad("prompt", "prompt holds %d texts; this service completes one per request", len(texts))
			}
			text = texts[0]
		case json.Unmarshal(raw, &ids) == nil:
			if len(ids) == 0 {
				return nil, bad("prompt", "prompt is an empty list of token ids")
			}
			return ids, nil
		default:
			return nil, bad("prompt", "prompt must be a string, an array of one string or an array of token ids")
		}
	}
	if text == "" {
		return nil, bad("prompt", "prompt is empty; give the text to complete")
	}
	ids, err := s.text.Encode(text)
	if err != nil {
		return nil, bad("prompt", "the tokenizer cannot encode the prompt: %v", err)
	}
	if len(ids) == 0 {
		return nil, bad("prompt", "the prompt encodes to no token")
	}
	if max := s.gen.Info().MaxLen; len(ids) >= max {
		return nil, bad("prompt", "the prompt is %d tokens; this model takes at most %d, and needs room for the completion",
			len(ids), max-1)
	}
	return ids, nil
}

// choice and chunk are OpenAI's text_completion objects.
type choice struct {
	Text         string  `json:"text"`
	Index        int     `json:"index"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

type completion struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	req, prompt, opts, berr := s.parse(r)
	if berr != nil {
		s.badRequests.Add(1)
		writeError(w, http.StatusBadRequest, "invalid_request_error", berr.param, "%s", berr.message)
		return
	}
	// The request's context: when the client disconnects, the sequence is cancelled.
	ctx := r.Context()
	gen, err := s.gen.Generate(ctx, prompt, opts)
	switch {
	case errors.Is(err, pipe.ErrBusy):
		s.rejectedBusy.Add(1)
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "server_busy", "", "%s", message(err))
		return
	case errors.Is(err, pipe.ErrInvalidArgument):
		// What libpipe checks itself: token ids outside the vocabulary, a prompt without room.
		s.badRequests.Add(1)
		writeError(w, http.StatusBadRequest, "invalid_request_error", "prompt", "%s", message(err))
		return
	case err != nil:
		writeError(w, http.StatusInternalServerError, "server_error", "", "%v", err)
		return
	}
	c := completion{
		ID:      fmt.Sprintf("cmpl-%x", time.Now().UnixNano()),
		Object:  "text_completion",
		Created: time.Now().Unix(),
		Model:   s.model,
	}
	if req.Stream {
		s.stream(ctx, w, gen, c)
	} else {
		s.whole(ctx, w, gen, c, len(prompt))
	}
}

// message is libpipe's message for a client: what was wrong and what to do, without the Go
// binding's decoration (the C function and the status name).
func message(err error) string {
	var pe *pipe.Error
	if errors.As(err, &pe) && pe.Message != "" {
		return pe.Message
	}
	return err.Error()
}

// follow receives gen's tokens as text, calling emit for each piece, until the sequence ends or
// ctx ends (the client left: the sequence is cancelled before this returns, so that its slot is
// freed however the consumer behaves). It returns the finish reason and the error.
func (s *server) follow(ctx context.Context, gen *pipe.Generation, emit func(string) error) (pipe.FinishReason, error) {
	text := &textStream{codec: s.text}
	left := false
	for tokens := gen.Tokens(); tokens != nil; {
		select {
		case id, open := <-tokens:
			if !open {
				tokens = nil
				break
			}
			if piece := text.Add(id); piece != "" && !left {
				if err := emit(piece); err != nil {
					left = true // a write failed: the client is gone
					gen.Cancel()
				}
			}
		case <-ctx.Done():
			if !left {
				left = true
				gen.Cancel()
				s.disconnects.Add(1)
			}
			ctx = context.Background() // seen once; now wait for the channel to close
		}
	}
	if piece := text.Flush(); piece != "" && !left {
		emit(piece)
	}
	info, _ := gen.Info()
	if int(info.FinishReason) < len(s.finished) {
		s.finished[info.FinishReason].Add(1)
	} else {
		s.finishedOther.Add(1)
	}
	return info.FinishReason, gen.Err()
}

// openAIFinish is OpenAI's name for how a completion ended.
func openAIFinish(reason pipe.FinishReason) string {
	if reason == pipe.FinishStop {
		return "stop"
	}
	return "length"
}

func (s *server) stream(ctx context.Context, w http.ResponseWriter, gen *pipe.Generation, c completion) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // a proxy in front must not hold events back
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	event := func(v any) error {
		data, err := json.Marshal(v)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", data); err != nil {
			return err
		}
		return rc.Flush()
	}
	if err := rc.Flush(); err != nil {
		gen.Cancel()
	}
	reason, err := s.follow(ctx, gen, func(piece string) error {
		c.Choices = []choice{{Text: piece, Index: 0}}
		return event(c)
	})
	if ctx.Err() != nil {
		return // nobody to tell
	}
	if err != nil {
		event(map[string]apiError{"error": {Message: message(err), Type: "server_error"}})
		return
	}
	finish := openAIFinish(reason)
	c.Choices = []choice{{Text: "", Index: 0, FinishReason: &finish}}
	event(c)
	io.WriteString(w, "data: [DONE]\n\n")
	rc.Flush()
}

func (s *server) whole(ctx context.Context, w http.ResponseWriter, gen *pipe.Generation, c completion, prompt int) {
	var text strings.Builder
	reason, err := s.follow(ctx, gen, func(piece string) error {
		text.WriteString(piece)
		return nil
	})
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, pipe.ErrDeadlineExceeded) {
			status = http.StatusGatewayTimeout
		}
		writeError(w, status, "server_error", "", "%s", message(err))
		return
	}
	info, _ := gen.Info()
	finish := openAIFinish(reason)
	c.Choices = []choice{{Text: text.String(), Index: 0, FinishReason: &finish}}
	c.Usage = &usage{PromptTokens: prompt, CompletionTokens: info.GeneratedTokens,
		TotalTokens: prompt + info.GeneratedTokens}
	writeJSON(w, http.StatusOK, c)
}

func (s *server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data":   []map[string]any{{"id": s.model, "object": "model", "created": 0, "owned_by": "libpipe"}},
	})
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	status, code := "ok", http.StatusOK
	if err := s.gen.Check(); err != nil {
		status, code = err.Error(), http.StatusServiceUnavailable
	}
	st, err := s.gen.Stats()
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, "server_error", "", "%v", err)
		return
	}
	finished := map[string]uint64{"other": s.finishedOther.Load()}
	for reason := pipe.FinishStop; reason <= pipe.FinishError; reason++ {
		finished[reason.String()] = s.finished[reason].Load()
	}
	writeJSON(w, code, map[string]any{
		"status":             status,
		"model":              s.model,
		"slots":              s.gen.Info().Slots,
		"slots_in_use":       st.SlotsInUse,
		"queued":             st.Queued,
		"tokens_per_s":       st.TokensPerSecond,
		"requests":           s.requests.Load(),
		"rejected_busy":      s.rejectedBusy.Load(),
		"bad_requests":       s.badRequests.Load(),
		"client_disconnects": s.disconnects.Load(),
		"finished":           finished,
	})
}
