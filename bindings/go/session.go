package pipe

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// ChunkKind says how one input is cut into micro-batches or how one output is put back together.
type ChunkKind int32

// The chunk kinds of pipe.h.
const (
	// Inputs: rank >= 1 split along 0, others replicated. Outputs: concatenated along 0.
	ChunkDefault ChunkKind = ChunkKind(capi.PIPE_CHUNK_DEFAULT)
	// Input: split along Dim (torch.tensor_split sizes).
	ChunkSplit ChunkKind = ChunkKind(capi.PIPE_CHUNK_SPLIT)
	// Input: every micro-batch gets the whole tensor.
	ChunkReplicate ChunkKind = ChunkKind(capi.PIPE_CHUNK_REPLICATE)
	// Output: concatenate along Dim.
	ChunkConcat ChunkKind = ChunkKind(capi.PIPE_CHUNK_CONCAT)
	// Output: add the micro-batches' results.
	ChunkSum ChunkKind = ChunkKind(capi.PIPE_CHUNK_SUM)
	// Output: every micro-batch must give the same value (else ErrExecution).
	ChunkEqual ChunkKind = ChunkKind(capi.PIPE_CHUNK_EQUAL)
)

// ChunkSpec is the micro-batch spec of one input or output.
type ChunkSpec struct {
	Kind ChunkKind
	Dim  int32 // for ChunkSplit and ChunkConcat; negative counts from the end
}

// Convenience specs.
var (
	Replicate = ChunkSpec{Kind: ChunkReplicate}
	Sum       = ChunkSpec{Kind: ChunkSum}
	Equal     = ChunkSpec{Kind: ChunkEqual}
)

// SplitAlong splits an input along dim.
func SplitAlong(dim int32) ChunkSpec { return ChunkSpec{Kind: ChunkSplit, Dim: dim} }

// ConcatAlong concatenates an output along dim.
func ConcatAlong(dim int32) ChunkSpec { return ChunkSpec{Kind: ChunkConcat, Dim: dim} }

// Microbatching says how many micro-batches a call is cut into when other calls are in flight
// (pipe.h's PIPE_MICROBATCHING_*). Results are the same either way; only the number of
// micro-batches run (StageStats.Microbatches) and their size differ.
type Microbatching int32

const (
	// MicrobatchingAdaptive, the default (the zero value): a call that finds the pipeline empty
	// is cut into SessionOptions.Microbatches; a call that arrives while others are in flight
	// only into as many as bring the pipeline to one micro-batch per stage (at least 1), since
	// the other calls keep the stages busy and finer cuts would only cost efficiency.
	MicrobatchingAdaptive Microbatching = Microbatching(capi.PIPE_MICROBATCHING_ADAPTIVE)
	// MicrobatchingFixed: every call is cut into SessionOptions.Microbatches, e.g. to bound the
	// activation memory of one micro-batch.
	MicrobatchingFixed Microbatching = Microbatching(capi.PIPE_MICROBATCHING_FIXED)
)

// String is "adaptive", "fixed", or the number for a value pipe.h does not define.
func (m Microbatching) String() string {
	switch m {
	case MicrobatchingAdaptive:
		return "adaptive"
	case MicrobatchingFixed:
		return "fixed"
	}
	return fmt.Sprintf("Microbatching(%d)", int32(m))
}

// Transport says how the stages of a session talk (pipe.h's PIPE_TRANSPORT_*).
type Transport int32

const (
	// TransportLocal, the default (the zero value): every stage runs in this process.
	TransportLocal Transport = Transport(capi.PIPE_TRANSPORT_LOCAL)
	// TransportTCP: CPU stages spread over SessionOptions.WorldSize processes, over libpipe's own
	// TCP connections, each authenticated with the session's token.
	TransportTCP Transport = Transport(capi.PIPE_TRANSPORT_TCP)
	// TransportGloo is TransportTCP's name before libpipe 0.12 (Gloo's connections accept any peer,
	// so libpipe no longer uses them).
	TransportGloo = TransportTCP
	// TransportNCCL: GPU stages spread over SessionOptions.WorldSize processes, one GPU each.
	TransportNCCL Transport = Transport(capi.PIPE_TRANSPORT_NCCL)
)

