package pipe

// Token generation (pipe.h's "Generation" section, libpipe >= 0.8): a Generator drives a decoder's
// session step by step, and each Generation streams its tokens into a Go channel.
//
// How tokens reach the channel without a thread per generation: libpipe announces new tokens
// through a callback (pipe_generation_on_event) on its own thread, which only wakes the
// generation's goroutine (a non-blocking send on a channel of capacity 1, through the handle
// registry of internal/capi/events.go); that goroutine reads the tokens with
// pipe_generation_read, which never waits, and hands them to the consumer. While it waits for
// the next announcement or for the consumer it is a parked goroutine, not an OS thread blocked in
// C. It ends, and frees the C generation, once libpipe has reported the end and every token was
// handed over (or dropped after a cancellation).

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// GeneratorOptions configures a Generator; the zero value (or nil) is libpipe's default for
// every field.
type GeneratorOptions struct {
	// Sequences that may wait for a free cache slot; one more is refused with ErrBusy.
	// 0: 4 x the decoder's slots.
	MaxQueued int
	// Tokens per step, all rows together (a decoder without skips_padding: padded positions,
	// rows x the longest chunk): a longer prompt is prefilled in chunks, so that it does not hold
	// up the others for long. 0: 256.
	PrefillChunk int
	// Steps in the pipeline at once. 0: the stages that compute at once (every stage busy): the
	// number of stages, or of worker threads when stages share the cores.
	StepsInFlight int
	// Rows (sequences) in one step. 0: the decoder's slots.
	MaxRowsPerStep int
}

// GeneratorInfo is what the decoder offers, read when the generator is created.
type GeneratorInfo struct {
	Slots             int    // sequences that can hold a cache slot at once
	MaxLen            int    // tokens per sequence, prompt and generated together
	Vocab             int    // token ids are 0 .. Vocab-1
	CacheBytesPerSlot uint64 // K and V of every layer, all stages together
}

// GeneratorStats is what a generator has done since it was created.
type GeneratorStats struct {
	SlotsInUse           int     // sequences holding a cache slot now
	Queued               int     // sequences waiting for a slot now
	SequencesFinished    uint64  // ended for any reason
	PromptTokens         uint64  // prefilled
	GeneratedTokens      uint64  // sampled and delivered
	Steps                uint64  // steps run through the pipeline
	TokensPerSecond      float64 // generated tokens per second while a sequence held a slot
	MeanTimeToFirstToken time.Duration
	MeanInterToken       time.Duration // over every gap between two tokens of a sequence
	MeanRowsPerStep      float64       // sequences per step
	Sampling             time.Duration // time spent sampling, all steps together
	// StepsInFlight is the engine's limit now: one step per stage, or 1 where it measured that one
	// step at a time with every core on it is faster (stages sharing this process's cores).
	StepsInFlight   int
	StepsOneAtATime uint64 // steps launched while the limit was 1
	StepsPipelined  uint64 // steps launched while it was more
	// CachedPromptTokens are prompt tokens found in cache slots instead of prefilled (prefix reuse).
	CachedPromptTokens uint64
}

// Generator generates tokens from a decoder (a TorchScript causal language model that follows
// the decoder contract of pipe.h; `python -m libpipe.export_llm` writes one for Llama, Qwen2,
// Mistral and GPT-2 checkpoints). It owns a session of the decoder's plan: sequences are admitted
// while KV-cache slots are free and queue otherwise, and the prefill and decode steps of many
// sequences are batched and pipelined across the stages. All methods are safe for concurrent
// use; many goroutines may Generate at once.
type Generator struct {
	mu      sync.RWMutex // read: a call is using ptr; write: Close
	ptr     capi.SwigcptrPipe_generator
	cleanup runtime.Cleanup
	session *Session // libpipe's, borrowed: never closed by this binding, forgotten by Close
	info    GeneratorInfo
}

