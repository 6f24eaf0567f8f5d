package main

import (
	"strings"
	"testing"
)

// However a text arrives in pieces, the scanner gives out exactly the text before the first stop
// string (all of it when none appears), and says so when one did.
func TestStopScannerCutsAtTheFirstStopString(t *testing.T) {
	cases := []struct {
		text  string
		stops []string
		want  string
		hit   bool
	}{
		{"Paris. The answer", []string{"."}, "Paris", true},
		{"Paris. The answer", []string{"The", "s."}, "Pari", true},
		{"Paris. The answer", []string{"answers"}, "Paris. The answer", false},
		{"aaab", []string{"aab"}, "a", true},
		{"ééèé", []string{"èé"}, "éé", true},
		{"ééèé", []string{"éx"}, "ééèé", false},
		{"stop", []string{"stop"}, "", true},
		{"no stops", nil, "no stops", false},
	}
	for _, c := range cases {
		// Every way of cutting the text into two or three pieces at character boundaries.
		var bounds []int
		for i := range c.text {
			bounds = append(bounds, i)
		}
		bounds = append(bounds, len(c.text))
		for _, i := range bounds {
			for _, j := range bounds {
				if j < i {
					continue
				}
				s := &stopScanner{stops: c.stops}
				var out strings.Builder
				hit := false
				for _, piece := range []string{c.text[:i], c.text[i:j], c.text[j:]} {
					text, stopped := s.Push(piece)
					out.WriteString(text)
					hit = hit || stopped
				}
				if !hit {
					out.WriteString(s.Flush())
				}
				if out.String() != c.want || hit != c.hit {
					t.Fatalf("%q in pieces cut at %d and %d, stops %q: %q (stopped %v), want %q (%v)",
						c.text, i, j, c.stops, out.String(), hit, c.want, c.hit)
				}
			}
		}
	}
}
