package main

// Requests sent in the background and read to their end, for the tests that run many at once or
// must watch one while something else happens (load_test.go, faults_test.go): unlike readStream,
// which fails the test at the first surprise, a call records what it saw (an error event
// included) and never touches *testing.T off the test's goroutine.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// outcome is what a client got: the status, and either the body or a stream's events.
type outcome struct {
	status     int
	retryAfter string
	err        error  // the request failed, or the stream broke OpenAI's shape
	body       string // a response that is not an event stream
	// An event stream:
	role    bool     // a chat delta with the assistant's role came
	pieces  []string // the text of each event that carried some
	finish  string   // the finish_reason of the event that had one
	usage   *usageCounts
	failure *apiError // the error event
	done    bool      // data: [DONE]
}

// call is a request in flight.
type call struct {
	begun  chan struct{} // closed once the response's headers came (or the request failed)
	pieces atomic.Int64  // text events received so far
	ended  chan struct{} // closed once out is final
	out    outcome
}

// ask sends body to path (with the API key when key is not "") and reads the response in the
// background: an event stream event by event, anything else whole. It ends with ctx.
func ask(ctx context.Context, s *service, key, path string, body map[string]any) *call {
	c := &call{begun: make(chan struct{}), ended: make(chan struct{})}
	go func() {
		defer close(c.ended)
		began := false
		defer func() {
			if !began {
				close(c.begun)
			}
		}()
		data, err := json.Marshal(body)
		if err != nil {
			c.out.err = err
			return
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+path, bytes.NewReader(data))
		if err != nil {
			c.out.err = err
			return
		}
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			c.out.err = err
			return
		}
		defer resp.Body.Close()
		c.out.status, c.out.retryAfter = resp.StatusCode, resp.Header.Get("Retry-After")
		began = true
		close(c.begun)
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			all, err := io.ReadAll(resp.Body)
			c.out.body, c.out.err = string(all), err
			return
		}
		c.out.err = c.readEvents(resp.Body)
	}()
	return c
}

// readEvents reads an event stream to its end into c.out.
func (c *call) readEvents(body io.Reader) error {
	o := &c.out
	r := bufio.NewReaderSize(body, 1<<18) // the limits service's events carry a 120 KB model name
	for {
		line, err := r.ReadString('\n')
		if errors.Is(err, io.EOF) && line == "" {
			return nil
		}
		if err != nil {
			return err
		}
		line = strings.TrimSuffix(line, "\n")
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		switch {
		case !ok:
			return fmt.Errorf("not an event line: %.200q", line)
		case o.done || o.failure != nil:
			return fmt.Errorf("an event after the stream's end: %.200q", line)
		case data == "[DONE]":
			o.done = true
			continue
		}
		var e struct {
			Error   *apiError `json:"error"`
			Choices []struct {
				Text  *string `json:"text"`
				Delta *struct {
					Role    string  `json:"role"`
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *usageCounts `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &e); err != nil {
			return fmt.Errorf("event %.200q: %v", data, err)
		}
		if e.Error != nil {
			o.failure = e.Error
			continue
		}
		if len(e.Choices) == 0 {
			if e.Usage == nil {
				return fmt.Errorf("an event without choices or usage: %.200q", data)
			}
			o.usage = e.Usage
			continue
		}
		if o.finish != "" {
			return fmt.Errorf("a choice after the one with finish_reason %q: %.200q", o.finish, data)
		}
		ch := e.Choices[0]
		text := ""
		switch {
		case ch.Text != nil:
			text = *ch.Text
		case ch.Delta != nil:
			o.role = o.role || ch.Delta.Role == "assistant"
			if ch.Delta.Content != nil {
				text = *ch.Delta.Content
			}
		}
		if ch.FinishReason != nil {
			o.finish = *ch.FinishReason
		} else if text != "" {
			o.pieces = append(o.pieces, text)
			c.pieces.Add(1)
		}
	}
}

// wait is the call's outcome once it has ended.
func (c *call) wait(t *testing.T, what string) outcome {
	t.Helper()
	select {
	case <-c.ended:
		return c.out
	case <-time.After(waitLimit):
		t.Fatalf("%s: no end within %v", what, waitLimit)
		return outcome{}
	}
}

// hasBegun says whether the response's headers came.
func (c *call) hasBegun() bool {
	select {
	case <-c.begun:
		return true
	default:
		return false
	}
}

// text is a stream's text.
func (o outcome) text() string { return strings.Join(o.pieces, "") }