// NewGenerator builds a session of the plan as NewSession does (session may be nil; its
// Microbatches and Microbatching are ignored: a step is one micro-batch) and checks that the
// model follows the decoder contract by running one step of one token. ErrInvalidArgument when
// it does not (the message says what differs) or for bad options; otherwise NewSession's errors.
func (p *Plan) NewGenerator(session *SessionOptions, opts *GeneratorOptions) (*Generator, error) {
	const op = "Plan.NewGenerator"
	if opts == nil {
		opts = &GeneratorOptions{}
	}
	pptr, err := p.acquire(op)
	if err != nil {
		return nil, err
	}
	defer p.mu.RUnlock()
	so, err := newSessionOptions(op, session)
	if err != nil {
		return nil, err
	}
	defer so.free()
	gopts := capi.NewPipe_generator_options()
	if gopts.Swigcptr() == 0 {
		return nil, errorf(op, StatusOutOfMemory, "cannot allocate generator options")
	}
	defer capi.DeletePipe_generator_options(gopts)
	gopts.SetMax_queued(int64(opts.MaxQueued))
	gopts.SetPrefill_chunk(int64(opts.PrefillChunk))
	gopts.SetSteps_in_flight(int64(opts.StepsInFlight))
	gopts.SetMax_rows_per_step(int64(opts.MaxRowsPerStep))
	var ptr capi.SwigcptrPipe_generator
	err = call("pipe_generator_create", func() int { return capi.Pipe_generator_create(pptr, so.c, gopts, &ptr) })
	if err != nil {
		return nil, err
	}
	g := &Generator{ptr: ptr}
	g.cleanup = runtime.AddCleanup(g, func(h capi.SwigcptrPipe_generator) { capi.Pipe_generator_destroy(h) }, ptr)
	if err := g.load(); err != nil {
		g.Close()
		return nil, err
	}
	return g, nil
}

// load reads what never changes: the decoder's info and the borrowed session.
func (g *Generator) load() error {
	const op = "Plan.NewGenerator"
	info := capi.NewPipe_generator_info()
	if info.Swigcptr() == 0 {
		return errorf(op, StatusOutOfMemory, "cannot allocate generator info")
	}
	defer capi.DeletePipe_generator_info(info)
	err := call("pipe_generator_get_info", func() int { return capi.Pipe_generator_get_info(g.ptr, info) })
	if err != nil {
		return err
	}
	g.info = GeneratorInfo{
		Slots:             int(info.GetSlots()),
		MaxLen:            int(info.GetMax_len()),
		Vocab:             int(info.GetVocab()),
		CacheBytesPerSlot: info.GetCache_bytes_per_slot(),
	}
	var sptr capi.SwigcptrPipe_session
	if err := call("pipe_generator_session", func() int { return capi.Pipe_generator_session(g.ptr, &sptr) }); err != nil {
		return err
	}
	g.session = &Session{ptr: sptr} // no cleanup: the generator destroys it
	return g.session.countStages()
}

// Close cancels every generation still going on (their Tokens channels close and Err is
// ErrCancelled once libpipe has reported it), waits for the steps in flight and frees the
// generator and its session. Generations stay usable (Info, Err). Closing twice is a no-op.
func (g *Generator) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ptr == 0 {
		return nil
	}
	if g.session != nil {
		// Waits for the stage statistics or trace calls in progress on the borrowed session.
		g.session.mu.Lock()
		g.session.ptr = 0
		g.session.mu.Unlock()
	}
	g.cleanup.Stop()
	capi.Pipe_generator_destroy(g.ptr)
	g.ptr = 0
	return nil
}

func (g *Generator) acquire(op string) (capi.SwigcptrPipe_generator, error) {
	g.mu.RLock()
	if g.ptr == 0 {
		g.mu.RUnlock()
		return 0, closedError(op, "generator")
	}
	return g.ptr, nil
}

// Info is what the decoder offers: slots, maximum length, vocabulary, cache bytes per slot.
func (g *Generator) Info() GeneratorInfo { return g.info }

// NumStages is the number of stages of the generator's session.
func (g *Generator) NumStages() int {
	if g.session == nil {
		return 0
	}
	return g.session.numStages
}

