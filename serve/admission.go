package main

// Admission: a prompt goes to libpipe's generator, which gives it a cache slot at once or queues
// it (up to -max-queued sequences; one more is refused with 503). A queued request waits at most
// -queue-timeout for its slot: past that it is cancelled and answered 503 with Retry-After, so
// that a client learns the service is overloaded instead of waiting without end, and a burst
// cannot pile up work that its clients have long given up on.
//
// The response's status is decided here, before anything is written: the handler waits until the
// sequence has its slot (or its first token, or has ended, or the client left). The queue deadline
// only looks at whether the sequence got a slot, so a long prefill after it did is not cut short.
// A request the pipeline fails before then (it broke while the request waited, or is broken) is
// answered 503 with Retry-After (faults.go).

import (
	"context"
	"errors"
	"net/http"
	"time"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// admitted is a sequence that has its slot (or has ended, or whose client left): the handler
// follows it from here.
type admitted struct {
	gen          *pipe.Generation
	backend      *backend  // the generator it runs on
	head         []int64   // tokens received while waiting for admission, not followed yet
	headAt       time.Time // when they came
	began        time.Time // the request's start, for the time to its first token
	promptTokens int
}

// retryAfter is what a 503 tells a client to wait before trying again, in seconds.
const retryAfter = "1"

// admissionPoll is how often a request waiting for its first token asks whether it has its slot.
const admissionPoll = 20 * time.Millisecond

// hasSlot says whether gen has its cache slot (Queued is negative until then) or has ended: then
// the queue deadline no longer applies.
func hasSlot(gen *pipe.Generation) bool {
	info, err := gen.Info()
	return err != nil || info.Queued >= 0 || info.FinishReason != pipe.FinishNone
}

// start submits a prompt to the generator and waits for it to be admitted. When it cannot be, it
// answers the request (503 when the queue is full, the queue deadline passed or the pipeline is
// broken, 400 for what libpipe finds wrong with the prompt, named param, 500 otherwise) and
// returns nil. began is when the request started.
func (s *server) start(ctx context.Context, w http.ResponseWriter, prompt []int64, opts *pipe.GenerationOptions,
	param string, began time.Time) *admitted {
	b := s.pipeline.acquire()
	if b == nil {
		s.unavailable(w)
		return nil
	}
	gen, err := b.gen.Generate(ctx, prompt, opts)
	switch {
	case b.failing(err): // before ErrInvalidArgument, which a closed generator's error also matches
		s.unavailable(w)
		return nil
	case errors.Is(err, pipe.ErrBusy):
		s.rejectedBusy.Add(1)
		w.Header().Set("Retry-After", retryAfter)
		writeError(w, http.StatusServiceUnavailable, "server_busy", "",
			"every cache slot is taken and the queue is full; try again shortly")
		return nil
	case errors.Is(err, pipe.ErrInvalidArgument):
		// What libpipe checks itself: token ids outside the vocabulary, a prompt without room.
		s.refuse(w, bad(param, "%s", message(err)))
		return nil
	case err != nil:
		internalError(w, http.StatusInternalServerError, "the service could not start a generation", err)
		return nil
	}
	a := &admitted{gen: gen, backend: b, began: began, promptTokens: len(prompt)}
	// broke says whether the pipeline failed this request before its response began: then it
	// gets 503, to be sent again.
	broke := func() bool {
		if !b.failing(gen.Err()) && b.unhealthy() == nil {
			return false
		}
		gen.Cancel()
		s.finished[pipe.FinishError].Add(1)
		s.unavailable(w)
		return true
	}
	var expired <-chan time.Time
	if s.queueTimeout > 0 {
		timer := time.NewTimer(s.queueTimeout)
		defer timer.Stop()
		expired = timer.C
	}
	// libpipe tells no event for a slot given, so it is looked for now and then: a sequence
	// whose prefill takes long (or is held) has its response begun once it has its slot.
	poll := time.NewTicker(admissionPoll)
	defer poll.Stop()
	for {
		select {
		case id, open := <-gen.Tokens():
			if open {
				a.head, a.headAt = append(a.head, id), time.Now()
			} else if broke() {
				return nil
			}
			return a // a closed channel stays closed: follow sees the end
		case <-ctx.Done():
			return a // follow cancels the sequence and counts the client as gone
		case <-poll.C:
			if hasSlot(gen) {
				if broke() {
					return nil
				}
				return a
			}
		case <-expired:
			if hasSlot(gen) {
				return a
			}
			gen.Cancel()
			s.queueTimeouts.Add(1)
			s.finished[pipe.FinishCancelled].Add(1)
			w.Header().Set("Retry-After", retryAfter)
			writeError(w, http.StatusServiceUnavailable, "server_busy", "",
				"no cache slot came free within %v; try again shortly", s.queueTimeout)
			return nil
		}
	}
}

// message is libpipe's message for a client: what was wrong and what to do, without the Go
// binding's decoration (the C function and the status name). Only for errors the client caused.
func message(err error) string {
	var pe *pipe.Error
	if errors.As(err, &pe) && pe.Message != "" {
		return pe.Message
	}
	return err.Error()
}
