package main

// Stop strings (OpenAI's `stop`): a completion ends where one of them begins, the stop string
// and what follows it are not sent, and the finish reason is "stop".
//
// The text arrives in pieces, and a stop string may span several of them, so a streamed piece is
// held back while its end could still be the start of a stop string: sent once what follows
// shows it is not one, cut off if it is.

import (
	"encoding/json"
	"strings"
)

// maxStops is how many stop strings a request may give (OpenAI's limit), and maxStopBytes how
// long each may be: every piece of a completion is searched for each of them, and its end
// compared with each of their beginnings, so their sizes bound the work per token.
const (
	maxStops     = 4
	maxStopBytes = 256
)

// parseStop reads `stop`: absent or null (none), a string, or an array of up to maxStops strings,
// none of them empty or over maxStopBytes.
func parseStop(raw json.RawMessage) ([]string, *badRequest) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		if one == "" {
			return nil, bad("stop", "stop is an empty string; give the text that ends a completion")
		}
		if len(one) > maxStopBytes {
			return nil, bad("stop", "stop is %d bytes long; give at most %d", len(one), maxStopBytes)
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, bad("stop", "stop must be a string or an array of up to %d strings", maxStops)
	}
	if len(many) > maxStops {
		return nil, bad("stop", "stop holds %d strings; give at most %d", len(many), maxStops)
	}
	for i, s := range many {
		if s == "" {
			return nil, bad("stop", "stop[%d] is an empty string; give the text that ends a completion", i)
		}
		if len(s) > maxStopBytes {
			return nil, bad("stop", "stop[%d] is %d bytes long; give at most %d", i, len(s), maxStopBytes)
		}
	}
	return many, nil
}

// stopScanner passes a completion's text through, piece by piece, until a stop string appears.
type stopScanner struct {
	stops   []string
	pending string // received, not yet given out: it could be the start of a stop string
	stopped bool
}

// Push takes the next piece of text and returns what may be sent now, and whether a stop string
// has appeared (then the returned text is what came before it, and every later Push returns "").
func (s *stopScanner) Push(piece string) (string, bool) {
	if s.stopped {
		return "", true
	}
	if len(s.stops) == 0 {
		return piece, false
	}
	text := s.pending + piece
	first := -1
	for _, stop := range s.stops {
		if at := strings.Index(text, stop); at >= 0 && (first < 0 || at < first) {
			first = at
		}
	}
	if first >= 0 {
		s.stopped, s.pending = true, ""
		return text[:first], true
	}
	// Hold back the longest end of the text that begins a stop string. Every stop string starts
	// with the first byte of a character, so the text is never cut inside one.
	hold := 0
	for _, stop := range s.stops {
		for n := min(len(stop)-1, len(text)); n > hold; n-- {
			if strings.HasSuffix(text, stop[:n]) {
				hold = n
				break
			}
		}
	}
	s.pending = text[len(text)-hold:]
	return text[:len(text)-hold], false
}

// Flush returns the text held back when the completion ended without a stop string.
func (s *stopScanner) Flush() string {
	out := s.pending
	s.pending = ""
	return out
}
