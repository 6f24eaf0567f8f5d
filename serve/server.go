package main

// The HTTP API, in the shape of OpenAI's completions API:
//
//	POST /v1/completions  {"prompt": "...", "max_tokens": 16, "temperature": 1, "top_p": 1,
//	                       "seed": 7, "stop": ["\n"], "stream": true, "echo": false}
//	    stream: server-sent events, one `data: {"choices":[{"text": "...", "index": 0,
//	    "finish_reason": null}], ...}` per piece of text, a last one with "finish_reason"
//	    ("stop": the model's end token or a stop string; "length"), then `data: [DONE]`;
//	    otherwise one JSON object with the whole text and "usage". With "stream_options":
//	    {"include_usage": true}, every chunk has "usage": null and one more, with no choice and the
//	    usage, comes before [DONE]. "echo": true puts the prompt before the completion (echo.go).
//	POST /v1/chat/completions  the same over a conversation (chat.go)
//	GET /v1/models        the one model served
//	GET /health           {"status": "ok", slots, queue, counters}; 503 while the pipeline is broken
//	GET /metrics          Prometheus' text format (metrics.go)
//
// Bad requests get 400 with an OpenAI-style error object naming the field (errors.go has the other
// statuses); a full queue (every cache slot taken and GeneratorOptions.MaxQueued sequences
// waiting), or a request that waited past -queue-timeout for a slot, gets 503 with Retry-After
// (admission.go). A client that disconnects, or stops reading for -write-timeout, cancels its
// sequence, which frees its slot at once or when its step returns. limits.go bounds what a client
// may hold, auth.go asks for the API key; faults.go says what clients get when the pipeline
// breaks (a worker process died).

import (
	"bytes"
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

type server struct {
	pipeline *pipeline          // the generator, replaced when it breaks (faults.go)
	info     pipe.GeneratorInfo // the decoder's, the same for every generator of the pipeline
	stages   int
	text     *textCodec
	model    string // the name /v1/models gives and responses carry
	// The model's end-of-sequence ids and the chat template's end of a turn (the tokenizer's stop
	// ids): a completion or a chat reply ends there ("stop").
	stopIDs []int64

	queueTimeout time.Duration // the longest a request waits for a cache slot (admission.go); 0: no limit

	metrics *metrics // /metrics; set by handler

	// Counters for /health (and /metrics): what operators want to see, and what the test observes.
	requests      atomic.Uint64
	rejectedBusy  atomic.Uint64
	badRequests   atomic.Uint64
	disconnects   atomic.Uint64 // clients that left before their completion ended
	writeFailures atomic.Uint64 // responses cut off: the client stopped reading (-write-timeout) or left
	queueTimeouts atomic.Uint64 // requests that waited past -queue-timeout for a slot
	finished      [pipe.FinishError + 1]atomic.Uint64
	finishedOther atomic.Uint64
}

// handler is the whole service: the routes behind the API key (auth.go), every request counted
// and timed for /metrics.
func (s *server) handler(key *apiKey) http.Handler {
	s.metrics = newMetrics(s)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.completions)
	mux.HandleFunc("POST /v1/chat/completions", s.chatCompletions)
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /health", s.health)
	mux.Handle("GET /metrics", s.metrics.handler())
	return s.metrics.instrument(mux, key.guard(mux))
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
	Prompt   json.RawMessage `json:"prompt"`
	Logprobs *int            `json:"logprobs"` // null: none; 0..5: alternatives per token (logprobs.go)
	Echo     bool            `json:"echo"`     // the prompt before the completion (echo.go)
}

