// Package testgate is the Go side of the test gate (tests/gate/gate_op.cpp in the libpipe
// repository), for this module's tests only: a TorchScript operator that holds a stage of the
// gated test model until the test opens it, so that a test waits for an observable state ("the
// call is held in stage 0") instead of guessing how long some work takes on a loaded machine.
//
//	g, err := testgate.Init(lib)    // once per process, before any gated model is loaded
//	key := g.NewKey()               // one per call to hold; pass it as the model's input n
//	g.Wait(key, "stage0", Arrived, 1)
//	g.Open(key, "")                 // every stage ("stage0": that stage only)
//
// The protocol is files in one folder (LIBPIPE_TEST_GATE_DIR): the operator creates
// gate-<key>.<stage>.arrived.<pid>.<seq> when a micro-batch reaches the gate, waits for
// gate-<key>.open or gate-<key>.<stage>.open, then creates gate-<key>.<stage>.left.<pid>.<seq>.
//
// The operator's library is loaded with dlopen(RTLD_GLOBAL): its TORCH_LIBRARY registration runs
// then, into the LibTorch that libpipe already loaded, so that libpipe can resolve
// libpipe_test::gate when it loads the model. cgo is not allowed in _test.go files, hence this
// package.
package testgate

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>

// NULL on success, else dlerror()'s message (read on the thread that failed: it is per thread).
static const char* testgate_load(const char* path) {
	if (dlopen(path, RTLD_NOW | RTLD_GLOBAL)) return NULL;
	return dlerror();
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"
)

// What a micro-batch has done at a gate: what Count and Wait count.
const (
	Arrived = "arrived" // reached the gate (and is held there until it opens)
	Left    = "left"    // passed the gate
)

// WaitLimit bounds every wait of this package. Waits are for states the test itself brings
// about, so the bound only ends a broken (hung) test; it never decides a verdict.
const WaitLimit = 300 * time.Second

// pollEvery is how often a wait looks again: the operator itself polls every 2 ms.
const pollEvery = 2 * time.Millisecond

// Gate is this process's gate folder. Keys are unique within it.
type Gate struct {
	dir  string
	last atomic.Int64
}

// Init loads the operator library at lib, creates a fresh gate folder and points
// LIBPIPE_TEST_GATE_DIR at it. Call it once per process, before any goroutine runs a gated
// model (it sets an environment variable that C code reads). A folder of its own per process:
// keys start at 1 in every process, so a folder shared with another test process would find that
// process's gates already open.
func Init(lib string) (*Gate, error) {
	if lib == "" {
		return nil, errors.New("testgate: no operator library given (libpipe_test_gate.so)")
	}
	if _, err := os.Stat(lib); err != nil {
		return nil, fmt.Errorf("testgate: the operator library: %w", err)
	}
	path := C.CString(lib)
	defer C.free(unsafe.Pointer(path))
	runtime.LockOSThread() // dlerror is per thread
	msg := C.testgate_load(path)
	var loadErr error
	if msg != nil {
		loadErr = fmt.Errorf("testgate: cannot load %s: %s", lib, C.GoString(msg))
	}
	runtime.UnlockOSThread()
	if loadErr != nil {
		return nil, loadErr
	}
	dir, err := os.MkdirTemp("", "libpipe-gate-")
	if err != nil {
		return nil, fmt.Errorf("testgate: %w", err)
	}
	// With cgo, os.Setenv also sets the C environment, where the operator reads it.
	if err := os.Setenv("LIBPIPE_TEST_GATE_DIR", dir); err != nil {
		return nil, fmt.Errorf("testgate: %w", err)
	}
	return &Gate{dir: dir}, nil
}

// Dir is the gate folder.
func (g *Gate) Dir() string { return g.dir }

// Remove deletes the gate folder (at the end of the test process).
func (g *Gate) Remove() error { return os.RemoveAll(g.dir) }

// NewKey is a key no other call of this process has had; keys are > 0 (0 passes every gate).
func (g *Gate) NewKey() int64 { return g.last.Add(1) }

// Count is how many micro-batches of key's calls have `what` (Arrived or Left) the gate of stage.
func (g *Gate) Count(key int64, stage, what string) (int, error) {
	entries, err := os.ReadDir(g.dir)
	if err != nil {
		return 0, fmt.Errorf("testgate: %w", err)
	}
	prefix := fmt.Sprintf("gate-%d.%s.%s.", key, stage, what)
	n := 0
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			n++
		}
	}
	return n, nil
}

// Wait returns once at least count micro-batches of key's calls have `what` the gate of stage.
func (g *Gate) Wait(key int64, stage, what string, count int) error {
	return Until(func() (bool, error) {
		n, err := g.Count(key, stage, what)
		return n >= count, err
	}, func() string {
		n, _ := g.Count(key, stage, what)
		return fmt.Sprintf("gate %d (%s): %d micro-batches %s, waited for %d", key, stage, n, what, count)
	})
}

// Open opens key's gate of stage, or of every stage when stage is "".
func (g *Gate) Open(key int64, stage string) error {
	name := fmt.Sprintf("gate-%d.open", key)
	if stage != "" {
		name = fmt.Sprintf("gate-%d.%s.open", key, stage)
	}
	f, err := os.Create(filepath.Join(g.dir, name))
	if err != nil {
		return fmt.Errorf("testgate: %w", err)
	}
	return f.Close()
}

// Until returns once cond holds, or an error (naming what was awaited, from describe) if cond
// fails or still does not hold after WaitLimit.
func Until(cond func() (bool, error), describe func() string) error {
	giveUp := time.Now().Add(WaitLimit)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(giveUp) {
			return fmt.Errorf("testgate: gave up after %v: %s", WaitLimit, describe())
		}
		time.Sleep(pollEvery)
	}
}