// Stats is what the generator has done since it was created.
func (g *Generator) Stats() (GeneratorStats, error) {
	const op = "Generator.Stats"
	ptr, err := g.acquire(op)
	if err != nil {
		return GeneratorStats{}, err
	}
	defer g.mu.RUnlock()
	st := capi.NewPipe_generator_stats()
	if st.Swigcptr() == 0 {
		return GeneratorStats{}, errorf(op, StatusOutOfMemory, "cannot allocate generator stats")
	}
	defer capi.DeletePipe_generator_stats(st)
	if err := call("pipe_generator_get_stats", func() int { return capi.Pipe_generator_get_stats(ptr, st) }); err != nil {
		return GeneratorStats{}, err
	}
	return GeneratorStats{
		SlotsInUse:           int(st.GetSlots_in_use()),
		Queued:               int(st.GetQueued()),
		SequencesFinished:    st.GetSequences_finished(),
		PromptTokens:         st.GetPrompt_tokens(),
		GeneratedTokens:      st.GetGenerated_tokens(),
		Steps:                st.GetSteps(),
		TokensPerSecond:      st.GetTokens_per_s(),
		MeanTimeToFirstToken: milliseconds(st.GetMean_time_to_first_token_ms()),
		MeanInterToken:       milliseconds(st.GetMean_inter_token_ms()),
		MeanRowsPerStep:      st.GetMean_rows_per_step(),
		Sampling:             milliseconds(st.GetSampling_ms()),
		StepsInFlight:        int(st.GetSteps_in_flight()),
		StepsOneAtATime:      st.GetSteps_one_at_a_time(),
		StepsPipelined:       st.GetSteps_pipelined(),
		CachedPromptTokens:   st.GetCached_prompt_tokens(),
	}, nil
}

// StageStats is the statistics of stage i of the generator's session.
func (g *Generator) StageStats(i int) (StageStats, error) { return g.borrowed().StageStats(i) }

// Check is nil while the generator's session works; see Session.Check.
func (g *Generator) Check() error { return g.borrowed().Check() }

// TraceStart records a timeline of every step each stage runs from now on (Session.TraceStart).
func (g *Generator) TraceStart() error { return g.borrowed().TraceStart() }

// TraceStartWithOperators records as TraceStart does, with each stage's time per operator and the
// engine's steps (launch, collect, sample, deliver) on a track named "engine"
// (Session.TraceStartWithOperators).
func (g *Generator) TraceStartWithOperators() error { return g.borrowed().TraceStartWithOperators() }

// TraceStop stops recording and writes the timeline to path ("" discards it).
func (g *Generator) TraceStop(path string) error { return g.borrowed().TraceStop(path) }

// borrowed is the generator's session for the methods above; after Close its ptr is 0, so they
// report a closed handle.
func (g *Generator) borrowed() *Session {
	if g.session == nil {
		return &Session{}
	}
	return g.session
}

