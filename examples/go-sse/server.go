package main

// The HTTP API, in the shape of OpenAI's completions API:
//
//	POST /v1/completions  {"prompt": "...", "max_tokens": 16, "temperature": 1, "top_p": 1,
//	                       "seed": 7, "stop": ["\n"], "stream": true}
//	    stream: server-sent events, one `data: {"choices":[{"text": "...", "index": 0,
//	    "finish_reason": null}], ...}` per piece of text, a last one with "finish_reason"
//	    ("stop": the model's end token or a stop string; "length"), then `data: [DONE]`;
//	    otherwise one JSON object with the whole text and "usage". With "stream_options":
//	    {"include_usage": true}, every chunk has "usage": null and one more, with no choice and the
//	    usage, comes before [DONE].
//	POST /v1/chat/completions  the same over a conversation (chat.go)
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

	chat        *chatTemplate // the model's chat template; nil: the chat endpoint answers 400
	chatStopIDs []int64       // stopIDs and the template's end of turn: a chat reply ends there

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
	mux.HandleFunc("POST /v1/chat/completions", s.chatCompletions)
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

// generationFields are the request fields both endpoints read; other fields are ignored, as
// OpenAI's clients send some with their defaults (null or their neutral value).
type generationFields struct {
	Model         string          `json:"model"`
	MaxTokens     *int            `json:"max_tokens"`
	Temperature   *float64        `json:"temperature"`
	TopP          *float64        `json:"top_p"`
	Seed          *int64          `json:"seed"`
	Stream        bool            `json:"stream"`
	N             *int            `json:"n"`
	Stop          json.RawMessage `json:"stop"`
	StreamOptions json.RawMessage `json:"stream_options"`
}

// completionRequest is the part of OpenAI's completion request this service reads.
type completionRequest struct {
	generationFields
	Prompt json.RawMessage `json:"prompt"`
}

// badRequest is a request the service refuses: which field, and why.
type badRequest struct{ param, message string }

func (b *badRequest) Error() string { return b.message }

func bad(param, format string, args ...any) *badRequest {
	return &badRequest{param, fmt.Sprintf(format, args...)}
}

// refuse answers a bad request with 400 and OpenAI's error object.
func (s *server) refuse(w http.ResponseWriter, b *badRequest) {
	s.badRequests.Add(1)
	writeError(w, http.StatusBadRequest, "invalid_request_error", b.param, "%s", b.message)
}

// decodeRequest reads the body, one JSON object, into v.
func decodeRequest(r *http.Request, v any) *badRequest {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxBody))
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return bad("", "the request body is over %d bytes", maxBody)
		}
		return bad("", "the body is not a JSON request of this endpoint: %v", err)
	}
	if dec.More() {
		return bad("", "the body holds more than one JSON value")
	}
	return nil
}

// options checks the fields both endpoints share and turns them into libpipe's options and the
// stop strings. maxParam names the field MaxTokens came from; without it, defaultMax tokens.
func (s *server) options(f *generationFields, maxParam string, defaultMax int) (*pipe.GenerationOptions, []string,
	*badRequest) {
	opts := &pipe.GenerationOptions{MaxNewTokens: defaultMax, Temperature: 1, TopP: 1, StopIDs: s.stopIDs}
	if f.MaxTokens != nil {
		if *f.MaxTokens < 1 {
			return nil, nil, bad(maxParam, "%s is %d; give at least 1", maxParam, *f.MaxTokens)
		}
		opts.MaxNewTokens = *f.MaxTokens
	}
	if f.Temperature != nil {
		if t := *f.Temperature; t < 0 || t > 2 {
			return nil, nil, bad("temperature", "temperature is %g; give 0 (greedy) to 2", t)
		}
		opts.Temperature = *f.Temperature
	}
	if f.TopP != nil {
		if p := *f.TopP; !(p > 0 && p <= 1) {
			return nil, nil, bad("top_p", "top_p is %g; give a number in (0, 1]", p)
		}
		opts.TopP = *f.TopP
	}
	if f.Seed != nil {
		opts.Seed = uint64(*f.Seed)
	} else {
		// OpenAI's sampling without a seed differs from call to call.
		var b [8]byte
		rand.Read(b[:])
		opts.Seed = binary.LittleEndian.Uint64(b[:])
	}
	if f.N != nil && *f.N != 1 {
		return nil, nil, bad("n", "n is %d; this service makes one completion per request", *f.N)
	}
	stops, berr := parseStop(f.Stop)
	if berr != nil {
		return nil, nil, berr
	}
	if f.Model != "" && f.Model != s.model {
		return nil, nil, bad("model", "model %q is not served here; this service serves %q", f.Model, s.model)
	}
	return opts, stops, nil
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
	return s.encode(text, "prompt")
}

