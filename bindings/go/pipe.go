// Package pipe is the Go binding of libpipe: pipelined inference for TorchScript models.
//
// A model is loaded, cut into stages (a [Plan]), and run by a [Session] that gives every stage
// its own worker; each call is cut into micro-batches that stream through the stages, and the
// micro-batches of concurrent calls interleave. By default ([MicrobatchingAdaptive]) a call that
// arrives while others are in flight is cut more coarsely, since the others already keep the
// stages busy; [MicrobatchingFixed] cuts every call into [SessionOptions].Microbatches:
//
//	model, err := pipe.LoadModel("model.pt")
//	...
//	defer model.Close()
//	plan, err := model.NewPlan(&pipe.PlanOptions{SplitPoints: []string{"blocks.2:begin"}})
//	...
//	defer plan.Close()
//	session, err := plan.NewSession(&pipe.SessionOptions{Microbatches: 4})
//	...
//	defer session.Close()
//	x, err := pipe.NewTensor(data, 32, 256) // data is a []float32
//	outputs, err := session.Run(ctx, x)
//	y := outputs.Get("output").Float32s()
//
// Every function returns an error; libpipe's failures are *[Error] values carrying the status
// code and libpipe's message, and errors.Is matches them against the status sentinels
// ([ErrNotFound], [ErrInput], [ErrCancelled], [ErrDeadlineExceeded], ...). [Session.Run] and
// [Session.Submit] honour a context: its deadline becomes the call's deadline and cancelling it
// cancels the call. Waiting for a call holds no OS thread: libpipe reports that a call finished
// through a callback that closes [Request.Done], and [Request.Wait] (as [Session.Run] with a
// context that can end) blocks on that channel, not inside libpipe.
//
// A [Generator] generates tokens from a decoder (a language model that follows pipe.h's decoder
// contract): [Generator.Generate] returns a [Generation] whose tokens arrive on a channel as they
// are sampled, with the sequences of concurrent calls batched into shared pipeline steps.
//
// Handles ([Model], [Plan], [Session], [Request], [Generator]) hold C resources: Close them. A cleanup
// frees a handle that becomes unreachable without being closed, as a safety net only.
// Every method is safe for concurrent use; Close waits for calls in progress on the handle.
//
// Tensors are Go values ([Tensor]: a typed slice and a shape). Inputs are handed to libpipe
// without a copy (the slice is pinned for the duration of the call); outputs are copied into
// new Go slices and libpipe's buffers are released at once.
//
// The low level is SWIG's wrapper of pipe.h (internal/capi); libpipe itself is found with
// pkg-config (`pkg-config libpipe`), so set PKG_CONFIG_PATH to PREFIX/lib/pkgconfig when it is
// installed outside the default paths, and make libpipe.so findable at run time
// (LD_LIBRARY_PATH, or an rpath through CGO_LDFLAGS).
package pipe

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// Version is the version of the loaded libpipe ("MAJOR.MINOR.PATCH").
func Version() string { return capi.Pipe_version() }

// Status is a libpipe status code. Every non-OK Status is also an error, so that it serves as
// a sentinel for errors.Is: errors.Is(err, pipe.StatusCancelled), or the same through
// pipe.ErrCancelled.
type Status int32

// The Status constants (StatusOK, StatusInvalidArgument, ...), their Err sentinels and
// Status.Description are generated from pipe.h into status_gen.go, by the one generator that also
// writes the Python and Rust tables. Unlike those two bindings' tables, which their builds
// generate, this file is committed: Go has no build step of its own that could run a generator
// (`go build` and `go get` compile a module's files as they are, and module users never run our
// scripts), so it must be in the sources. Its staleness is a test failure instead:
// bindings/go/run-tests.sh (ctest bindings_go) and tests/conformance/check_binding_parity.py fail
// when it is not what the installed pipe.h gives. `go generate` (generate.sh) rewrites it from
// the pipe.h that pkg-config finds.
//
//go:generate ./generate.sh

// ErrClosed is matched (errors.Is) by the error of any method called on a closed handle.
var ErrClosed = errors.New("pipe: use of a closed handle")

// String is libpipe's name for the code: "PIPE_OK", "PIPE_ERR_INPUT", ...
func (s Status) String() string { return capi.Pipe_status_string(int(s)) }

// Error makes a Status usable as a sentinel error.
func (s Status) Error() string { return "pipe: " + s.String() }

// Error is a failure reported by libpipe (or by this binding, with the same status codes).
type Error struct {
	Op      string // what failed: the C function ("pipe_model_load") or the Go method
	Status  Status // never StatusOK
	Message string // libpipe's message: what was wrong and what to do
	cause   error  // a context error when the context ended the call, or ErrClosed
}

func (e *Error) Error() string {
	msg := e.Message
	if msg == "" {
		msg = "failed"
	}
	return fmt.Sprintf("pipe: %s: %s (%s)", e.Op, msg, e.Status.String())
}

// Unwrap gives the Status (so errors.Is(err, pipe.ErrInput) works) and, when a context ended
// the call, the context's error (so errors.Is(err, context.Canceled) works as well).
func (e *Error) Unwrap() []error {
	if e.cause != nil {
		return []error{e.Status, e.cause}
	}
	return []error{e.Status}
}

// call runs one fallible libpipe function and turns its status into an error. The goroutine is
// locked to its OS thread from the call until pipe_last_error has been read: the message is per
// thread, and between two cgo calls the scheduler may move a goroutine to another thread.
func call(op string, f func() int) error {
	runtime.LockOSThread()
	st := f()
	var msg string
	if st != capi.PIPE_OK {
		msg = capi.Pipe_last_error()
	}
	runtime.UnlockOSThread()
	if st == capi.PIPE_OK {
		return nil
	}
	return &Error{Op: op, Status: Status(st), Message: msg}
}

// errorf makes an error of the binding itself, with a libpipe status.
func errorf(op string, st Status, format string, args ...any) error {
	return &Error{Op: op, Status: st, Message: fmt.Sprintf(format, args...)}
}

func closedError(op, what string) error {
	return &Error{Op: op, Status: StatusInvalidArgument, Message: what + " is closed", cause: ErrClosed}
}

// cString copies a libpipe-owned string whose address came back through an output parameter.
func cString(address uintptr) string {
	if address == 0 {
		return ""
	}
	return capi.Pipego_string(address)
}