func milliseconds(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// GenerationOptions are one sequence's options; the zero value (or nil) is greedy decoding of up
// to 16 tokens.
type GenerationOptions struct {
	// Tokens to generate at most; 0: 16. The sequence also ends once the decoder's MaxLen is full.
	MaxNewTokens int
	// 0: greedy (the most likely token). Otherwise the logits are divided by it before sampling.
	Temperature float64
	// Sample among the TopK most likely tokens; 0: all.
	TopK int
	// Sample among the smallest set of most likely tokens whose probability reaches TopP, in
	// (0, 1], applied after TopK; 0 means 1 (all).
	TopP float64
	// This sequence's random generator: equal seeds and logits give equal tokens.
	Seed uint64
	// Token ids that end the sequence; the stop id is its last token.
	StopIDs []int64
	// The sequence fails with ErrDeadlineExceeded if it has not finished this long after
	// Generate (waiting for a slot included); 0: none. The context's deadline, when earlier,
	// is the one that counts.
	Timeout time.Duration
	// Keep each token's log-probability under the model's distribution at its position (the
	// log-softmax of the logits, before Temperature, TopK and TopP), read with
	// Generation.Logprobs.
	Logprobs bool
	// With Logprobs or PromptLogprobs: also the log-probabilities of this many of the likeliest
	// tokens at each position, 0..20 (as OpenAI's API allows).
	TopLogprobs int
	// Score the prompt too (libpipe >= 0.15): each prompt token's log-probability given the
	// tokens before it, with TopLogprobs alternatives, read with Generation.PromptLogprobs
	// (OpenAI's echo with logprobs; perplexity). The prompt then crosses the pipeline one token a
	// step, like generated tokens, and none of it is taken from a cache slot (prefix reuse).
	PromptLogprobs bool
}

// MaxTopLogprobs is the most alternatives GenerationOptions.TopLogprobs may ask for.
const MaxTopLogprobs = 20

// TokenLogprobs is a generated (or prompt) token's log-probability under the model's
// distribution at its position (the log-softmax of the logits, before temperature, top-k and
// top-p: what the model said, whatever the sampler chose), and the likeliest tokens there, most
// likely first (GenerationOptions.TopLogprobs of them).
type TokenLogprobs struct {
	Logprob float32
	Top     []TokenLogprob
}

// TokenLogprob is one of the likeliest tokens at a position and its log-probability.
type TokenLogprob struct {
	ID      int64
	Logprob float32
}

// FinishReason says why a sequence ended (pipe.h's PIPE_FINISH_*).
type FinishReason int32

// The finish reasons.
const (
	FinishNone      FinishReason = FinishReason(capi.PIPE_FINISH_NONE)      // still queued or generating
	FinishStop      FinishReason = FinishReason(capi.PIPE_FINISH_STOP)      // a stop id was generated
	FinishLength    FinishReason = FinishReason(capi.PIPE_FINISH_LENGTH)    // MaxNewTokens, or MaxLen full
	FinishCancelled FinishReason = FinishReason(capi.PIPE_FINISH_CANCELLED) // Cancel, the context, Close
	FinishDeadline  FinishReason = FinishReason(capi.PIPE_FINISH_DEADLINE)  // the timeout passed
	FinishError     FinishReason = FinishReason(capi.PIPE_FINISH_ERROR)     // a step failed (see Err)
)

// String is "none", "stop", "length", "cancelled", "deadline", "error", or the number for a
// value pipe.h does not define.
func (f FinishReason) String() string {
	switch f {
	case FinishNone:
		return "none"
	case FinishStop:
		return "stop"
	case FinishLength:
		return "length"
	case FinishCancelled:
		return "cancelled"
	case FinishDeadline:
		return "deadline"
	case FinishError:
		return "error"
	}
	return fmt.Sprintf("FinishReason(%d)", int32(f))
}

// GenerationInfo is one sequence's progress. The durations are negative while not known yet.
type GenerationInfo struct {
	FinishReason     FinishReason
	PromptTokens     int           // the prompt's length
	GeneratedTokens  int           // tokens generated so far (received or not)
	Queued           time.Duration // from Generate to a cache slot
	TimeToFirstToken time.Duration // from Generate to the first token
	MeanInterToken   time.Duration // between tokens after the first
	// CachedTokens are prompt tokens found in the cache slot the sequence got, left there by an
	// earlier sequence that began the same way, and not computed again (prefix reuse).
	CachedTokens int
}

// Generation is one sequence being generated. Receive its tokens from Tokens until the channel
// is closed, then Err says how it ended. A consumer that stops early must Cancel it (or end its
// context): until then the generation keeps its goroutine, waiting to hand over the next token.
type Generation struct {
	core *generationCore
}

// generationCore is what the generation's goroutine, the event callback and the methods share.
type generationCore struct {
	mu          sync.RWMutex // read: info or cancel on ptr (pipe.h allows them together); write: destroy
	ptr         capi.SwigcptrPipe_generation
	handle      uint64 // in the event registry
	ctx         context.Context
	ctxDeadline bool          // libpipe's deadline is ctx's
	notify      chan struct{} // capacity 1: "read again", from the event callback
	cancelled   chan struct{} // closed by Cancel
	cancelOnce  sync.Once
	tokens      chan int64
	topLogprobs int // alternatives per token, with logprobs or promptLogprobs
	logprobs    bool
	// With promptLogprobs: the prompt's length, and whether its scores were read (with the first
	// token, or the end).
	promptLogprobs bool
	promptLen      int
	promptRead     bool
	lpMu           sync.Mutex      // guards lps and plps
	lps            []TokenLogprobs // one per token read from libpipe, with logprobs
	plps           []TokenLogprobs // one per prompt token (entry 0 empty), with promptLogprobs
	ended          chan struct{}   // closed after err is written, before tokens is closed
	err            error           // how it ended
	final          GenerationInfo  // the last info, kept once ptr is destroyed
}

// Generate starts generating after prompt (token ids, copied) and returns at once: the tokens
// arrive on the Generation's channel as they are sampled. A sequence waits for a cache slot when
// none is free. Errors here: ErrInvalidArgument for an empty prompt, an id outside 0..Vocab-1, a
// prompt that leaves no room for one token in MaxLen, or bad options (the message names them);
// ErrBusy when GeneratorOptions.MaxQueued sequences already wait (try again later, or elsewhere);
// ErrCommunication when the session is broken. Errors while generating come from Err.
//
// ctx bounds the sequence: cancelling it cancels the generation (Err is ErrCancelled, which also
// matches context.Canceled), and its deadline, with opts.Timeout, becomes the sequence's
// deadline (ErrDeadlineExceeded).
func (g *Generator) Generate(ctx context.Context, prompt []int64, opts *GenerationOptions) (*Generation, error) {
	const op = "Generator.Generate"
	if err := ctx.Err(); err != nil {
		return nil, contextError(op, err, "")
	}
	if opts == nil {
		opts = &GenerationOptions{}
	}
	o := capi.NewPipe_generation_options()
	if o.Swigcptr() == 0 {
		return nil, errorf(op, StatusOutOfMemory, "cannot allocate generation options")
	}
	defer capi.DeletePipe_generation_options(o)
	if opts.MaxNewTokens != 0 {
		o.SetMax_new_tokens(int64(opts.MaxNewTokens))
	}
	o.SetTemperature(opts.Temperature)
	o.SetTop_k(int64(opts.TopK))
	if opts.TopP != 0 {
		o.SetTop_p(opts.TopP)
	}
	o.SetSeed(opts.Seed)
	if o.Set_stop_id_list(opts.StopIDs) != 0 {
		return nil, errorf(op, StatusOutOfMemory, "cannot allocate %d stop ids", len(opts.StopIDs))
	}
	timeoutMS, ctxDeadline, err := generationTimeout(op, ctx, opts.Timeout)
	if err != nil {
		return nil, err
	}
	o.SetTimeout_ms(timeoutMS)
	if opts.TopLogprobs < 0 || opts.TopLogprobs > MaxTopLogprobs {
		return nil, errorf(op, StatusInvalidArgument, "TopLogprobs is %d; give 0..%d", opts.TopLogprobs,
			MaxTopLogprobs)
	}
	if opts.TopLogprobs > 0 && !opts.Logprobs && !opts.PromptLogprobs {
		return nil, errorf(op, StatusInvalidArgument,
			"TopLogprobs is %d but Logprobs and PromptLogprobs are false; set one of them as well", opts.TopLogprobs)
	}
	if opts.Logprobs {
		o.SetLogprobs(1)
	}
	if opts.PromptLogprobs {
		o.SetPrompt_logprobs(1)
	}
	if opts.Logprobs || opts.PromptLogprobs {
		o.SetTop_logprobs(opts.TopLogprobs)
	}
	ptr, err := g.acquire(op)
	if err != nil {
		return nil, err
	}
	var gptr capi.SwigcptrPipe_generation
	err = call("pipe_generator_submit", func() int { return capi.Pipe_generator_submit(ptr, prompt, o, &gptr) })
	g.mu.RUnlock()
	if err != nil {
		return nil, err
	}
	return startGeneration(ctx, gptr, ctxDeadline, opts, len(prompt))
}

// generationTimeout is the sequence's timeout_ms: the earlier of timeout and ctx's deadline, in
// whole milliseconds rounded up (a sequence never gets less time than it was given), 0 for none;
// ctxDeadline says whether ctx's deadline is the one.
func generationTimeout(op string, ctx context.Context, timeout time.Duration) (int64, bool, error) {
	if timeout < 0 {
		return 0, false, errorf(op, StatusInvalidArgument,
			"Timeout is %v; give a positive duration, or 0 for none", timeout)
	}
	limit, ctxDeadline := timeout, false
	if deadline, ok := ctx.Deadline(); ok {
		left := time.Until(deadline)
		if left <= 0 {
			return 0, false, contextError(op, context.DeadlineExceeded, "")
		}
		if limit == 0 || left <= limit {
			limit, ctxDeadline = left, true
		}
	}
	return int64((limit + time.Millisecond - 1) / time.Millisecond), ctxDeadline, nil
}

func startGeneration(ctx context.Context, ptr capi.SwigcptrPipe_generation, ctxDeadline bool,
	opts *GenerationOptions, promptLen int) (*Generation, error) {
	c := &generationCore{
		logprobs:       opts.Logprobs,
		topLogprobs:    opts.TopLogprobs,
		promptLogprobs: opts.PromptLogprobs,
		promptLen:      promptLen,
		ptr:            ptr,
		ctx:            ctx,
		ctxDeadline:    ctxDeadline,
		notify:         make(chan struct{}, 1),
		cancelled:      make(chan struct{}),
		tokens:         make(chan int64, 16),
		ended:          make(chan struct{}),
	}
	// The callback only wakes the goroutine: it takes no lock and never blocks, since libpipe
	// calls it on its generator thread (and pipe_generation_destroy waits for it to return).
	c.handle = capi.RegisterEvents(func(uint64, bool) {
		select {
		case c.notify <- struct{}{}:
		default: // a wake-up is pending already; the goroutine reads everything there is
		}
	})
	err := call("pipe_generation_on_event", func() int { return capi.Pipego_generation_on_event(ptr, c.handle) })
	if err != nil {
		capi.ForgetEvents(c.handle)
		capi.Pipe_generation_destroy(ptr)
		return nil, err
	}
	go c.run()
	return &Generation{core: c}, nil
}

// run hands the tokens over until libpipe reports the end, then frees the C generation and
// closes the channel. After a cancellation (Cancel or ctx) it drops the tokens not handed over
// yet: the consumer may be gone, and waiting for it would keep this goroutine forever.
func (c *generationCore) run() {
	buf := make([]int64, 64)
	var pending []int64
	finished, abandoned, readNow := false, false, true
	dropped := 0
	ctxDone := c.ctx.Done()
	cancelled := c.cancelled
	var readErr error
	for {
		if readNow && !finished {
			// Everything unread now: a wake-up may stand for several announcements.
			for {
				n, fin, err := c.read(buf)
				if err != nil {
					// Misuse of the handle, which the binding never does: end the sequence.
					readErr, finished = err, true
					c.cancelC()
					break
				}
				pending = append(pending, buf[:n]...)
				if fin {
					finished = true
					break
				}
				if n < len(buf) {
					break
				}
			}
			readNow = false
		}
		if abandoned {
			dropped += len(pending)
			pending = pending[:0]
		}
		if finished && len(pending) == 0 {
			break
		}
		var send chan<- int64
		var next int64
		if len(pending) > 0 {
			send, next = c.tokens, pending[0]
		}
		var notify <-chan struct{}
		if !finished {
			notify = c.notify
		}
		select {
		case send <- next:
			pending = pending[1:]
		case <-notify:
			readNow = true
		case <-ctxDone:
			ctxDone = nil
			abandoned = true
			c.cancelC()
		case <-cancelled:
			cancelled = nil
			abandoned = true
		}
	}
	c.finish(readErr, dropped)
}

// read copies the unread tokens into buf without waiting, and keeps their log-probabilities, and
// the prompt's with the first token (or the end), when they were asked for (the C generation,
// which holds them, is destroyed at the end).
func (c *generationCore) read(buf []int64) (int, bool, error) {
	var n int64
	var fin int32
	err := call("pipe_generation_read", func() int { return capi.Pipe_generation_read(c.ptr, buf, &n, &fin) })
	if err != nil {
		return int(n), fin != 0, err
	}
	if c.promptLogprobs && !c.promptRead && (n > 0 || fin != 0) {
		c.readPrompt() // every position is scored before the first token is published
	}
	if !c.logprobs || n == 0 {
		return int(n), fin != 0, nil
	}
	c.lpMu.Lock()
	defer c.lpMu.Unlock()
	for i := 0; i < int(n); i++ {
		t, err := c.logprobsOf("pipe_generation_logprobs", len(c.lps), capi.Pipego_generation_logprobs)
		if err != nil {
			return int(n), fin != 0, err
		}
		c.lps = append(c.lps, t)
	}
	return int(n), fin != 0, nil
}

// readPrompt keeps the prompt's scores: an empty entry for position 0, which nothing precedes,
// then one per position until the first that libpipe refuses (a generation that failed before
// its prompt was scored).
func (c *generationCore) readPrompt() {
	c.lpMu.Lock()
	defer c.lpMu.Unlock()
	c.promptRead = true
	plps := make([]TokenLogprobs, 1, c.promptLen)
	for position := 1; position < c.promptLen; position++ {
		t, err := c.logprobsOf("pipe_generation_prompt_logprobs", position, capi.Pipego_generation_prompt_logprobs)
		if err != nil {
			break
		}
		plps = append(plps, t)
	}
	c.plps = plps
}

// logprobsOf is entry `index` of fn (pipego_generation_logprobs or its prompt form), with up to
// topLogprobs alternatives.
func (c *generationCore) logprobsOf(name string, index int,
	fn func(capi.Pipe_generation, int64, *float32, []int64, []float32, *int64) int) (TokenLogprobs, error) {
	ids := make([]int64, c.topLogprobs)
	lps := make([]float32, c.topLogprobs)
	var lp float32
	var count int64
	err := call(name, func() int { return fn(c.ptr, int64(index), &lp, ids, lps, &count) })
	if err != nil {
		return TokenLogprobs{}, err
	}
	t := TokenLogprobs{Logprob: lp}
	if count > 0 {
		t.Top = make([]TokenLogprob, count)
		for j := range t.Top {
			t.Top[j] = TokenLogprob{ID: ids[j], Logprob: lps[j]}
		}
	}
	return t, nil
}

// finish records how the sequence ended, frees the C generation and closes the channel.
func (c *generationCore) finish(readErr error, dropped int) {
	err := readErr
	if err == nil {
		err = call("pipe_generation_wait", func() int { return capi.Pipe_generation_wait(c.ptr, 0) })
	}
	info, infoErr := c.info()
	c.mu.Lock()
	if infoErr == nil {
		c.final = info
	}
	capi.Pipe_generation_destroy(c.ptr) // its callback has returned, and never runs again
	c.ptr = 0
	c.mu.Unlock()
	capi.ForgetEvents(c.handle) // gone already, unless libpipe had not announced the end
	if err != nil {
		err = explainContext(c.ctx, err, c.ctxDeadline)
	} else if dropped > 0 {
		// It ended well, but the consumer did not get every token: for the consumer it was
		// cancelled.
		if ctxErr := c.ctx.Err(); ctxErr != nil {
			err = contextError("Generation", ctxErr, "")
		} else {
			err = errorf("Generation", StatusCancelled, "cancelled with %d tokens not received", dropped)
		}
	}
	c.err = err
	close(c.ended)
	close(c.tokens)
}

// cancelC cancels the C generation if it is still there.
func (c *generationCore) cancelC() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.ptr == 0 {
		return nil
	}
	return call("pipe_generation_cancel", func() int { return capi.Pipe_generation_cancel(c.ptr) })
}

