package capi

// The Go end of pipe_generation_on_event. libpipe calls capi.swig's C function
// pipego_generation_event whenever tokens of a generation arrive and once, last, when it
// finishes, with the user_data the generation was given: a handle from RegisterEvents below (a
// plain number, since C holds it for the generation's whole life and cgo does not let C keep Go
// pointers). pipegoGenerationEvent looks the handle up and runs its function; the last call (the
// finish) drops the entry. ForgetEvents drops it when libpipe refused the callback, or once
// pipe_generation_destroy has returned (after which libpipe never calls again), in case the
// generation was destroyed before its finish was announced. A file with //export may only
// declare things in its preamble: the C side lives in capi.swig.

// #include <stdint.h>
import "C"

import (
	"sync"
	"sync/atomic"
)

// eventFuncs maps each handle to its function. The lock is held only to look up or change the
// map, never while calling libpipe or a registered function: pipe_generation_destroy waits for a
// running callback to return, so a callback must never wait for a goroutine inside libpipe.
var eventFuncs struct {
	sync.Mutex
	last uint64
	f    map[uint64]func(available uint64, finished bool)
}

// strayEvents counts calls for handles that were not registered (or whose finish was already
// announced): libpipe breaking its "finish once, and last" promise, which tests check never
// happens.
var strayEvents atomic.Int64

// RegisterEvents keeps f under a new handle (never 0) for Pipego_generation_on_event. libpipe
// calls f on any thread, any number of times with finished false and once, last, with finished
// true: f must return quickly, must not panic, must not block and must not call libpipe.
func RegisterEvents(f func(available uint64, finished bool)) uint64 {
	eventFuncs.Lock()
	defer eventFuncs.Unlock()
	if eventFuncs.f == nil {
		eventFuncs.f = map[uint64]func(uint64, bool){}
	}
	eventFuncs.last++
	eventFuncs.f[eventFuncs.last] = f
	return eventFuncs.last
}

// ForgetEvents drops a handle that libpipe will not call again: its Pipego_generation_on_event
// failed, or its generation was destroyed. Dropping one that is already gone does nothing.
func ForgetEvents(handle uint64) {
	eventFuncs.Lock()
	defer eventFuncs.Unlock()
	delete(eventFuncs.f, handle)
}

// PendingEvents is the number of registered functions whose finish libpipe has not announced
// and that were not forgotten (one per generation the binding still follows); for tests.
func PendingEvents() int {
	eventFuncs.Lock()
	defer eventFuncs.Unlock()
	return len(eventFuncs.f)
}

// StrayEvents is the number of generation events that found no registered function; for tests.
func StrayEvents() int64 { return strayEvents.Load() }

//export pipegoGenerationEvent
func pipegoGenerationEvent(handle C.uint64_t, available C.uint64_t, finished C.int32_t) {
	eventFuncs.Lock()
	f, ok := eventFuncs.f[uint64(handle)]
	if finished != 0 {
		delete(eventFuncs.f, uint64(handle))
	}
	eventFuncs.Unlock()
	if !ok {
		strayEvents.Add(1)
		return
	}
	f(uint64(available), finished != 0)
}