// encode is the token ids of a prompt's text; param names the field it came from.
func (s *server) encode(text, param string) ([]int64, *badRequest) {
	ids, err := s.text.Encode(text)
	if err != nil {
		return nil, bad(param, "the tokenizer cannot encode the prompt: %v", err)
	}
	if len(ids) == 0 {
		return nil, bad(param, "the prompt encodes to no token")
	}
	if max := s.gen.Info().MaxLen; len(ids) >= max {
		return nil, bad(param, "the prompt is %d tokens; this model takes at most %d, and needs room for the completion",
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
	Usage   any      `json:"usage,omitempty"` // nil, *usage, or jsonNull (see streamUsage)
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// tokenUsage is the usage of a completion of prompt that ended as end says.
func tokenUsage(prompt []int64, end ending) *usage {
	return &usage{PromptTokens: len(prompt), CompletionTokens: end.tokens, TotalTokens: len(prompt) + end.tokens}
}

// jsonNull is a response's "usage": null, which omitempty keeps (a nil usage is left out).
var jsonNull = json.RawMessage("null")

// streamUsage reads stream_options, which OpenAI takes only with "stream": true: whether the
// stream ends with a usage chunk (include_usage), before which every chunk says "usage": null.
// Other options (include_obfuscation) are ignored, as fields this service does not read are.
func (f *generationFields) streamUsage() (bool, *badRequest) {
	if len(f.StreamOptions) == 0 || string(f.StreamOptions) == "null" {
		return false, nil
	}
	if !f.Stream {
		return false, bad("stream_options", "stream_options is only allowed with \"stream\": true")
	}
	var o map[string]json.RawMessage
	if err := json.Unmarshal(f.StreamOptions, &o); err != nil {
		return false, bad("stream_options", "stream_options must be an object, e.g. {\"include_usage\": true}")
	}
	var include *bool
	if raw, ok := o["include_usage"]; ok && json.Unmarshal(raw, &include) != nil {
		return false, bad("stream_options.include_usage", "stream_options.include_usage is %s; give true or false",
			raw)
	}
	return include != nil && *include, nil
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	var req completionRequest
	if berr := decodeRequest(r, &req); berr != nil {
		s.refuse(w, berr)
		return
	}
	prompt, berr := s.prompt(req.Prompt)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	opts, stops, berr := s.options(&req.generationFields, "max_tokens", 16)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	includeUsage, berr := req.streamUsage()
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	// The request's context: when the client disconnects, the sequence is cancelled.
	ctx := r.Context()
	gen := s.start(ctx, w, prompt, opts, "prompt")
	if gen == nil {
		return
	}
	c := completion{
		ID:      fmt.Sprintf("cmpl-%x", time.Now().UnixNano()),
		Object:  "text_completion",
		Created: time.Now().Unix(),
		Model:   s.model,
	}
	if !req.Stream {
		var text strings.Builder
		end := s.follow(ctx, gen, stops, func(piece string) error {
			text.WriteString(piece)
			return nil
		})
		if ctx.Err() != nil || s.failed(w, end) {
			return
		}
		c.Choices = []choice{{Text: text.String(), Index: 0, FinishReason: &end.finish}}
		c.Usage = tokenUsage(prompt, end)
		writeJSON(w, http.StatusOK, c)
		return
	}
	events := startEvents(w, gen)
	if includeUsage {
		c.Usage = jsonNull
	}
	end := s.follow(ctx, gen, stops, func(piece string) error {
		c.Choices = []choice{{Text: piece, Index: 0}}
		return events.send(c)
	})
	if ctx.Err() != nil || events.failed(end) {
		return // nobody to tell, or told
	}
	c.Choices = []choice{{Text: "", Index: 0, FinishReason: &end.finish}}
	events.send(c)
	if includeUsage {
		c.Choices, c.Usage = []choice{}, tokenUsage(prompt, end)
		events.send(c)
	}
	events.done()
}

// start submits a prompt to the generator; when it cannot, it answers the request (503 when the
// queue is full, 400 for what libpipe finds wrong with the prompt, named param) and returns nil.
func (s *server) start(ctx context.Context, w http.ResponseWriter, prompt []int64, opts *pipe.GenerationOptions,
	param string) *pipe.Generation {
	gen, err := s.gen.Generate(ctx, prompt, opts)
	switch {
	case errors.Is(err, pipe.ErrBusy):
		s.rejectedBusy.Add(1)
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, "server_busy", "", "%s", message(err))
		return nil
	case errors.Is(err, pipe.ErrInvalidArgument):
		// What libpipe checks itself: token ids outside the vocabulary, a prompt without room.
		s.refuse(w, bad(param, "%s", message(err)))
		return nil
	case err != nil:
		writeError(w, http.StatusInternalServerError, "server_error", "", "%v", err)
		return nil
	}
	return gen
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

// ending is how a completion ended: OpenAI's finish reason ("stop": the model's end token or a
// stop string; "length"), the tokens it took, or the error that ended it.
type ending struct {
	finish string
	tokens int
	err    error
}

// follow receives gen's tokens as text, calling emit for each piece, until the sequence ends, a
// stop string appears (the sequence is cancelled; the text before it is emitted, not the rest), or
// ctx ends (the client left: the sequence is cancelled before this returns, so that its slot is
// freed however the consumer behaves).
func (s *server) follow(ctx context.Context, gen *pipe.Generation, stops []string, emit func(string) error) ending {
	text := &textStream{codec: s.text}
	scan := &stopScanner{stops: stops}
	left, stopped, tokens := false, false, 0
	send := func(piece string, hit bool) {
		if piece != "" && !left {
			if err := emit(piece); err != nil {
				left = true // a write failed: the client is gone
				gen.Cancel()
			}
		}
		if hit && !stopped {
			stopped = true
			gen.Cancel() // the rest is not wanted
		}
	}
	for ch := gen.Tokens(); ch != nil; {
		select {
		case id, open := <-ch:
			if !open {
				ch = nil
				break
			}
			if !stopped {
				tokens++
				send(scan.Push(text.Add(id)))
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
	if !stopped {
		send(scan.Push(text.Flush()))
	}
	if !stopped {
		send(scan.Flush(), false)
	}
	info, _ := gen.Info()
	reason := info.FinishReason
	if stopped {
		reason = pipe.FinishStop
	}
	if int(reason) < len(s.finished) {
		s.finished[reason].Add(1)
	} else {
		s.finishedOther.Add(1)
	}
	if stopped {
		// Tokens generated after the stop string's are dropped: they are not the completion's.
		return ending{finish: "stop", tokens: tokens}
	}
	return ending{finish: openAIFinish(reason), tokens: info.GeneratedTokens, err: gen.Err()}
}

// openAIFinish is OpenAI's name for how a completion ended.
func openAIFinish(reason pipe.FinishReason) string {
	if reason == pipe.FinishStop {
		return "stop"
	}
	return "length"
}

// failed answers a request whose completion ended with an error, and says whether it did.
func (s *server) failed(w http.ResponseWriter, end ending) bool {
	if end.err == nil {
		return false
	}
	status := http.StatusInternalServerError
	if errors.Is(end.err, pipe.ErrDeadlineExceeded) {
		status = http.StatusGatewayTimeout
	}
	writeError(w, status, "server_error", "", "%s", message(end.err))
	return true
}

// events is a response of server-sent events, each flushed as it is written.
type events struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// startEvents sends the headers of an event stream (cancelling gen if the client is already gone).
func startEvents(w http.ResponseWriter, gen *pipe.Generation) *events {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // a proxy in front must not hold events back
	w.WriteHeader(http.StatusOK)
	e := &events{w: w, rc: http.NewResponseController(w)}
	if err := e.rc.Flush(); err != nil {
		gen.Cancel()
	}
	return e
}

// send writes v as one `data:` event.
func (e *events) send(v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(e.w, "data: %s\n\n", data); err != nil {
		return err
	}
	return e.rc.Flush()
}

// failed ends the stream with an error event when the completion ended with an error.
func (e *events) failed(end ending) bool {
	if end.err == nil {
		return false
	}
	e.send(map[string]apiError{"error": {Message: message(end.err), Type: "server_error"}})
	return true
}

// done ends the stream as OpenAI's does.
func (e *events) done() {
	io.WriteString(e.w, "data: [DONE]\n\n")
	e.rc.Flush()
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
