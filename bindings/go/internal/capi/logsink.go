package capi

// The Go end of libpipe's log callback. capi.swig's C function pipego_log_to_go is what libpipe
// calls (from any of its threads); it calls pipegoLogSink below, which hands the message to the
// function SetLogSink installed. A C function pointer cannot point at Go code, hence the export.
// A file with //export may only declare things in its preamble: the C side lives in capi.swig.

// #include <stdint.h>
import "C"

import "sync/atomic"

// logSink is read on libpipe's threads while SetLogSink may replace it on another: an atomic
// pointer, so a message goes to the old function or the new one, never to a torn value.
var logSink atomic.Pointer[func(level int32, message string)]

// SetLogSink makes f the receiver of the messages libpipe logs once Pipego_set_log_callback has
// pointed libpipe at this package; nil drops them. f must not panic (a panic cannot unwind
// through libpipe's C++ frames) and must not call libpipe.
func SetLogSink(f func(level int32, message string)) {
	if f == nil {
		logSink.Store(nil)
		return
	}
	logSink.Store(&f)
}

//export pipegoLogSink
func pipegoLogSink(level C.int32_t, message *C.char) {
	if f := logSink.Load(); f != nil {
		// Copied here: the message is valid only during libpipe's call.
		(*f)(int32(level), C.GoString(message))
	}
}