func (c *generationCore) info() (GenerationInfo, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.ptr == 0 {
		return c.final, nil
	}
	info := capi.NewPipe_generation_info()
	if info.Swigcptr() == 0 {
		return GenerationInfo{}, errorf("Generation.Info", StatusOutOfMemory, "cannot allocate generation info")
	}
	defer capi.DeletePipe_generation_info(info)
	err := call("pipe_generation_get_info", func() int { return capi.Pipe_generation_get_info(c.ptr, info) })
	if err != nil {
		return GenerationInfo{}, err
	}
	return GenerationInfo{
		FinishReason:     FinishReason(info.GetFinish_reason()),
		PromptTokens:     int(info.GetPrompt_tokens()),
		GeneratedTokens:  int(info.GetGenerated_tokens()),
		Queued:           milliseconds(info.GetQueued_ms()),
		TimeToFirstToken: milliseconds(info.GetTime_to_first_token_ms()),
		MeanInterToken:   milliseconds(info.GetMean_inter_token_ms()),
		CachedTokens:     int(info.GetCached_tokens()),
	}, nil
}

// Tokens is the channel of generated token ids, in order. It is closed when the sequence has
// ended (a stop id, MaxNewTokens, MaxLen, cancelled, deadline or error) and every token was
// received, or, after Cancel or the end of the context, as soon as libpipe has stopped the
// sequence (tokens not received by then are dropped). Then Err says how it ended.
func (g *Generation) Tokens() <-chan int64 { return g.core.tokens }