// decodeRequest reads the body, one JSON object, into v.
func decodeRequest(w http.ResponseWriter, r *http.Request, v any) *badRequest {
	// The whole body is read first, under the read deadline (limits.go), which is lifted only
	// once it is all in: what is left of a body is otherwise read by the server after the
	// handler, with no deadline. With the ResponseWriter, MaxBytesReader also has the connection
	// closed after the response rather than the rest of a body over the limit read.
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return &badRequest{message: fmt.Sprintf("the request body is over %d bytes", maxBody),
			status: http.StatusRequestEntityTooLarge, code: "request_too_large"}
	case timedOut(err):
		return &badRequest{message: "the request body did not arrive within the service's read timeout",
			status: http.StatusRequestTimeout}
	case err != nil:
		return bad("", "the request body could not be read: %v", err)
	}
	bodyRead(w)
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(v); err != nil {
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
		return nil, nil, &badRequest{param: "model", status: http.StatusNotFound, code: "model_not_found",
			message: fmt.Sprintf("model %q does not exist here; this service serves %q", f.Model, s.model)}
	}
	return opts, stops, nil
}

// prompt reads OpenAI's prompt forms: a string, an array of one string, or an array of token ids.
// It gives the token ids and the prompt's text ("" for token ids).
func (s *server) prompt(raw json.RawMessage) ([]int64, string, *badRequest) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, "", bad("prompt", "prompt is missing; give the text to complete")
	}
	var text string
	if err := json.Unmarshal(raw, &text); err != nil {
		var texts []string
		var ids []int64
		switch {
		case json.Unmarshal(raw, &texts) == nil:
			if len(texts) != 1 {
				return nil, "", bad("prompt", "prompt holds %d texts; this service completes one per request",
					len(texts))
			}
			text = texts[0]
		case json.Unmarshal(raw, &ids) == nil:
			if len(ids) == 0 {
				return nil, "", bad("prompt", "prompt is an empty list of token ids")
			}
			return ids, "", nil
		default:
			return nil, "", bad("prompt", "prompt must be a string, an array of one string or an array of token ids")
		}
	}
	if text == "" {
		return nil, "", bad("prompt", "prompt is empty; give the text to complete")
	}
	ids, berr := s.encode(text, "prompt")
	return ids, text, berr
}

