package pipe

import (
	"runtime"
	"sync"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// PlanOptions says how to cut a model. A nil *PlanOptions (or a zero one) cuts at the
// pipe::split() markers in the model code; a model without markers gives one stage.
type PlanOptions struct {
	// Cuts at module boundaries, as PyTorch's SplitPoint: "FQN:begin" just before module FQN
	// runs, "FQN:end" just after ("layers.3:end"); "FQN@K:end" picks the K-th call.
	SplitPoints []string
	// Stages > 0 asks for that many stages chosen by Policy instead of split points.
	Stages int
	// Policy is "uniform" (equal layers; the default when Stages > 0), "params" (equal
	// parameter bytes) or "time" (equal measured time; needs ExampleInputs).
	Policy string
	// ExampleInputs, the forward arguments in order (copied), make the plan measure each
	// stage; required by Policy "time".
	ExampleInputs []*Tensor
}

// StageOptions says where each stage's weights come from and in which dtype they run.
type StageOptions struct {
	// DType converts floating weights and inputs: 0 keeps them, or Float32, Float16, BFloat16.
	DType DType
	// Weights is a safetensors checkpoint (a .safetensors file or a *.safetensors.index.json);
	// "" keeps the model's own weights.
	Weights string
	// Quantize stores CPU stages' linear layers' weights as 8-bit codes (QuantizeInt8, libpipe >= 0.13)
	// or 4-bit codes (QuantizeInt4, libpipe >= 0.14); the zero value keeps them as they are.
	Quantize Quantization
	// QuantizeGroup is QuantizeInt4's inputs per scale: 32, 64 or 128; 0 means 32. Also the groups of a
	// head QuantizeHead makes 4-bit.
	QuantizeGroup int
	// QuantizeHead is how the output head (the linear layer whose result the model returns, a decoder's
	// lm_head) is stored when Quantize is set (libpipe >= 0.16): the zero value as the other weights under
	// QuantizeInt8 and 8-bit under QuantizeInt4. Without Quantize anything else is ErrInvalidArgument.
	QuantizeHead HeadQuantization
	// QuantizeEmbedding stores CPU stages' embedding tables as 8-bit codes with a float32 scale per row
	// (QuantizeEmbeddingInt8, libpipe >= 0.17), with or without Quantize: it saves memory, not time. A table
	// tied to a linear layer of its stage keeps its dtype; exported (.pt2) models refuse it (ErrUnsupported).
	QuantizeEmbedding EmbeddingQuantization
}

// EmbeddingQuantization is how CPU stages store embedding tables (pipe.h's PIPE_QUANTIZE_EMBEDDING_*).
type EmbeddingQuantization int32

const (
	// QuantizeEmbeddingNone keeps the table in its dtype.
	QuantizeEmbeddingNone EmbeddingQuantization = EmbeddingQuantization(capi.PIPE_QUANTIZE_EMBEDDING_NONE)
	// QuantizeEmbeddingInt8 stores it as 8-bit codes with a float32 scale per row (token).
	QuantizeEmbeddingInt8 EmbeddingQuantization = EmbeddingQuantization(capi.PIPE_QUANTIZE_EMBEDDING_INT8)
)

// HeadQuantization is how CPU stages store the output head (pipe.h's PIPE_QUANTIZE_HEAD_*).
type HeadQuantization int32

const (
	// QuantizeHeadDefault stores the head as the other weights under QuantizeInt8, as 8-bit codes under QuantizeInt4.
	QuantizeHeadDefault HeadQuantization = HeadQuantization(capi.PIPE_QUANTIZE_HEAD_DEFAULT)
	// QuantizeHeadInt8 stores it as 8-bit codes with a scale per output feature.
	QuantizeHeadInt8 HeadQuantization = HeadQuantization(capi.PIPE_QUANTIZE_HEAD_INT8)
	// QuantizeHeadInt4 stores it as 4-bit codes in groups of StageOptions.QuantizeGroup inputs.
	QuantizeHeadInt4 HeadQuantization = HeadQuantization(capi.PIPE_QUANTIZE_HEAD_INT4)
	// QuantizeHeadNone keeps it in the stage's dtype.
	QuantizeHeadNone HeadQuantization = HeadQuantization(capi.PIPE_QUANTIZE_HEAD_NONE)
)

// Quantization is how CPU stages store their linear layers' weights (pipe.h's PIPE_QUANTIZE_*).
type Quantization int32

const (
	// QuantizeNone keeps the weights in the stage's dtype.
	QuantizeNone Quantization = Quantization(capi.PIPE_QUANTIZE_NONE)
	// QuantizeInt8 keeps 8-bit codes with a float32 scale per output feature; activations stay in the dtype.
	QuantizeInt8 Quantization = Quantization(capi.PIPE_QUANTIZE_INT8)
	// QuantizeInt4 keeps 4-bit codes with a float16 scale per group of inputs (StageOptions.QuantizeGroup) and
	// output feature, as llama.cpp's Q4_0; the activations are rounded to int8 per block of 32 inside the product.
	QuantizeInt4 Quantization = Quantization(capi.PIPE_QUANTIZE_INT4)
)

// Plan is a model cut into stages.
type Plan struct {
	mu        sync.RWMutex
	ptr       capi.SwigcptrPipe_plan
	cleanup   runtime.Cleanup
	numStages int
}

// StageInfo describes one stage of a plan.
type StageInfo struct {
	Index       int
	Parameters  []string // parameters the stage reads, original dotted names
	Buffers     []string // buffers the stage reads
	ParamBytes  uint64   // bytes of its parameters and buffers
	EstimatedMS float64  // measured time on the example inputs; -1 without example inputs
}

// NewPlan cuts the model as opts say (nil: at the pipe::split() markers).
// ErrSplit when the model cannot be cut so (the message says why and what to do instead);
// ErrInvalidArgument for bad options.
func (m *Model) NewPlan(opts *PlanOptions) (*Plan, error) {
	const op = "Model.NewPlan"
	mptr, err := m.acquire(op)
	if err != nil {
		return nil, err
	}
	defer m.mu.RUnlock()

	var optr capi.SwigcptrPipe_plan_options
	if opts != nil {
		if err := call("pipe_plan_options_create", func() int { return capi.Pipe_plan_options_create(&optr) }); err != nil {
			return nil, err
		}
		defer capi.Pipe_plan_options_destroy(optr)
		for _, sp := range opts.SplitPoints {
			if err := call("pipe_plan_options_add_split_point", func() int {
				return capi.Pipe_plan_options_add_split_point(optr, sp)
			}); err != nil {
				return nil, err
			}
		}
		if opts.Stages != 0 || opts.Policy != "" {
			policy := opts.Policy
			if policy == "" {
				policy = "uniform"
			}
			if err := call("pipe_plan_options_set_stages", func() int {
				return capi.Pipe_plan_options_set_stages(optr, opts.Stages, policy)
			}); err != nil {
				return nil, err
			}
		}
		if len(opts.ExampleInputs) > 0 {
			c, err := wrapTensors(op, opts.ExampleInputs)
			if err != nil {
				return nil, err
			}
			err = call("pipe_plan_options_set_example_inputs", func() int {
				return capi.Pipe_plan_options_set_example_inputs(optr, c.handles)
			})
			c.free()
			if err != nil {
				return nil, err
			}
		}
	}
	var ptr capi.SwigcptrPipe_plan
	if err := call("pipe_plan_create", func() int { return capi.Pipe_plan_create(mptr, optr, &ptr) }); err != nil {
		return nil, err
	}
	p := &Plan{ptr: ptr}
	p.cleanup = runtime.AddCleanup(p, func(h capi.SwigcptrPipe_plan) { capi.Pipe_plan_destroy(h) }, ptr)
	var n int64
	if err := call("pipe_plan_num_stages", func() int { return capi.Pipe_plan_num_stages(ptr, &n) }); err != nil {
		p.Close()
		return nil, err
	}
	p.numStages = int(n)
	return p, nil
}

// Close frees the plan. Sessions made from it stay valid. Closing twice is a no-op.
func (p *Plan) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ptr != 0 {
		p.cleanup.Stop()
		capi.Pipe_plan_destroy(p.ptr)
		p.ptr = 0
	}
	return nil
}