// Err is nil once Tokens is closed after a sequence that ended by a stop id or its length with
// every token received; ErrCancelled (Cancel, the context, Generator.Close, or tokens dropped
// after a cancellation), ErrDeadlineExceeded, or the error of a step the sequence was in
// (ErrExecution naming the stage, ErrCommunication, ...). nil while Tokens is open.
func (g *Generation) Err() error {
	select {
	case <-g.core.ended:
		return g.core.err
	default:
		return nil
	}
}

// Logprobs is the log-probabilities of the tokens so far, in order (GenerationOptions.Logprobs;
// nil without it): entry i is the i-th token of Tokens. Every token received from Tokens has its
// entry (a few more may be there, of tokens read from libpipe but not received yet); once Tokens
// is closed there is one per token the sequence generated. It costs no copy, however long the
// sequence: the slice shares the generation's memory, so read it and do not change it (appending
// to it is safe).
func (g *Generation) Logprobs() []TokenLogprobs {
	c := g.core
	if !c.logprobs {
		return nil
	}
	c.lpMu.Lock()
	defer c.lpMu.Unlock()
	if c.lps == nil {
		return []TokenLogprobs{}
	}
	// Entries are only ever appended past its length, never changed.
	return c.lps[:len(c.lps):len(c.lps)]
}

