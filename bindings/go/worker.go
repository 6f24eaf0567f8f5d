package pipe

import (
	"time"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// WorkerOptions says which session a worker process joins (pipe.h's pipe_worker_options).
type WorkerOptions struct {
	// This worker's rank, 1 .. WorldSize-1 (rank 0 is the driver, which creates the session).
	// Rank and WorldSize both 0: a launcher's environment (torchrun, srun) decides, its rank i
	// serving as rank i + 1 of a driver outside the launch.
	Rank int
	// Processes in the session, the driver included; must match the driver's WorldSize.
	WorldSize int
	// "HOST:PORT" of the driver's rendezvous store: the port it listens on. A driver given port
	// 0 reports the port its store got ("store listening on HOST:PORT", see
	// SessionOptions.Store); port 0 is ErrInvalidArgument here. "": the LIBPIPE_STORE
	// environment variable.
	Store string
	// The session's secret, the driver's own ("": the LIBPIPE_TOKEN environment variable).
	Token string
	// How long to keep trying to reach the store, and to wait for the driver's stages, before
	// failing with ErrCommunication; 0 is libpipe's default, one minute. Once serving, a worker
	// waits for work as long as its driver is alive.
	CommTimeout time.Duration
	// Intra-op threads per stage; 0 takes the driver's setting.
	ThreadsPerStage int
}

// RunWorker serves as worker opts.Rank of the session whose driver (rank 0) creates it with
// SessionOptions{Transport: TransportTCP or TransportNCCL, WorldSize, Store}: it joins through
// the driver's store, receives this rank's stages and runs them until the driver closes that
// session, then returns nil. It serves one session; call it again for the next.
//
// Errors: ErrCommunication when the store cannot be reached within CommTimeout (the message
// names the address), the rank is taken, the driver's libpipe version differs, or the driver goes
// away (also when its session broke); ErrInvalidArgument for a rank, world size or address that
// is out of range or malformed. Errors in this worker's stages are reported to the driver's
// calls, not here.
//
// Cancellation: there is none. RunWorker blocks its goroutine (and an OS thread) in libpipe until
// one of the above happens, and libpipe has no call that stops a worker from outside: hence no
// context parameter, which could only pretend to. To stop a worker early, close the driver's
// session (RunWorker then returns nil) or end the worker's process.
func RunWorker(opts *WorkerOptions) error {
	const op = "RunWorker"
	if opts == nil {
		opts = &WorkerOptions{} // a launcher's rank, LIBPIPE_STORE and LIBPIPE_TOKEN
	}
	wo := capi.NewPipe_worker_options()
	if wo.Swigcptr() == 0 {
		return errorf(op, StatusOutOfMemory, "cannot allocate worker options")
	}
	defer capi.DeletePipe_worker_options(wo)
	rank, err := int32Option(op, "Rank", opts.Rank)
	if err != nil {
		return err
	}
	worldSize, err := int32Option(op, "WorldSize", opts.WorldSize)
	if err != nil {
		return err
	}
	threads, err := int32Option(op, "ThreadsPerStage", opts.ThreadsPerStage)
	if err != nil {
		return err
	}
	store, err := storeAddress(op, opts.Store)
	if err != nil {
		return err
	}
	commTimeout, err := commTimeoutMS(op, opts.CommTimeout)
	if err != nil {
		return err
	}
	wo.SetRank(int(rank))
	wo.SetWorld_size(int(worldSize))
	wo.Set_store_address(store)
	token, err := tokenText(op, opts.Token)
	if err != nil {
		return err
	}
	wo.Set_token_text(token)
	wo.SetComm_timeout_ms(int(commTimeout))
	wo.SetThreads_per_stage(int(threads))
	return call("pipe_worker_run", func() int { return capi.Pipe_worker_run(wo) })
}