func (p *Plan) acquire(op string) (capi.SwigcptrPipe_plan, error) {
	p.mu.RLock()
	if p.ptr == 0 {
		p.mu.RUnlock()
		return 0, closedError(op, "plan")
	}
	return p.ptr, nil
}

// NumStages is the number of stages.
func (p *Plan) NumStages() int { return p.numStages }

// Describe is the whole plan as JSON: stages, their weights, what crosses each cut, the balance
// (pipe.h, pipe_plan_describe, gives the schema).
func (p *Plan) Describe() (string, error) {
	ptr, err := p.acquire("Plan.Describe")
	if err != nil {
		return "", err
	}
	defer p.mu.RUnlock()
	var s uintptr
	if err := call("pipe_plan_describe", func() int { return capi.Pipe_plan_describe(ptr, &s) }); err != nil {
		return "", err
	}
	return cString(s), nil
}

// Stage describes stage i (0 <= i < NumStages).
func (p *Plan) Stage(i int) (StageInfo, error) {
	info := StageInfo{Index: i}
	ptr, err := p.acquire("Plan.Stage")
	if err != nil {
		return info, err
	}
	defer p.mu.RUnlock()
	stage := int64(i)
	names := func(kind int) ([]string, error) {
		var n int64
		if err := call("pipe_plan_stage_count_names", func() int {
			return capi.Pipe_plan_stage_count_names(ptr, stage, kind, &n)
		}); err != nil {
			return nil, err
		}
		out := make([]string, 0, n)
		for j := int64(0); j < n; j++ {
			var s uintptr
			if err := call("pipe_plan_stage_name", func() int {
				return capi.Pipe_plan_stage_name(ptr, stage, kind, j, &s)
			}); err != nil {
				return nil, err
			}
			out = append(out, cString(s))
		}
		return out, nil
	}
	if info.Parameters, err = names(capi.PIPE_NAMES_PARAMETERS); err != nil {
		return info, err
	}
	if info.Buffers, err = names(capi.PIPE_NAMES_BUFFERS); err != nil {
		return info, err
	}
	// Out-parameters are locals: cgo checks the whole Go allocation a pointer points into, and
	// info holds slices (Go pointers).
	var bytes uint64
	var ms float64
	if err := call("pipe_plan_stage_param_bytes", func() int {
		return capi.Pipe_plan_stage_param_bytes(ptr, stage, &bytes)
	}); err != nil {
		return info, err
	}
	if err := call("pipe_plan_stage_estimated_ms", func() int {
		return capi.Pipe_plan_stage_estimated_ms(ptr, stage, &ms)
	}); err != nil {
		return info, err
	}
	info.ParamBytes, info.EstimatedMS = bytes, ms
	return info, nil
}