// PromptLogprobs is the prompt's scores (GenerationOptions.PromptLogprobs; nil without it), indexed
// by prompt position: entry i is prompt token i's log-probability given the tokens before it, and
// the likeliest tokens there. Entry 0 is the zero TokenLogprobs (Logprob 0, no Top): nothing
// precedes the first token, which has no score (OpenAI's echo gives null there). nil until the
// first token was read from libpipe (every position is scored by then: once one token came from
// Tokens, or Tokens is closed, it is there); shorter than the prompt when the generation failed
// before its prompt was scored. Read it and do not change it.
func (g *Generation) PromptLogprobs() []TokenLogprobs {
	c := g.core
	if !c.promptLogprobs {
		return nil
	}
	c.lpMu.Lock()
	defer c.lpMu.Unlock()
	return c.plps[:len(c.plps):len(c.plps)]
}

// Info is the sequence's progress: why it finished, tokens so far, queueing and latency.
func (g *Generation) Info() (GenerationInfo, error) { return g.core.info() }

// Cancel stops the sequence: it ends with ErrCancelled (at once, or when its step in the
// pipeline returns), its slot is freed and Tokens closes without the tokens not received yet. A
// finished sequence is left as it is.
func (g *Generation) Cancel() error {
	c := g.core
	c.cancelOnce.Do(func() { close(c.cancelled) })
	return c.cancelC()
}

// Collect receives every token until Tokens is closed and returns them with Err.
func (g *Generation) Collect() ([]int64, error) {
	var out []int64
	for t := range g.core.tokens {
		out = append(out, t)
	}
	return out, g.core.err
}
