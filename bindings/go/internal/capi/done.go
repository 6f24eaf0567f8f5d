package capi

// The Go end of pipe_request_on_done. libpipe calls capi.swig's C function pipego_request_done
// once per request, when its call finishes, with the user_data the request was given; that is a
// handle from RegisterDone below, a plain number, since C holds it for as long as the call runs and
// cgo does not let C keep Go pointers. pipegoRequestDone looks the handle up, drops it and runs its
// function: the entry is released by the one call libpipe promises, or by ForgetDone when libpipe
// refused the callback and will never call it. A file with //export may only declare things in its
// preamble: the C side lives in capi.swig.

// #include <stdint.h>
import "C"

import (
	"sync"
	"sync/atomic"
)

// doneFuncs maps each handle to its function until libpipe has called it. The lock is held only
// to look up or change the map, never while calling libpipe or a registered function, so that a
// callback never waits for a goroutine that is itself inside libpipe (pipe_request_destroy waits
// for a running callback to return).
var doneFuncs struct {
	sync.Mutex
	last uint64
	f    map[uint64]func(status int32)
}

// strayDone counts calls for handles that were not registered (or were already called): libpipe
// breaking its exactly-once promise, which tests check never happens.
var strayDone atomic.Int64

// RegisterDone keeps f under a new handle (never 0) for Pipego_request_on_done. libpipe calls f
// once, with the call's status, on any thread: f must return quickly, must not panic and must not
// call libpipe.
func RegisterDone(f func(status int32)) uint64 {
	doneFuncs.Lock()
	defer doneFuncs.Unlock()
	if doneFuncs.f == nil {
		doneFuncs.f = map[uint64]func(int32){}
	}
	doneFuncs.last++
	doneFuncs.f[doneFuncs.last] = f
	return doneFuncs.last
}

// ForgetDone drops a handle whose Pipego_request_on_done failed: libpipe will never call it.
func ForgetDone(handle uint64) {
	doneFuncs.Lock()
	defer doneFuncs.Unlock()
	delete(doneFuncs.f, handle)
}

// PendingDone is the number of registered functions that libpipe has not called yet (one per
// open request whose call has not finished); for tests.
func PendingDone() int {
	doneFuncs.Lock()
	defer doneFuncs.Unlock()
	return len(doneFuncs.f)
}

// StrayDone is the number of completion callbacks that found no registered function; for tests.
func StrayDone() int64 { return strayDone.Load() }

//export pipegoRequestDone
func pipegoRequestDone(handle C.uint64_t, status C.int32_t) {
	doneFuncs.Lock()
	f, ok := doneFuncs.f[uint64(handle)]
	delete(doneFuncs.f, uint64(handle))
	doneFuncs.Unlock()
	if !ok {
		strayDone.Add(1)
		return
	}
	f(int32(status))
}
