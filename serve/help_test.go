package main

// pipe-serve --help: exits 0 and lists every flag on a line of its own, on stdout (so that it can
// be paged or searched); an unknown flag exits 2 with a hint on stderr rather than the list.

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// serveFlags are the flags main defines, each to be listed once.
var serveFlags = []string{"decoder", "model-dir", "split", "stages", "processes", "addr", "max-queued", "name",
	"api-key", "api-key-file", "metrics-public", "read-header-timeout", "read-timeout", "write-timeout",
	"idle-timeout", "queue-timeout", "max-conns"}

func TestHelp(t *testing.T) {
	bin := os.Getenv("PIPE_SERVE_BIN")
	if bin == "" {
		t.Fatal("PIPE_SERVE_BIN is not set: run.sh sets it to the installed pipe-serve")
	}
	for _, arg := range []string{"--help", "-h"} {
		out, err := exec.Command(bin, arg).Output()
		if err != nil {
			t.Fatalf("pipe-serve %s: %v", arg, err)
		}
		lines := strings.Split(string(out), "\n")
		flagLines := 0
		for _, line := range lines {
			if strings.HasPrefix(line, "  -") {
				flagLines++
			}
		}
		for _, name := range serveFlags {
			n := 0
			for _, line := range lines {
				if strings.HasPrefix(line, "  -"+name+" ") {
					n++
				}
			}
			if n != 1 {
				t.Errorf("pipe-serve %s lists -%s on %d lines, want 1:\n%s", arg, name, n, out)
			}
		}
		if flagLines != len(serveFlags) {
			t.Errorf("pipe-serve %s lists %d flags, want %d:\n%s", arg, flagLines, len(serveFlags), out)
		}
	}
	cmd := exec.Command(bin, "--no-such-flag")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || len(out) != 0 || !strings.Contains(stderr.String(), "--help") {
		t.Fatalf("pipe-serve --no-such-flag: %v, stdout %q, stderr %q; want exit 2 and a hint", err, out, stderr.String())
	}
}