var transportNames = []struct {
	t    Transport
	name string
}{{TransportLocal, "local"}, {TransportTCP, "tcp"}, {TransportNCCL, "nccl"}}

// String is "local", "tcp", "nccl", or the number for a value pipe.h does not define.
func (t Transport) String() string {
	for _, n := range transportNames {
		if n.t == t {
			return n.name
		}
	}
	return fmt.Sprintf("Transport(%d)", int32(t))
}

// ParseTransport is the transport named "local", "tcp" or "nccl" (as the pipe tool's
// --transport and Python's transport= spell them; "gloo" is "tcp"'s name before libpipe 0.12);
// any other name is ErrInvalidArgument.
func ParseTransport(name string) (Transport, error) {
	if name == "gloo" {
		return TransportTCP, nil
	}
	for _, n := range transportNames {
		if n.name == name {
			return n.t, nil
		}
	}
	return 0, errorf("ParseTransport", StatusInvalidArgument,
		"transport must be one of local, tcp, nccl, not %q", name)
}

// commTimeoutMS is d in whole milliseconds (rounded up, so that a positive d never becomes 0,
// which would mean libpipe's default) for a comm_timeout_ms field; 0 stays 0.
func commTimeoutMS(op string, d time.Duration) (int32, error) {
	if d < 0 {
		return 0, errorf(op, StatusInvalidArgument,
			"CommTimeout is %v; give a positive duration, or 0 for libpipe's default (one minute)", d)
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	if ms > math.MaxInt32 {
		return 0, errorf(op, StatusInvalidArgument, "CommTimeout is %v; it can be at most %v", d,
			time.Duration(math.MaxInt32)*time.Millisecond)
	}
	return int32(ms), nil
}

// int32Option is n as a C int32_t field, or ErrInvalidArgument naming the option when it does
// not fit (Go's int is 64 bits, where a large value would otherwise wrap to another number).
func int32Option(op, what string, n int) (int32, error) {
	if n > math.MaxInt32 || n < math.MinInt32 {
		return 0, errorf(op, StatusInvalidArgument, "%s is %d, which does not fit in 32 bits", what, n)
	}
	return int32(n), nil
}

// storeAddress checks what C cannot see: a Go string may hold a NUL byte, which would cut the C
// string short and leave libpipe another address than the one given.
func tokenText(op, token string) (string, error) {
	if strings.IndexByte(token, 0) >= 0 {
		return "", errorf(op, StatusInvalidArgument, "Token contains a NUL byte; give a text token")
	}
	return token, nil
}

func storeAddress(op, store string) (string, error) {
	if strings.IndexByte(store, 0) >= 0 {
		return "", errorf(op, StatusInvalidArgument, "Store %q contains a NUL byte; give \"HOST:PORT\"", store)
	}
	return store, nil
}

// SessionOptions configures a session; the zero value (or nil) is libpipe's default.
type SessionOptions struct {
	// Micro-batches per call (default 1); with MicrobatchingAdaptive, calls that arrive while
	// others are in flight get fewer.
	Microbatches int
	// How calls are cut while others are in flight; the zero value is MicrobatchingAdaptive.
	// Other values than the two constants fail NewSession with ErrInvalidArgument.
	Microbatching Microbatching
	// Intra-op threads per stage worker; 0 shares the cores among the stages.
	ThreadsPerStage int
	// Micro-batches admitted into the pipeline at once over all calls (backpressure); 0 picks
	// max(2 x Microbatches, 4 x stages).
	MaxInflight int
	// Per forward argument, in order; missing ones are ChunkDefault.
	InputSpecs []ChunkSpec
	// Per output, in the order the outputs are named; missing ones concatenate along 0.
	OutputSpecs []ChunkSpec
	// Weights and dtype of every stage; nil keeps the model's own.
	Stage *StageOptions
	// Where each stage runs: one device per stage ("cpu,cuda:0"), one for all ("cuda:0"), or
	// "auto" (the visible GPUs in order, else the CPU); "" puts every stage on the CPU. A device
	// the machine lacks fails NewSession with ErrUnsupported naming the stage. Results always
	// come back in CPU memory.
	Devices string

	// Stages in other processes (see RunWorker). Transport: how the stages talk; the zero
	// value, TransportLocal, runs every stage here. With TransportTCP or TransportNCCL this
	// process is rank 0 (the driver, with the first stages) and WorldSize-1 worker processes,
	// ranks 1 .. WorldSize-1, each run RunWorker (or `pipe worker`) and get contiguous groups
	// of the following stages. NewSession waits for them to join and load their stages.
	Transport Transport
	// Processes in the session, this one included: at least 2 with TCP or NCCL; 0 means 1.
	WorldSize int
	// "HOST:PORT" of the rendezvous store, which this process hosts: it listens on PORT, and
	// HOST is this machine's address as the workers reach it. Required unless the transport is
	// local. Port 0 lets the store pick a free port, which libpipe reports as soon as it
	// listens, before waiting for the workers, in the LogInfo message "store listening on
	// HOST:PORT" (SetLogCallback): the address to give the workers. A malformed address is
	// ErrInvalidArgument, an unusable one ErrCommunication.
	Store string
	// How long joining and loading may take, and a worker may send no heartbeat, before the
	// session breaks and the calls its workers hold fail with ErrCommunication naming the rank.
	// Workers send heartbeats from a thread of their own whatever their stages do, so a stage may
	// take longer than this per micro-batch; only a worker that was killed or stopped, or whose
	// host hangs, stops them (a worker that dies is noticed at once). 0 is libpipe's default, one
	// minute; it is rounded up to whole milliseconds.
	CommTimeout time.Duration
	// The session's secret, the same for every process of it; "" reads the LIBPIPE_TOKEN
	// environment variable. Required with WorldSize > 1 (at least 16 bytes): every connection to
	// the store and between ranks proves both ends hold it without sending it, and a process that
	// cannot is refused while the session goes on. It authenticates; it does not encrypt.
	Token string
}

// Session runs a plan: one worker per stage. All methods are safe for concurrent use; many
// goroutines may Run on one session at once and their micro-batches interleave.
type Session struct {
	mu        sync.RWMutex // read: a call is using ptr; write: Close
	ptr       capi.SwigcptrPipe_session
	cleanup   runtime.Cleanup
	numStages int
}

// NewSession builds every stage on its device (SessionOptions.Devices; the CPU by default) and
// starts the workers.
func (p *Plan) NewSession(opts *SessionOptions) (*Session, error) {
	const op = "Plan.NewSession"
	pptr, err := p.acquire(op)
	if err != nil {
		return nil, err
	}
	defer p.mu.RUnlock()
	so, err := newSessionOptions(op, opts)
	if err != nil {
		return nil, err
	}
	defer so.free()
	var ptr capi.SwigcptrPipe_session
	if err := call("pipe_session_create", func() int { return capi.Pipe_session_create(pptr, so.c, &ptr) }); err != nil {
		return nil, err
	}
	s := &Session{ptr: ptr}
	s.cleanup = runtime.AddCleanup(s, func(h capi.SwigcptrPipe_session) { capi.Pipe_session_destroy(h) }, ptr)
	if err := s.countStages(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// countStages reads the number of stages once: it never changes.
func (s *Session) countStages() error {
	var n int64
	if err := call("pipe_session_num_stages", func() int { return capi.Pipe_session_num_stages(s.ptr, &n) }); err != nil {
		return err
	}
	s.numStages = int(n)
	return nil
}

// sessionOptions is a C pipe_session_options built from a SessionOptions, with what it owns.
type sessionOptions struct {
	c     capi.Pipe_session_options
	stage capi.Pipe_stage_options // nil when the stage options are the model's own
}

func (o sessionOptions) free() {
	if o.stage != nil {
		capi.DeletePipe_stage_options(o.stage)
	}
	capi.DeletePipe_session_options(o.c)
}

// newSessionOptions checks opts (nil: the defaults) and makes libpipe's struct from them, for
// pipe_session_create and pipe_generator_create; free it when the call returned.
func newSessionOptions(op string, opts *SessionOptions) (sessionOptions, error) {
	if opts == nil {
		opts = &SessionOptions{}
	}
	so := capi.NewPipe_session_options()
	if so.Swigcptr() == 0 {
		return sessionOptions{}, errorf(op, StatusOutOfMemory, "cannot allocate session options")
	}
	built := sessionOptions{c: so}
	fail := func(err error) (sessionOptions, error) {
		built.free()
		return sessionOptions{}, err
	}
	if opts.Microbatches != 0 {
		so.SetNum_microbatches(opts.Microbatches)
	}
	so.SetThreads_per_stage(opts.ThreadsPerStage)
	so.SetMax_inflight(opts.MaxInflight)
	// Always set: the zero value is PIPE_MICROBATCHING_ADAPTIVE, the header's default, and
	// anything else is passed on for libpipe to accept or refuse.
	so.SetMicrobatching(int(opts.Microbatching))
	so.Set_devices_list(opts.Devices)
	// Always set: the zero value is PIPE_TRANSPORT_LOCAL, the header's default, and any other
	// value is passed on for libpipe to accept or refuse with its message.
	so.SetTransport(int(opts.Transport))
	worldSize, err := int32Option(op, "WorldSize", opts.WorldSize)
	if err != nil {
		return fail(err)
	}
	so.SetWorld_size(int(worldSize)) // libpipe reads 0 as 1
	store, err := storeAddress(op, opts.Store)
	if err != nil {
		return fail(err)
	}
	so.Set_store_address(store)
	commTimeout, err := commTimeoutMS(op, opts.CommTimeout)
	if err != nil {
		return fail(err)
	}
	so.SetComm_timeout_ms(int(commTimeout))
	token, err := tokenText(op, opts.Token)
	if err != nil {
		return fail(err)
	}
	so.Set_token_text(token)
	if len(opts.InputSpecs) > 0 {
		so.Set_input_specs(specPairs(opts.InputSpecs))
	}
	if len(opts.OutputSpecs) > 0 {
		so.Set_output_specs(specPairs(opts.OutputSpecs))
	}
	stage, err := newStageOptions(op, opts.Stage)
	if err != nil {
		return fail(err)
	}
	if stage != nil {
		built.stage = stage
		so.SetStage_options(stage)
	}
	return built, nil
}

func specPairs(specs []ChunkSpec) []int32 {
	pairs := make([]int32, 0, 2*len(specs))
	for _, s := range specs {
		pairs = append(pairs, int32(s.Kind), s.Dim)
	}
	return pairs
}

// Close stops the workers and frees the session. It waits for Run calls that are blocked in
// libpipe without a cancellable context; calls made through Submit (and Run with a cancellable
// context) that are still in flight fail with ErrCancelled, and their Requests stay usable.
// Close returns once each stage has finished the micro-batch it is running (libpipe does not
// interrupt a stage mid-way). Closing twice is a no-op.
func (s *Session) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr != 0 {
		s.cleanup.Stop()
		capi.Pipe_session_destroy(s.ptr)
		s.ptr = 0
	}
	return nil
}

func (s *Session) acquire(op string) (capi.SwigcptrPipe_session, error) {
	s.mu.RLock()
	if s.ptr == 0 {
		s.mu.RUnlock()
		return 0, closedError(op, "session")
	}
	return s.ptr, nil
}

// NumStages is the number of stages (and worker threads).
func (s *Session) NumStages() int { return s.numStages }

// Check is nil while the session works. Once a transport failure has broken it (a worker process
// died, or sent no heartbeat for SessionOptions.CommTimeout), it is an *Error with
// ErrCommunication and the reason, and every later call fails at once the same way: close the
// session, start its workers again and create a new one. A local session never breaks.
func (s *Session) Check() error {
	ptr, err := s.acquire("Session.Check")
	if err != nil {
		return err
	}
	defer s.mu.RUnlock()
	return call("pipe_session_check", func() int { return capi.Pipe_session_check(ptr) })
}

// contextError is the error for a call that ctx ended: the status libpipe would give
// (ErrDeadlineExceeded or ErrCancelled), wrapping ctx's own error too.
func contextError(op string, ctxErr error, message string) error {
	st := StatusCancelled
	if errors.Is(ctxErr, context.DeadlineExceeded) {
		st = StatusDeadlineExceeded
	}
	if message == "" {
		message = ctxErr.Error()
	}
	return &Error{Op: op, Status: st, Message: message, cause: ctxErr}
}

// Run runs one call through the pipeline and waits for its outputs. inputs are the forward
// arguments in order (Model.InputNames names them); they are read only during the call.
//
// ctx bounds the call: its deadline becomes the call's deadline (ErrDeadlineExceeded, which
// also matches context.DeadlineExceeded) and cancelling it cancels the call (ErrCancelled,
// which also matches context.Canceled). Errors: ErrInput for a wrong input count or inputs
// that do not split, ErrExecution when a stage raised (the message names the stage).
//
// With a context that can end (a request's context, or one with a deadline or a cancel
// function), Run is Submit and Request.Wait: while the call runs, the goroutine waits on a
// channel, not inside libpipe, so a server with many calls in flight does not hold an OS thread
// for each. With a context that can never end (context.Background()), Run is libpipe's blocking
// call, which reads the inputs in place instead of copying them but holds an OS thread until the
// call returns.
func (s *Session) Run(ctx context.Context, inputs ...*Tensor) (TensorList, error) {
	const op = "Session.Run"
	if err := ctx.Err(); err != nil {
		return nil, contextError(op, err, "")
	}
	if ctx.Done() == nil {
		// A context that can never end: the blocking call, which borrows the inputs
		// instead of copying them.
		return s.runBlocking(op, inputs)
	}
	req, err := s.Submit(ctx, inputs...)
	if err != nil {
		return nil, err
	}
	defer req.Close()
	return req.Wait()
}

func (s *Session) runBlocking(op string, inputs []*Tensor) (TensorList, error) {
	var out capi.SwigcptrPipe_tensor_list
	err := s.callWithInputs(op, "pipe_session_run", inputs,
		func(ptr capi.SwigcptrPipe_session, handles []capi.SwigcptrDLManagedTensor) int {
			return capi.Pipe_session_run(ptr, handles, nil, &out)
		})
	if err != nil {
		return nil, err
	}
	return takeList(op, out)
}

// callWithInputs runs one C call of the session on inputs lent to libpipe as DLPack handles,
// holding the session open (against Close) for the duration of the call.
func (s *Session) callWithInputs(op, function string, inputs []*Tensor,
	body func(capi.SwigcptrPipe_session, []capi.SwigcptrDLManagedTensor) int) error {
	c, err := wrapTensors(op, inputs)
	if err != nil {
		return err
	}
	defer c.free()
	ptr, err := s.acquire(op)
	if err != nil {
		return err
	}
	defer s.mu.RUnlock()
	return call(function, func() int { return body(ptr, c.handles) })
}

// Submit starts one call and returns without waiting for it (it may wait for room in the
// pipeline, inside libpipe, when SessionOptions.MaxInflight micro-batches are in it already).
// The inputs are copied by libpipe, so they may be reused as soon as Submit returns. Errors in
// the inputs are reported here, errors while running by Request.Wait. ctx bounds the call as in
// Run for as long as the request is open. Close the request when done with it.
func (s *Session) Submit(ctx context.Context, inputs ...*Tensor) (*Request, error) {
	const op = "Session.Submit"
	if err := ctx.Err(); err != nil {
		return nil, contextError(op, err, "")
	}
	ro := capi.NewPipe_run_options()
	if ro.Swigcptr() == 0 {
		return nil, errorf(op, StatusOutOfMemory, "cannot allocate run options")
	}
	defer capi.DeletePipe_run_options(ro)
	if deadline, ok := ctx.Deadline(); ok {
		// libpipe enforces the deadline itself too (also while waiting for room in the
		// pipeline). Round up: a call must never get less time than the context gives.
		left := time.Until(deadline)
		if left <= 0 {
			return nil, contextError(op, context.DeadlineExceeded, "")
		}
		ms := (left + time.Millisecond - 1) / time.Millisecond
		ro.SetTimeout_ms(int64(ms))
	}
	var rptr capi.SwigcptrPipe_request
	err := s.callWithInputs(op, "pipe_session_submit", inputs,
		func(ptr capi.SwigcptrPipe_session, handles []capi.SwigcptrDLManagedTensor) int {
			return capi.Pipe_session_submit(ptr, handles, ro, &rptr)
		})
	if err != nil {
		return nil, err
	}
	return newRequest(ctx, rptr)
}

// StageStats is what one stage worker has done since the session was created.
type StageStats struct {
	Microbatches uint64        // micro-batches run (failed ones included)
	Failures     uint64        // micro-batches whose stage code raised
	Busy         time.Duration // time spent running the stage
	Idle         time.Duration // time spent waiting for work
	QueueDepth   uint64        // micro-batches waiting for this stage now
}

// StageStats is the statistics of stage i.
func (s *Session) StageStats(i int) (StageStats, error) {
	const op = "Session.StageStats"
	ptr, err := s.acquire(op)
	if err != nil {
		return StageStats{}, err
	}
	defer s.mu.RUnlock()
	st := capi.NewPipe_stage_stats()
	if st.Swigcptr() == 0 {
		return StageStats{}, errorf(op, StatusOutOfMemory, "cannot allocate stage stats")
	}
	defer capi.DeletePipe_stage_stats(st)
	if err := call("pipe_session_stage_stats", func() int { return capi.Pipe_session_stage_stats(ptr, int64(i), st) }); err != nil {
		return StageStats{}, err
	}
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	return StageStats{
		Microbatches: st.GetMicrobatches(),
		Failures:     st.GetFailures(),
		Busy:         ms(st.GetBusy_ms()),
		Idle:         ms(st.GetIdle_ms()),
		QueueDepth:   st.GetQueue_depth(),
	}, nil
}

// Stats is the statistics of every stage, in order.
func (s *Session) Stats() ([]StageStats, error) {
	out := make([]StageStats, s.numStages)
	for i := range out {
		st, err := s.StageStats(i)
		if err != nil {
			return nil, err
		}
		out[i] = st
	}
	return out, nil
}

// TraceStart records a timeline of every micro-batch each stage runs from now on.
func (s *Session) TraceStart() error {
	ptr, err := s.acquire("Session.TraceStart")
	if err != nil {
		return err
	}
	defer s.mu.RUnlock()
	return call("pipe_session_trace_start", func() int { return capi.Pipe_session_trace_start(ptr) })
}

// TraceStartWithOperators records as TraceStart does, and each stage's slice also carries, in its
// args as "operators_us", the microseconds the stage spent in each operator (a linear layer's
// keyed with its weight's shape, "aten::linear [out x in]"). On a generator's session the
// engine's steps also get a track of their own, "engine". Needs libpipe 0.9.
func (s *Session) TraceStartWithOperators() error {
	ptr, err := s.acquire("Session.TraceStartWithOperators")
	if err != nil {
		return err
	}
	defer s.mu.RUnlock()
	return call("pipe_session_trace_start_with_operators",
		func() int { return capi.Pipe_session_trace_start_with_operators(ptr) })
}

// TraceStop stops recording and writes the timeline to path as Chrome trace JSON (open it in
// Perfetto); path "" discards it.
func (s *Session) TraceStop(path string) error {
	ptr, err := s.acquire("Session.TraceStop")
	if err != nil {
		return err
	}
	defer s.mu.RUnlock()
	if path == "" {
		return call("pipe_session_trace_stop", func() int { return capi.Pipego_trace_discard(ptr) })
	}
	return call("pipe_session_trace_stop", func() int { return capi.Pipe_session_trace_stop(ptr, path) })
}

// ---- Requests ---------------------------------------------------------------------------------

// Request is a call started by Session.Submit. Its completion arrives without a waiting thread:
// libpipe tells the binding when the call finishes (pipe_request_on_done), which closes Done, and
// Wait only blocks on that channel. Many goroutines may wait for many requests without holding an
// OS thread each.
type Request struct {
	core    *requestCore
	cleanup runtime.Cleanup
}

// requestCore is what the context callback, the completion callback and the cleanup share; it
// never points back to the Request, so an abandoned Request can still be collected and freed.
type requestCore struct {
	mu     sync.RWMutex // read: wait or cancel on ptr (pipe.h allows them together); write: destroy
	waitMu sync.Mutex   // pipe_request_wait is exclusive per request
	ptr    capi.SwigcptrPipe_request
	ctx    context.Context
	stop   func() bool   // unregisters the context callback
	done   chan struct{} // closed by libpipe's completion callback, once
}

func newRequest(ctx context.Context, ptr capi.SwigcptrPipe_request) (*Request, error) {
	core := &requestCore{ptr: ptr, ctx: ctx, done: make(chan struct{})}
	// libpipe calls this exactly once: when the call finishes, at the latest inside
	// pipe_request_destroy, possibly on one of its own threads. It takes no lock of the request,
	// since destroy holds the write lock while pipe_request_destroy waits for it to return.
	handle := capi.RegisterDone(func(int32) { close(core.done) })
	err := call("pipe_request_on_done", func() int { return capi.Pipego_request_on_done(ptr, handle) })
	if err != nil {
		// Refused, so never called: nothing else will release the handle or the request.
		capi.ForgetDone(handle)
		capi.Pipe_request_destroy(ptr)
		return nil, err
	}
	// Cancelling the context cancels the call. The callback runs on its own goroutine, at any
	// time until stop: it takes the read lock, so it never races with destroy.
	core.stop = context.AfterFunc(ctx, func() { core.cancel() })
	r := &Request{core: core}
	r.cleanup = runtime.AddCleanup(r, func(c *requestCore) { c.destroy() }, core)
	return r, nil
}

func (c *requestCore) cancel() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.ptr == 0 {
		return nil
	}
	return call("pipe_request_cancel", func() int { return capi.Pipe_request_cancel(c.ptr) })
}

func (c *requestCore) destroy() {
	c.stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ptr != 0 {
		// Cancels a call still running; the completion callback has returned when this does.
		capi.Pipe_request_destroy(c.ptr)
		c.ptr = 0
	}
}

// Done is closed when the call has finished: it succeeded or failed, was cancelled (Cancel, the
// context, Close, the session's Close) or passed its deadline. Wait then returns at once. Use it
// to wait for several requests, or for a request and something else, in one select.
func (r *Request) Done() <-chan struct{} { return r.core.done }

// FD is a file descriptor that becomes readable when the call has finished and stays readable
// (level-triggered), for callers with a poller of their own (epoll, another language's event
// loop); Go code waits on Done instead. It belongs to the request: do not read, write or close
// it, and do not use it after Close, which closes it. ErrIO if the process has no descriptor left.
func (r *Request) FD() (int, error) {
	const op = "Request.FD"
	c := r.core
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.ptr == 0 {
		return -1, closedError(op, "request")
	}
	var fd int32
	if err := call("pipe_request_fd", func() int { return capi.Pipe_request_fd(c.ptr, &fd) }); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// Wait blocks until the call is done and returns its outputs. A finished call may be waited for
// again and gives the same result. Errors as for Session.Run.
func (r *Request) Wait() (TensorList, error) { return r.wait("Request.Wait", -1) }

// WaitTimeout is Wait for at most d; ErrTimeout if the call is still running then (wait again,
// cancel or close). d == 0 only checks.
func (r *Request) WaitTimeout(d time.Duration) (TensorList, error) {
	return r.wait("Request.WaitTimeout", d)
}

// wait blocks on Done for at most d (d < 0: as long as it takes), then collects the call from
// libpipe without waiting there: if it has not finished, that gives libpipe's ErrTimeout.
func (r *Request) wait(op string, d time.Duration) (TensorList, error) {
	c := r.core
	switch {
	case d < 0:
		<-c.done // closed by Close too, at the latest
	case d > 0:
		timer := time.NewTimer(d)
		select {
		case <-c.done:
		case <-timer.C:
		}
		timer.Stop()
	}
	c.waitMu.Lock()
	defer c.waitMu.Unlock()
	c.mu.RLock()
	if c.ptr == 0 {
		c.mu.RUnlock()
		return nil, closedError(op, "request")
	}
	var out capi.SwigcptrPipe_tensor_list
	err := call("pipe_request_wait", func() int { return capi.Pipe_request_wait(c.ptr, 0, &out) })
	c.mu.RUnlock()
	if err != nil {
		return nil, c.explain(err)
	}
	return takeList(op, out)
}

// explain adds the context's error to a cancellation or deadline that the context caused, and
// reports a cancellation caused by the context's deadline as ErrDeadlineExceeded (whichever of
// Go's timer and libpipe's own deadline fired first).
func (c *requestCore) explain(err error) error { return explainContext(c.ctx, err, true) }

// explainContext is err, a libpipe status of a call or generation made under ctx, with ctx's
// error added when ctx ended it (see requestCore.explain). ctxDeadline says whether libpipe's
// deadline was ctx's: otherwise a libpipe deadline is not ctx's doing unless ctx has ended.
func explainContext(ctx context.Context, err error, ctxDeadline bool) error {
	var pe *Error
	if !errors.As(err, &pe) {
		return err
	}
	ctxErr := ctx.Err()
	if _, hasDeadline := ctx.Deadline(); ctxErr == nil && ctxDeadline && hasDeadline &&
		pe.Status == StatusDeadlineExceeded {
		// libpipe's deadline is the context's (rounded up), so it has passed; Go's timer may
		// just not have marked the context yet.
		ctxErr = context.DeadlineExceeded
	}
	if ctxErr == nil {
		return err
	}
	if pe.Status != StatusCancelled && pe.Status != StatusDeadlineExceeded {
		return err
	}
	e := *pe
	e.cause = ctxErr
	if errors.Is(ctxErr, context.DeadlineExceeded) {
		e.Status = StatusDeadlineExceeded
	}
	return &e
}

// Cancel asks the call to stop: micro-batches not yet run are dropped and Wait returns
// ErrCancelled. A call that already finished keeps its result.
func (r *Request) Cancel() error {
	c := r.core
	c.mu.RLock()
	closed := c.ptr == 0
	c.mu.RUnlock()
	if closed {
		return closedError("Request.Cancel", "request")
	}
	return c.cancel()
}

// Close frees the request; a call still running is cancelled. Closing twice is a no-op.
func (r *Request) Close() error {
	r.cleanup.Stop()
	r.core.destroy()
	return nil
}
