package pipe

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// Model is a loaded model: a TorchScript archive or a torch.export program ([Model.Format]).
type Model struct {
	mu      sync.RWMutex // read: a call on ptr is in progress; write: Close
	ptr     capi.SwigcptrPipe_model
	cleanup runtime.Cleanup
	inputs  []string
	format  ModelFormat
}

// ModelFormat says what kind of file a model was loaded from (pipe.h's PIPE_MODEL_*).
type ModelFormat int32

// The model formats.
const (
	// ModelTorchScript: a TorchScript archive (torch.jit.trace / torch.jit.script output); its
	// plans' stages save as TorchScript (.pt).
	ModelTorchScript ModelFormat = ModelFormat(capi.PIPE_MODEL_TORCHSCRIPT)
	// ModelExported: a torch.export program (torch.export.save output, a .pt2); its plans'
	// stages save as programs (.pt2).
	ModelExported ModelFormat = ModelFormat(capi.PIPE_MODEL_EXPORTED)
)

// String is "torchscript", "exported", or the number for a value pipe.h does not define.
func (f ModelFormat) String() string {
	switch f {
	case ModelTorchScript:
		return "torchscript"
	case ModelExported:
		return "exported"
	}
	return fmt.Sprintf("ModelFormat(%d)", int32(f))
}

// ModuleInfo describes one module of a model's module tree.
type ModuleInfo struct {
	Path       string // dotted path, "" for the root
	TypeName   string // class name
	Depth      int    // 0 for the root
	NumParams  uint64 // parameters held with all descendants (shared tensors counted once)
	ParamBytes uint64
}

// LoadModel loads a TorchScript archive (torch.jit.trace or torch.jit.script output, saved with
// .save()) or a torch.export program (torch.export.save output, a .pt2); the file's content
// decides which, never its name ([Model.Format] says which it was). A model file is code: load
// only models you trust. ErrNotFound if the file is missing; ErrInvalidFormat if it is neither
// (or a TorchScript archive without a forward method); ErrUnsupported for an exported program
// libpipe cannot run, with a message that says what to export instead.
func LoadModel(path string) (*Model, error) {
	var ptr capi.SwigcptrPipe_model
	if err := call("pipe_model_load", func() int { return capi.Pipe_model_load(path, &ptr) }); err != nil {
		return nil, err
	}
	m := &Model{ptr: ptr}
	m.cleanup = runtime.AddCleanup(m, func(p capi.SwigcptrPipe_model) { capi.Pipe_model_destroy(p) }, ptr)
	var n int64
	if err := call("pipe_model_num_inputs", func() int { return capi.Pipe_model_num_inputs(ptr, &n) }); err != nil {
		m.Close()
		return nil, err
	}
	for i := int64(0); i < n; i++ {
		var name uintptr
		if err := call("pipe_model_input_name", func() int { return capi.Pipe_model_input_name(ptr, i, &name) }); err != nil {
			m.Close()
			return nil, err
		}
		m.inputs = append(m.inputs, cString(name))
	}
	var format int32
	if err := call("pipe_model_format", func() int { return capi.Pipe_model_format(ptr, &format) }); err != nil {
		m.Close()
		return nil, err
	}
	m.format = ModelFormat(format)
	return m, nil
}

// Close frees the model. Plans and sessions made from it stay valid. Closing twice is a no-op.
func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ptr != 0 {
		m.cleanup.Stop()
		capi.Pipe_model_destroy(m.ptr)
		m.ptr = 0
	}
	return nil
}

// acquire returns the handle with the read lock held; release with m.mu.RUnlock.
func (m *Model) acquire(op string) (capi.SwigcptrPipe_model, error) {
	m.mu.RLock()
	if m.ptr == 0 {
		m.mu.RUnlock()
		return 0, closedError(op, "model")
	}
	return m.ptr, nil
}

// NumInputs is the number of forward arguments (not counting self).
func (m *Model) NumInputs() int { return len(m.inputs) }

// InputNames are the forward arguments' names as written in the model code, in order.
func (m *Model) InputNames() []string { return append([]string(nil), m.inputs...) }

// Format is what the model file was (pipe_model_format, libpipe >= 0.10): [ModelTorchScript]
// or [ModelExported]. Read when the model was loaded, so it is still known after Close.
func (m *Model) Format() ModelFormat { return m.format }

// Modules lists the module tree in pre-order.
func (m *Model) Modules() ([]ModuleInfo, error) {
	ptr, err := m.acquire("Model.Modules")
	if err != nil {
		return nil, err
	}
	defer m.mu.RUnlock()
	var n int64
	if err := call("pipe_model_num_modules", func() int { return capi.Pipe_model_num_modules(ptr, &n) }); err != nil {
		return nil, err
	}
	mods := make([]ModuleInfo, 0, n)
	for i := int64(0); i < n; i++ {
		var path, typeName uintptr
		var depth int32
		var params, bytes uint64
		if err := call("pipe_model_module", func() int {
			return capi.Pipe_model_module(ptr, i, &path, &typeName, &depth, &params, &bytes)
		}); err != nil {
			return nil, err
		}
		mods = append(mods, ModuleInfo{
			Path: cString(path), TypeName: cString(typeName), Depth: int(depth),
			NumParams: params, ParamBytes: bytes,
		})
	}
	return mods, nil
}