// SaveStage writes stage i as a standalone model of the plan's format (Model.Format): a TorchScript
// file, or for an exported program a .pt2 holding one program named "model", with only the weights
// it reads (loaded and converted as opts say; nil: the model's own weights).
func (p *Plan) SaveStage(i int, path string, opts *StageOptions) error {
	ptr, err := p.acquire("Plan.SaveStage")
	if err != nil {
		return err
	}
	defer p.mu.RUnlock()
	so, err := newStageOptions("Plan.SaveStage", opts)
	if err != nil {
		return err
	}
	if so != nil {
		defer capi.DeletePipe_stage_options(so)
	}
	return call("pipe_plan_save_stage", func() int { return capi.Pipe_plan_save_stage(ptr, int64(i), so, path) })
}

// StageWeightBytes is the bytes stage i's parameters and buffers would take as a CPU stage built with opts
// (nil: the model's own weights), linear layers' weights as panels or codes as opts.Quantize and opts.QuantizeHead
// say (libpipe >= 0.16; pipe_plan_stage_weight_bytes), an int8 embedding as its codes and scales (0.17): worked out from the shapes, nothing loaded. ErrUnsupported
// for quantized weights where the CPU has no kernels for them; ErrInvalidArgument for options a session refuses.
func (p *Plan) StageWeightBytes(i int, opts *StageOptions) (uint64, error) {
	ptr, err := p.acquire("Plan.StageWeightBytes")
	if err != nil {
		return 0, err
	}
	defer p.mu.RUnlock()
	so, err := newStageOptions("Plan.StageWeightBytes", opts)
	if err != nil {
		return 0, err
	}
	if so != nil {
		defer capi.DeletePipe_stage_options(so)
	}
	var bytes uint64
	if err := call("pipe_plan_stage_weight_bytes", func() int {
		return capi.Pipe_plan_stage_weight_bytes(ptr, int64(i), so, &bytes)
	}); err != nil {
		return 0, err
	}
	return bytes, nil
}

// newStageOptions builds the C struct (nil for nil opts); the caller deletes it.
func newStageOptions(op string, opts *StageOptions) (capi.Pipe_stage_options, error) {
	if opts == nil {
		return nil, nil
	}
	var dtype int
	switch opts.DType {
	case 0:
		dtype = capi.PIPE_DTYPE_KEEP
	case Float32:
		dtype = capi.PIPE_DTYPE_FLOAT32
	case Float16:
		dtype = capi.PIPE_DTYPE_FLOAT16
	case BFloat16:
		dtype = capi.PIPE_DTYPE_BFLOAT16
	default:
		return nil, errorf(op, StatusInvalidArgument, "stage dtype must be Float32, Float16 or BFloat16, not %v", opts.DType)
	}
	if opts.Quantize != QuantizeNone && opts.Quantize != QuantizeInt8 && opts.Quantize != QuantizeInt4 {
		return nil, errorf(op, StatusInvalidArgument, "stage quantization must be QuantizeNone, QuantizeInt8 or QuantizeInt4, not %d", opts.Quantize)
	}
	switch opts.QuantizeHead {
	case QuantizeHeadDefault, QuantizeHeadInt8, QuantizeHeadInt4, QuantizeHeadNone:
	default:
		return nil, errorf(op, StatusInvalidArgument, "stage head quantization must be QuantizeHeadDefault, QuantizeHeadInt8, QuantizeHeadInt4 or QuantizeHeadNone, not %d", opts.QuantizeHead)
	}
	if opts.QuantizeEmbedding != QuantizeEmbeddingNone && opts.QuantizeEmbedding != QuantizeEmbeddingInt8 {
		return nil, errorf(op, StatusInvalidArgument, "stage embedding quantization must be QuantizeEmbeddingNone or QuantizeEmbeddingInt8, not %d", opts.QuantizeEmbedding)
	}
	so := capi.NewPipe_stage_options()
	if so.Swigcptr() == 0 {
		return nil, errorf(op, StatusOutOfMemory, "cannot allocate stage options")
	}
	so.SetDtype(dtype)
	so.SetQuantize(int(opts.Quantize))
	so.SetQuantize_group(int64(opts.QuantizeGroup))
	so.SetQuantize_head(int(opts.QuantizeHead))
	so.SetQuantize_embedding(int64(opts.QuantizeEmbedding))
	so.Set_weights_path(opts.Weights)
	return so, nil
}
