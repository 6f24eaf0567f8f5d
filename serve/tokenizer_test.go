package main

// Encoding prompts (tokenizer.go, over libpipe's tokenizer) against prompts made to be slow:
// special tokens written in the text become their ids, encoding takes time linear in the text
// however many special tokens it holds, and it holds no lock that decoding (every stream's
// detokenization) needs.

import (
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

const imEnd = "<|im_end|>"

// floodCodec is a byte-level tokenizer with three special tokens, ids floodID(0..2).
func floodCodec(t *testing.T) *textCodec {
	t.Helper()
	return loadTextFolder(t, writeByteLevelTokenizer(t, t.TempDir(), straddlingMerges,
		[]string{"<|im_start|>", imEnd, "<|im"}))
}

// floodID is the id of floodCodec's special token i (after the 256 bytes and the merges).
func floodID(i int) int64 { return int64(256 + len(straddlingMerges) + i) }

// Special tokens written in the text become their ids, the longest one where several start at the
// same place (as transformers encodes them); decoding leaves them out.
func TestEncodeAddedTokens(t *testing.T) {
	codec := floodCodec(t)
	end, short := floodID(1), floodID(2)
	ids, err := codec.Encode("a" + imEnd + "<|im" + "b" + imEnd)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int64{'a', end, short, 'b', end}; !slices.Equal(ids, want) {
		t.Fatalf("encoded as %v, want %v", ids, want)
	}
	if got := codec.Decode(ids); got != "ab" {
		t.Fatalf("decoded as %q, want the text without its special tokens", got)
	}
}

// Encoding N copies of a special token, alone or between words, takes time linear in N: sixteen
// times the copies take well under 16^1.7 (111) times as long, where a quadratic encode would take
// 16^2 (256) times as long (the service's first tokenizer, a Go library wrapped here, once
// rescanned the rest of the text at every match: 8,000 copies took 3.9 s, 32,000 took 61 s;
// Hugging Face's finds them all in one pass). The cost is the CPU time the process spends in the
// encode (getrusage), not the wall time, which other jobs on a loaded machine stretch at will
// (23x for 4x the copies seen on a busy 2-core machine, while the CPU time grew linearly). Even
// CPU time grows faster than the text (allocations and page faults that grow with it, caches it
// outgrows: 4x the copies took 4.0-6.7x as long on an idle machine, and a span of 4 once failed a
// bound of 10 in CI), so the span is 16, which puts linear and quadratic far apart: the exponent
// log(ratio)/log(16) is 0.9-1.4 when linear (idle or loaded) and 2 when quadratic; the bound is 1.7.
func TestEncodeIsLinear(t *testing.T) {
	codec := floodCodec(t)
	for _, c := range []struct {
		unit string
		n    int
	}{{imEnd, 25_000}, {"hi 中😀" + imEnd, 3_125}} {
		unit, n := c.unit, c.n
		took := func(copies int) time.Duration {
			text := strings.Repeat(unit, copies)
			best := time.Duration(1 << 62)
			for range 3 { // the cheapest of three
				runtime.GC() // nor should the garbage of the run before count
				start := cpuTime(t)
				ids, err := codec.Encode(text)
				elapsed := cpuTime(t) - start
				if err != nil {
					t.Fatal(err)
				}
				if got := countID(ids, floodID(1)); got != copies {
					t.Fatalf("%d copies of %q encode to %d %s", copies, unit, got, imEnd)
				}
				best = min(best, elapsed)
			}
			return best
		}
		took(n) // warm up
		one, sixteen := took(n), took(16*n)
		exponent := math.Log(float64(sixteen)/float64(one)) / math.Log(16)
		t.Logf("%q: %d copies in %v, %d in %v: time grows as copies^%.2f", unit, n, one, 16*n, sixteen, exponent)
		if exponent >= 1.7 {
			t.Fatalf("%q: sixteen times the copies took %.1f times as long (copies^%.2f): encoding is not linear",
				unit, float64(sixteen)/float64(one), exponent)
		}
	}
}

// cpuTime is the CPU time this process has used, user and system (every thread: the encode runs
// on the calling thread, and nothing else works meanwhile but the garbage collector).
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func countID(ids []int64, id int64) int {
	n := 0
	for _, x := range ids {
		if x == id {
			n++
		}
	}
	return n
}

// While a long prompt is being encoded, decoding (what every stream does for each token) goes on:
// decodes complete between the encode's start and its end. The encode of 4 MB of special tokens
// takes long enough that a decode that had to wait for it could not complete twice meanwhile.
func TestEncodeHoldsNoLock(t *testing.T) {
	codec := floodCodec(t)
	text := strings.Repeat(imEnd, 400_000) // about the body limit's worth
	var decodes atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		ids := []int64{'a', 0xE4, 0xB8, 0xAD}
		for {
			select {
			case <-stop:
				return
			default:
			}
			codec.Decode(ids)
			decodes.Add(1)
		}
	}()
	defer func() { close(stop); wg.Wait() }()
	until(t, "the decoding goroutine to run", func() bool { return decodes.Load() > 0 })
	for try := 1; ; try++ {
		before := decodes.Load()
		if _, err := codec.Encode(text); err != nil {
			t.Fatal(err)
		}
		during := decodes.Load() - before
		t.Logf("try %d: %d decodes completed during the encode", try, during)
		if during >= 2 {
			return
		}
		if try == 5 {
			t.Fatalf("no decode completed during any of %d encodes: decoding waits for encoding", try)
		}
	}
}

// EncodeAtMost stops at the limit: a flood of special tokens in a prompt that cannot fit the model
// is refused after the limit's worth of them.
func TestEncodeAtMostStops(t *testing.T) {
	codec := floodCodec(t)
	if _, err := codec.EncodeAtMost(strings.Repeat(imEnd, 100), 50); err != errTooManyTokens {
		t.Fatalf("100 tokens at most 50: %v", err)
	}
	if ids, err := codec.EncodeAtMost(strings.Repeat(imEnd, 50), 50); err != nil || len(ids) != 50 {
		t.Fatalf("50 tokens at most 50: %d, %v", len(ids), err)
	}
}
