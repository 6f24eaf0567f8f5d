package pipe

import (
	"fmt"
	"os"
	"sync"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// LogLevel is the severity of a libpipe log message (pipe.h's PIPE_LOG_*).
type LogLevel int32

// The log levels of pipe.h, from the least severe.
const (
	LogDebug   LogLevel = LogLevel(capi.PIPE_LOG_DEBUG)
	LogInfo    LogLevel = LogLevel(capi.PIPE_LOG_INFO)
	LogWarning LogLevel = LogLevel(capi.PIPE_LOG_WARNING)
	LogError   LogLevel = LogLevel(capi.PIPE_LOG_ERROR)
)

// String is "debug", "info", "warning", "error", or the number for a level pipe.h does not define.
func (l LogLevel) String() string {
	switch l {
	case LogDebug:
		return "debug"
	case LogInfo:
		return "info"
	case LogWarning:
		return "warning"
	case LogError:
		return "error"
	}
	return fmt.Sprintf("LogLevel(%d)", int32(l))
}

// logMu serialises installing and removing the callback, so that libpipe's function pointer and
// the Go function it reaches are changed together; logSink is the function installed (nil: none).
var (
	logMu   sync.Mutex
	logSink func(level int32, message string)
)

// SetLogCallback sends libpipe's log messages at minLevel and above to f instead of stderr
// (libpipe's default logger prints warnings and errors). The logger is process-wide. f is called
// on libpipe's own threads, possibly several at once, and must not call into libpipe; a panic
// in f is caught and reported on stderr, since it cannot unwind through libpipe.
//
// Among the messages: a driver whose SessionOptions.Store has port 0 logs "store listening on
// HOST:PORT" at LogInfo as soon as its store listens, with the port it got (the address to give
// the workers).
func SetLogCallback(f func(level LogLevel, message string), minLevel LogLevel) error {
	const op = "pipe_set_log_callback"
	if f == nil {
		return errorf(op, StatusInvalidArgument, "the callback is nil; use ResetLogCallback for the default logger")
	}
	logMu.Lock()
	defer logMu.Unlock()
	sink := func(level int32, message string) {
		defer func() {
			if r := recover(); r != nil {
				fmt.Fprintf(os.Stderr, "pipe: the log callback panicked: %v (message: %q)\n", r, message)
			}
		}()
		f(LogLevel(level), message)
	}
	// The sink first: libpipe may call it as soon as the C call below has switched.
	capi.SetLogSink(sink)
	if err := call(op, func() int { return capi.Pipego_set_log_callback(int(minLevel)) }); err != nil {
		capi.SetLogSink(logSink) // libpipe kept its logger, which may be an earlier callback
		return err
	}
	logSink = sink
	return nil
}

// ResetLogCallback restores libpipe's default logger (warnings and errors to stderr).
func ResetLogCallback() error {
	logMu.Lock()
	defer logMu.Unlock()
	err := call("pipe_set_log_callback", func() int { return capi.Pipego_reset_log_callback() })
	if err == nil {
		// Messages on their way to the Go callback when libpipe switched are dropped.
		capi.SetLogSink(nil)
		logSink = nil
	}
	return err
}