// encode is the token ids of a prompt's text; param names the field it came from.
func (s *server) encode(text, param string) ([]int64, *badRequest) {
	max := s.info.MaxLen - 1 // room for one token of completion
	ids, err := s.text.EncodeAtMost(text, max)
	switch {
	case errors.Is(err, errTooManyTokens):
		return nil, bad(param, "the prompt is over %d tokens, the most this model takes with room for the completion",
			max)
	case err != nil:
		return nil, bad(param, "the tokenizer cannot encode the prompt: %v", err)
	case len(ids) == 0:
		return nil, bad(param, "the prompt encodes to no token")
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
	PromptTokens        int                 `json:"prompt_tokens"`
	CompletionTokens    int                 `json:"completion_tokens"`
	TotalTokens         int                 `json:"total_tokens"`
	PromptTokensDetails promptTokensDetails `json:"prompt_tokens_details"`
}

// promptTokensDetails is OpenAI's account of the prompt: cached_tokens are those found in the
// generator's cache slots (prefix reuse: a conversation's earlier turns, a shared system
// prompt) and not computed again.
type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// tokenUsage is the usage of a completion of a prompt of promptTokens that ended as end says.
func tokenUsage(promptTokens int, end ending) *usage {
	return &usage{PromptTokens: promptTokens, CompletionTokens: end.tokens, TotalTokens: promptTokens + end.tokens,
		PromptTokensDetails: promptTokensDetails{CachedTokens: end.cached}}
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
	began := time.Now()
	s.requests.Add(1)
	var req completionRequest
	if berr := decodeRequest(w, r, &req); berr != nil {
		s.refuse(w, berr)
		return
	}
	prompt, promptText, berr := s.prompt(req.Prompt)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	// max_tokens 0 with echo: the prompt scored, not completed; libpipe generates one token at
	// least, which is dropped (echo.go).
	scoreOnly := false
	if req.MaxTokens != nil && *req.MaxTokens < 0 && req.Echo {
		s.refuse(w, bad("max_tokens", "max_tokens is %d; give at least 1, or 0 to have the prompt scored without a "+
			"completion", *req.MaxTokens))
		return
	}
	if req.MaxTokens != nil && *req.MaxTokens == 0 {
		if !req.Echo {
			s.refuse(w, bad("max_tokens", "max_tokens is 0; give at least 1, or set \"echo\": true to have the "+
				"prompt scored without a completion"))
			return
		}
		one := 1
		scoreOnly, req.MaxTokens = true, &one
	}
	opts, stops, berr := s.options(&req.generationFields, "max_tokens", 16)
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	if scoreOnly {
		stops = nil // nothing of the completion is kept: nothing to stop
	}
	includeUsage, berr := req.streamUsage()
	if berr != nil {
		s.refuse(w, berr)
		return
	}
	if berr := completionLogprobs(req.Logprobs, opts); berr != nil {
		s.refuse(w, berr)
		return
	}
	var echoed *echo // nil: no echo
	if req.Echo {
		echoed = s.newEcho(prompt, promptText, opts)
	}
	// The request's context: when the client disconnects, the sequence is cancelled.
	ctx := r.Context()
	gen := s.start(ctx, w, prompt, opts, "prompt", began)
	if gen == nil {
		return // answered
	}
	c := completion{
		ID:      fmt.Sprintf("cmpl-%x", time.Now().UnixNano()),
		Object:  "text_completion",
		Created: time.Now().Unix(),
		Model:   s.model,
	}
	offset := 0 // the text_offset of the next token's log-probabilities
	logprobs := func(tokens []tokenLogprob) any {
		if !opts.Logprobs {
			return nil
		}
		return s.completionLogprobsOf(tokens, &offset)
	}
	// scored is how the completion ended, what it says of its tokens: with scoreOnly, none.
	scored := func(end ending) ending {
		if scoreOnly {
			end.finish, end.tokens, end.logprobs = "length", 0, nil
		}
		return end
	}
	if !req.Stream {
		var text strings.Builder
		var tokens []tokenLogprob
		end := scored(s.follow(ctx, gen, stops, func(piece string, lps []tokenLogprob) error {
			if !scoreOnly {
				text.WriteString(piece)
				tokens = append(tokens, lps...)
			}
			return nil
		}))
		if ctx.Err() != nil || s.failed(w, end) {
			return
		}
		tokens = append(tokens, end.logprobs...)
		whole := text.String()
		if echoed != nil {
			whole = echoed.text + whole
			if echoed.scored {
				tokens = append(echoed.entries(gen.gen.PromptLogprobs()), tokens...)
			}
		}
		c.Choices = []choice{{Text: whole, Index: 0, Logprobs: logprobs(tokens), FinishReason: &end.finish}}
		c.Usage = tokenUsage(len(prompt), end)
		writeJSON(w, http.StatusOK, c)
		return
	}
	events := s.startEvents(w, gen.gen)
	if includeUsage {
		c.Usage = jsonNull
	}
	end := scored(s.follow(ctx, gen, stops, func(piece string, lps []tokenLogprob) error {
		if scoreOnly {
			return nil
		}
		piece, lps = echoed.prepend(gen.gen, piece, lps)
		c.Choices = []choice{{Text: piece, Index: 0, Logprobs: logprobs(lps)}}
		return events.send(c)
	}))
	if ctx.Err() != nil || events.failed(end) {
		return // nobody to tell, or told
	}
	// The last chunk: the echo, when no chunk had text to carry it (a completion without text, or
	// none: max_tokens 0), and the entries of the tokens that gave no text.
	text, lps := echoed.prepend(gen.gen, "", end.logprobs)
	c.Choices = []choice{{Text: text, Index: 0, FinishReason: &end.finish}}
	if len(lps) > 0 {
		c.Choices[0].Logprobs = logprobs(lps)
	}
	events.send(c)
	if includeUsage {
		c.Choices, c.Usage = []choice{}, tokenUsage(len(prompt), end)
		events.send(c)
	}
	events.done()
}

// ending is how a completion ended: OpenAI's finish reason ("stop": the model's end token or a
// stop string; "length"), the tokens it took, or the error that ended it, and whether that error
// is the pipeline's (faults.go) rather than the request's.
type ending struct {
	finish string
	tokens int
	cached int // prompt tokens found in the cache slot
	err    error
	broken bool
	// With log-probabilities: those of the tokens that gave no text emitted (an end token, text
	// held back by a stop string that then came), in order after every emitted piece's.
	logprobs []tokenLogprob
}

// follow receives the sequence's tokens as text, calling emit for each piece (with the
// log-probabilities of the tokens not given out before, when the sequence keeps them), until the sequence
// ends, a stop string appears (the sequence is cancelled; the text before it is emitted, not the
// rest), a write fails (the client stopped reading or left: the sequence is cancelled) or ctx
// ends (the client left: the sequence is cancelled before this returns, so that its slot is freed
// however the consumer behaves). Its tokens are timed, and its usage counted, for /metrics.
func (s *server) follow(ctx context.Context, a *admitted, stops []string,
	emit func(string, []tokenLogprob) error) ending {
	end := s.followTokens(ctx, a, stops, emit)
	s.metrics.usage(a.promptTokens, end.tokens)
	return end
}

func (s *server) followTokens(ctx context.Context, a *admitted, stops []string,
	emit func(string, []tokenLogprob) error) ending {
	gen := a.gen
	text := s.text.newStream()
	defer text.Close()
	scan := &stopScanner{stops: stops}
	left, stopped, tokens := false, false, 0
	keep := gen.Logprobs() != nil
	var unsent []int64 // with log-probabilities: the last tokens taken, whose entries were not given out
	entries := func() []tokenLogprob {
		if len(unsent) == 0 {
			return nil
		}
		// Every token received has its entry; the tokens taken are tokens-len(unsent) .. tokens-1.
		lps, first := gen.Logprobs(), tokens-len(unsent)
		out := make([]tokenLogprob, len(unsent))
		for i, id := range unsent {
			out[i] = tokenLogprob{id: id, lp: lps[first+i]}
		}
		unsent = unsent[:0]
		return out
	}
	send := func(piece string, hit bool) {
		if piece != "" && !left {
			if err := emit(piece, entries()); err != nil {
				left = true // the client is gone, or stopped reading
				gen.Cancel()
			}
		}
		if hit && !stopped {
			stopped = true
			gen.Cancel() // the rest is not wanted
		}
	}
	clock := s.metrics.clock(a.began)
	take := func(id int64, at time.Time) {
		if !stopped {
			tokens++
			if keep {
				unsent = append(unsent, id)
			}
			clock.token(at)
			send(scan.Push(text.Add(id)))
		}
	}
	for _, id := range a.head {
		take(id, a.headAt)
	}
	for ch := gen.Tokens(); ch != nil; {
		select {
		case id, open := <-ch:
			if !open {
				ch = nil
				break
			}
			take(id, time.Now())
		case <-ctx.Done():
			if !left {
				left = true
				gen.Cancel()
				s.disconnects.Add(1)
			}
			ctx = context.Background() // seen once; now wait for the channel to close
		}
	}
	if !left && ctx.Err() != nil {
		// The binding cancels the sequence on the context too, so its channel may close before
		// this loop saw the context end: the client left all the same.
		left = true
		s.disconnects.Add(1)
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
		return ending{finish: "stop", tokens: tokens, cached: info.CachedTokens, logprobs: entries()}
	}
	err := gen.Err()
	broken := a.backend.failing(err)
	if broken {
		s.pipeline.report()
	}
	return ending{finish: openAIFinish(reason), tokens: info.GeneratedTokens, cached: info.CachedTokens, err: err,
		broken: broken, logprobs: entries()}
}

// openAIFinish is OpenAI's name for how a completion ended.
func openAIFinish(reason pipe.FinishReason) string {
	if reason == pipe.FinishStop {
		return "stop"
	}
	return "length"
}

// failed answers a request whose completion ended with an error, and says whether it did. Nothing
// was sent yet: when the pipeline failed, the client is told to send the request again (503).
func (s *server) failed(w http.ResponseWriter, end ending) bool {
	if end.err == nil {
		return false
	}
	if end.broken {
		log.Printf("a generation failed with the pipeline: %v", end.err)
		s.unavailable(w)
	} else if errors.Is(end.err, pipe.ErrDeadlineExceeded) {
		internalError(w, http.StatusGatewayTimeout, "the generation passed its deadline", end.err)
	} else {
		internalError(w, http.StatusInternalServerError, "the generation failed", end.err)
	}
	return true
}

// events is a response of server-sent events, each flushed as it is written.
type events struct {
	w   http.ResponseWriter
	rc  *http.ResponseController
	s   *server
	err error // the first write that failed: nothing more is written after it
}

// startEvents sends the headers of an event stream (cancelling gen if the client is already gone).
func (s *server) startEvents(w http.ResponseWriter, gen *pipe.Generation) *events {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // a proxy in front must not hold events back
	w.WriteHeader(http.StatusOK)
	e := &events{w: w, rc: http.NewResponseController(w), s: s}
	if err := e.flush(); err != nil {
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
	return e.write("data: " + string(data) + "\n\n")
}

func (e *events) write(text string) error {
	if e.err == nil {
		if _, err := io.WriteString(e.w, text); err != nil {
			e.fail(err)
		}
	}
	return e.flush()
}

func (e *events) flush() error {
	if e.err == nil {
		if err := e.rc.Flush(); err != nil {
			e.fail(err)
		}
	}
	return e.err
}

// fail records the first failed write (past -write-timeout, or to a client that left).
func (e *events) fail(err error) {
	e.err = err
	e.s.writeFailures.Add(1)
	if timedOut(err) {
		log.Printf("a client took no event for the write timeout: its stream is cut off")
	}
}

// failed ends the stream with an error event when the completion ended with an error: no
// finish_reason and no [DONE] follow, so that a cut reply never looks complete.
func (e *events) failed(end ending) bool {
	if end.err == nil {
		return false
	}
	if end.broken {
		log.Printf("a stream was cut off by the pipeline's failure: %v", end.err)
		e.send(cutOff())
	} else if errors.Is(end.err, pipe.ErrDeadlineExceeded) {
		log.Printf("the generation passed its deadline: %v", end.err)
		e.send(errorBody("server_error", "", "", "the generation passed its deadline"))
	} else {
		log.Printf("the generation failed: %v", end.err)
		e.send(errorBody("server_error", "", "", "the generation failed; the service's log says why"))
	}
	return true
}

// done ends the stream as OpenAI's does.
func (e *events) done() { e.write("data: [DONE]\n\n") }

func (s *server) models(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data":   []map[string]any{{"id": s.model, "object": "model", "created": 0, "owned_by": "libpipe"}},
	})
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	// /health is open without the API key: it says whether the service works, not why not (the
	// log does). 503 while the pipeline is broken, until it is rebuilt (faults.go).
	status, code := "ok", http.StatusOK
	var st pipe.GeneratorStats
	b := s.pipeline.acquire()
	if b == nil || b.unhealthy() != nil {
		s.pipeline.report()
		status, code = "unavailable", http.StatusServiceUnavailable
	}
	if b != nil {
		var err error
		if st, err = b.gen.Stats(); err != nil { // closed since: it broke
			status, code = "unavailable", http.StatusServiceUnavailable
		}
	}
	finished := map[string]uint64{"other": s.finishedOther.Load()}
	for reason := pipe.FinishStop; reason <= pipe.FinishError; reason++ {
		finished[reason.String()] = s.finished[reason].Load()
	}
	writeJSON(w, code, map[string]any{
		"status":             status,
		"model":              s.model,
		"slots":              s.info.Slots,
		"slots_in_use":       st.SlotsInUse,
		"queued":             st.Queued,
		"tokens_per_s":       st.TokensPerSecond,
		"requests":           s.requests.Load(),
		"rejected_busy":      s.rejectedBusy.Load(),
		"bad_requests":       s.badRequests.Load(),
		"client_disconnects": s.disconnects.Load(),
		"write_failures":     s.writeFailures.Load(),
		"queue_timeouts":     s.queueTimeouts.Load(),
		"pipeline_rebuilds":  s.pipeline.rebuilds.Load(),
		"finished":           finished,
	})
}
