package pipe_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	pipe "github.com/libpipe/libpipe/bindings/go"
)

// logged collects what a log callback received.
type logged struct {
	mu       sync.Mutex
	messages []string
	levels   []pipe.LogLevel
}

func (l *logged) add(level pipe.LogLevel, message string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.levels = append(l.levels, level)
	l.messages = append(l.messages, message)
}

func (l *logged) snapshot() ([]pipe.LogLevel, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]pipe.LogLevel(nil), l.levels...), append([]string(nil), l.messages...)
}

func TestLogCallback(t *testing.T) {
	d := newDemo(t, 4)
	var seen logged
	if err := pipe.SetLogCallback(seen.add, pipe.LogWarning); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := pipe.ResetLogCallback(); err != nil {
			t.Error(err)
		}
	}()
	// Refused: the callback installed stays, and the messages still reach it, not the other.
	var other logged
	if err := pipe.SetLogCallback(other.add, pipe.LogLevel(9)); err == nil ||
		!strings.Contains(asError(t, err, pipe.StatusInvalidArgument).Message, "min_level 9") {
		t.Fatalf("SetLogCallback with level 9: %v", err)
	}
	asError(t, pipe.SetLogCallback(nil, pipe.LogInfo), pipe.StatusInvalidArgument)

	// A batch of 2 rows with 4 micro-batches runs as 2 micro-batches, with a warning, which
	// libpipe logs on one of its own threads.
	two := pipe.MustTensor(d.x.Float32s()[:2*256], 2, 256)
	must(d.session.Run(context.Background(), two))(t)
	levels, messages := seen.snapshot()
	found := false
	for i, m := range messages {
		if levels[i] < pipe.LogWarning {
			t.Errorf("a %v message passed a LogWarning callback: %q", levels[i], m)
		}
		found = found || (levels[i] == pipe.LogWarning && strings.Contains(m, "micro"))
	}
	if !found {
		t.Fatalf("no warning about micro-batches among %q", messages)
	}
	if _, m := other.snapshot(); len(m) != 0 {
		t.Fatalf("a refused callback received %q", m)
	}
	if s := pipe.LogLevel(7).String(); s != "LogLevel(7)" || pipe.LogInfo.String() != "info" {
		t.Errorf("LogLevel strings: %q, %q", s, pipe.LogInfo.String())
	}
}
