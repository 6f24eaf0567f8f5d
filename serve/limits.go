package main

// What bounds one client's hold on the service, so that it is safe to expose: every connection
// and every request must end, whatever the client does or fails to do.
//
//   - -read-header-timeout: the request's headers must arrive within it (a client trickling
//     them, "slowloris", is cut off);
//   - -read-timeout: the body must arrive within it, counted from the headers. It is set per
//     request and lifted once the body is in, not as http.Server.ReadTimeout: that one stays on
//     the connection while the handler streams, and the server's watch for a client that leaves
//     would then end every stream longer than it;
//   - -write-timeout: each write (an event of a stream, a whole response) must be taken by the
//     client within it; a client that stops reading is cut off and its sequence cancelled. Per
//     write, not http.Server.WriteTimeout, for the same reason: a stream may last minutes;
//   - -idle-timeout: a kept-alive connection without a request is closed after it;
//   - -max-conns: connections beyond it wait in the kernel's backlog until one closes;
//   - maxBody: a larger body is refused with 413 without being read further.
//
// The queue deadline is admission.go's; the limits on stop strings are stop.go's.

import (
	"errors"
	"net"
	"net/http"
	"os"
	"time"

	"golang.org/x/net/netutil"
)

// maxBody bounds a request's body: a prompt longer than any model's context fits easily.
const maxBody = 4 << 20

// limits are the timeouts and the connection limit, from the flags; a zero value is no limit.
type limits struct {
	readHeader, read, write, idle time.Duration
	maxConns                      int
}

// listen is a listener on addr that holds at most maxConns connections at once.
func (l limits) listen(addr string) (net.Listener, error) {
	listener, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if l.maxConns > 0 {
		listener = netutil.LimitListener(listener, l.maxConns)
	}
	return listener, nil
}

// httpServer is the HTTP server of handler with the timeouts.
func (l limits) httpServer(handler http.Handler) *http.Server {
	return &http.Server{Handler: l.deadlines(handler), ReadHeaderTimeout: l.readHeader, IdleTimeout: l.idle}
}

// deadlines sets the body's read deadline when a request starts, and a write deadline before
// every write of its response.
func (l limits) deadlines(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		if l.read > 0 {
			rc.SetReadDeadline(time.Now().Add(l.read))
		}
		dw := &deadlineWriter{ResponseWriter: w, rc: rc, timeout: l.write}
		next.ServeHTTP(dw, r)
		dw.arm() // the server flushes what is buffered after the handler returns
	})
}

// bodyRead lifts the read deadline once a handler has the whole body: the server goes on reading
// the connection only to see whether the client leaves, which must not time out.
func bodyRead(w http.ResponseWriter) {
	http.NewResponseController(w).SetReadDeadline(time.Time{})
}

// timedOut says whether err is a deadline of the connection passing.
func timedOut(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// deadlineWriter is a ResponseWriter whose writes must each complete within timeout.
type deadlineWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController // of the ResponseWriter underneath
	timeout time.Duration
}

func (d *deadlineWriter) arm() {
	if d.timeout > 0 {
		d.rc.SetWriteDeadline(time.Now().Add(d.timeout))
	}
}

func (d *deadlineWriter) Write(p []byte) (int, error) {
	d.arm()
	return d.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls.
func (d *deadlineWriter) FlushError() error {
	d.arm()
	return d.rc.Flush()
}

// Unwrap lets http.ResponseController reach the connection's other controls.
func (d *deadlineWriter) Unwrap() http.ResponseWriter { return d.ResponseWriter }
