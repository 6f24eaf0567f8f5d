package pipe

import (
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// DType is the element type of a Tensor.
type DType int32

// The element types a Tensor can hold, with the Go type of its data slice.
const (
	Float32  DType = iota + 1 // []float32
	Float64                   // []float64
	Float16                   // []uint16, IEEE half-precision bit patterns
	BFloat16                  // []uint16, bfloat16 bit patterns
	Int64                     // []int64
	Int32                     // []int32
	Int16                     // []int16
	Int8                      // []int8
	Uint8                     // []uint8
	Bool                      // []bool
)

// DLPack type codes (dlpack.h; kDLBool is newer than Debian's dlpack 0.6 header but is what
// LibTorch emits for bool tensors).
const (
	dlInt      = 0
	dlUInt     = 1
	dlFloat    = 2
	dlBfloat   = 4
	dlBool     = 6
	dlCPU      = 1
	dlCUDAHost = 3
)

type dtypeInfo struct {
	name string
	code int
	bits int
}

var dtypes = map[DType]dtypeInfo{
	Float32:  {"float32", dlFloat, 32},
	Float64:  {"float64", dlFloat, 64},
	Float16:  {"float16", dlFloat, 16},
	BFloat16: {"bfloat16", dlBfloat, 16},
	Int64:    {"int64", dlInt, 64},
	Int32:    {"int32", dlInt, 32},
	Int16:    {"int16", dlInt, 16},
	Int8:     {"int8", dlInt, 8},
	Uint8:    {"uint8", dlUInt, 8},
	Bool:     {"bool", dlBool, 8},
}

func (d DType) String() string {
	if info, ok := dtypes[d]; ok {
		return info.name
	}
	return fmt.Sprintf("DType(%d)", int32(d))
}

// Size is the size of one element in bytes (0 for an unknown DType).
func (d DType) Size() int { return dtypes[d].bits / 8 }

func dtypeFromDLPack(code, bits, lanes int64) (DType, bool) {
	if lanes != 1 {
		return 0, false
	}
	for d, info := range dtypes {
		if int64(info.code) == code && int64(info.bits) == bits {
			return d, true
		}
	}
	return 0, false
}

// Element is the Go element types NewTensor accepts.
type Element interface {
	float32 | float64 | int64 | int32 | int16 | int8 | uint8 | bool
}

func dtypeOf[T Element]() DType {
	var zero T
	switch any(zero).(type) {
	case float32:
		return Float32
	case float64:
		return Float64
	case int64:
		return Int64
	case int32:
		return Int32
	case int16:
		return Int16
	case int8:
		return Int8
	case uint8:
		return Uint8
	default:
		return Bool
	}
}

// Tensor is a dense, row-major CPU tensor: a Go slice of elements and a shape. The slice is
// shared, not copied, by NewTensor and the accessors.
type Tensor struct {
	dtype DType
	shape []int64
	data  any // the typed slice; see the DType constants
}

// NewTensor makes a tensor over data (not copied) with the given shape; no shape means a 0-d
// tensor (a scalar), which needs exactly one element. The product of the shape must equal
// len(data).
func NewTensor[T Element](data []T, shape ...int64) (*Tensor, error) {
	return newTensor(dtypeOf[T](), data, len(data), shape)
}

// MustTensor is NewTensor that panics on a shape mismatch, for literals in tests and examples.
func MustTensor[T Element](data []T, shape ...int64) *Tensor {
	t, err := NewTensor(data, shape...)
	if err != nil {
		panic(err)
	}
	return t
}

// Scalar makes a 0-d tensor holding v.
func Scalar[T Element](v T) *Tensor { return MustTensor([]T{v}) }

// NewHalfTensor makes a Float16 or BFloat16 tensor from raw 16-bit patterns.
func NewHalfTensor(dtype DType, bits []uint16, shape ...int64) (*Tensor, error) {
	if dtype != Float16 && dtype != BFloat16 {
		return nil, errorf("NewHalfTensor", StatusInvalidArgument, "dtype must be Float16 or BFloat16, not %v", dtype)
	}
	return newTensor(dtype, bits, len(bits), shape)
}

func newTensor(dtype DType, data any, n int, shape []int64) (*Tensor, error) {
	numel := int64(1)
	for _, d := range shape {
		if d < 0 {
			return nil, errorf("NewTensor", StatusInvalidArgument, "negative dimension in shape %v", shape)
		}
		numel *= d
	}
	if numel != int64(n) {
		return nil, errorf("NewTensor", StatusInvalidArgument,
			"shape %v holds %d elements but the data has %d", shape, numel, n)
	}
	return &Tensor{dtype: dtype, shape: append([]int64(nil), shape...), data: data}, nil
}

// DType is the element type.
func (t *Tensor) DType() DType { return t.dtype }

// Shape is a copy of the tensor's shape (empty for a scalar).
func (t *Tensor) Shape() []int64 { return append([]int64(nil), t.shape...) }

// NumElements is the product of the shape.
func (t *Tensor) NumElements() int { return elementCount(t.shape) }

// Data is the typed slice ([]float32, []int64, ...; []uint16 for Float16 and BFloat16).
func (t *Tensor) Data() any { return t.data }

// Float32s is the data of a Float32 tensor, nil for any other DType.
func (t *Tensor) Float32s() []float32 { s, _ := t.data.([]float32); return s }

// Float64s is the data of a Float64 tensor, nil for any other DType.
func (t *Tensor) Float64s() []float64 { s, _ := t.data.([]float64); return s }

// Int64s is the data of an Int64 tensor, nil for any other DType.
func (t *Tensor) Int64s() []int64 { s, _ := t.data.([]int64); return s }

// Int32s is the data of an Int32 tensor, nil for any other DType.
func (t *Tensor) Int32s() []int32 { s, _ := t.data.([]int32); return s }

// Values is the data of t as []T; ok is false when t does not hold T.
func Values[T Element](t *Tensor) (values []T, ok bool) {
	values, ok = t.data.([]T)
	return values, ok
}

// AsFloat32 is a new []float32 holding t's elements converted to float32 (float16 and bfloat16
// bit patterns decoded; bools as 0 and 1).
func (t *Tensor) AsFloat32() []float32 {
	out := make([]float32, t.NumElements())
	switch s := t.data.(type) {
	case []float32:
		copy(out, s)
	case []float64:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []uint16:
		for i, v := range s {
			if t.dtype == BFloat16 {
				out[i] = math.Float32frombits(uint32(v) << 16)
			} else {
				out[i] = halfToFloat32(v)
			}
		}
	case []int64:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []int32:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []int16:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []int8:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []uint8:
		for i, v := range s {
			out[i] = float32(v)
		}
	case []bool:
		for i, v := range s {
			if v {
				out[i] = 1
			}
		}
	}
	return out
}

// halfToFloat32 decodes an IEEE 754 binary16 bit pattern.
func halfToFloat32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	frac := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf, NaN
		return math.Float32frombits(sign | 0x7f800000 | frac<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+127-15)<<23 | frac<<13)
	case frac == 0: // zero
		return math.Float32frombits(sign)
	default: // subnormal: frac * 2^-24
		v := float32(frac) / (1 << 24)
		if sign != 0 {
			v = -v
		}
		return v
	}
}

func (t *Tensor) String() string {
	return fmt.Sprintf("Tensor(%v, shape=%v)", t.dtype, t.shape)
}

func elementCount(shape []int64) int {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return int(n)
}

// bytes views the tensor's elements as bytes (no copy); nil when it has none.
func (t *Tensor) bytes() []byte {
	n := t.NumElements() * t.dtype.Size()
	if n == 0 {
		return nil
	}
	var p unsafe.Pointer
	switch s := t.data.(type) {
	case []float32:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []float64:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []uint16:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []int64:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []int32:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []int16:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []int8:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []uint8:
		p = unsafe.Pointer(unsafe.SliceData(s))
	case []bool:
		p = unsafe.Pointer(unsafe.SliceData(s))
	default:
		return nil
	}
	return unsafe.Slice((*byte)(p), n)
}

// makeData allocates a zeroed slice for n elements of dtype.
func makeData(dtype DType, n int) any {
	switch dtype {
	case Float32:
		return make([]float32, n)
	case Float64:
		return make([]float64, n)
	case Float16, BFloat16:
		return make([]uint16, n)
	case Int64:
		return make([]int64, n)
	case Int32:
		return make([]int32, n)
	case Int16:
		return make([]int16, n)
	case Int8:
		return make([]int8, n)
	case Uint8:
		return make([]uint8, n)
	default:
		return make([]bool, n)
	}
}

// NamedTensor is one entry of a TensorList.
type NamedTensor struct {
	Name   string
	Tensor *Tensor
}

// TensorList is an ordered list of named tensors: the outputs of a call ("output" for a tensor
// result, "output.0", "output.1", ... for a tuple, "output.<key>" for a dict) or the contents of
// a safetensors file.
type TensorList []NamedTensor

// Get is the tensor called name, or nil.
func (l TensorList) Get(name string) *Tensor {
	for _, e := range l {
		if e.Name == name {
			return e.Tensor
		}
	}
	return nil
}

// Names lists the names in order.
func (l TensorList) Names() []string {
	names := make([]string, len(l))
	for i, e := range l {
		names[i] = e.Name
	}
	return names
}

// ---- Crossing into C --------------------------------------------------------------------------

// cTensors are Go tensors as DLPack structs for one call. The structs and shapes are in C
// memory; the elements are the Go slices themselves, pinned until free: pipe.h borrows inputs
// only during the call (pipe_session_run) or copies them (pipe_session_submit, example inputs,
// pipe_tensor_list_append).
type cTensors struct {
	pinner  runtime.Pinner
	handles []capi.SwigcptrDLManagedTensor
}

func wrapTensors(op string, tensors []*Tensor) (*cTensors, error) {
	c := &cTensors{handles: make([]capi.SwigcptrDLManagedTensor, 0, len(tensors))}
	for i, t := range tensors {
		if t == nil {
			c.free()
			return nil, errorf(op, StatusInvalidArgument, "input %d is nil", i)
		}
		info, ok := dtypes[t.dtype]
		if !ok {
			c.free()
			return nil, errorf(op, StatusInvalidArgument, "input %d has unknown dtype %v", i, t.dtype)
		}
		var p unsafe.Pointer
		if b := t.bytes(); len(b) > 0 {
			p = unsafe.Pointer(unsafe.SliceData(b))
			c.pinner.Pin(p)
		}
		h := capi.Pipego_tensor_wrap(p, info.code, info.bits, t.shape)
		if h.Swigcptr() == 0 {
			c.free()
			return nil, errorf(op, StatusOutOfMemory, "cannot allocate a DLPack tensor")
		}
		c.handles = append(c.handles, capi.SwigcptrDLManagedTensor(h.Swigcptr()))
	}
	return c, nil
}

func (c *cTensors) free() {
	for _, h := range c.handles {
		capi.Pipego_tensor_delete(h)
	}
	c.handles = nil
	c.pinner.Unpin()
}

// copyTensor copies a libpipe CPU tensor into a new Go tensor.
func copyTensor(op string, h capi.SwigcptrDLManagedTensor) (*Tensor, error) {
	ndim := capi.Pipego_tensor_ndim(h)
	desc := make([]int64, 4+ndim)
	capi.Pipego_tensor_describe(h, desc)
	device, code, bits, lanes := desc[0], desc[1], desc[2], desc[3]
	if device != dlCPU && device != dlCUDAHost {
		return nil, errorf(op, StatusUnsupported, "tensor on DLPack device type %d, not the CPU", device)
	}
	dtype, ok := dtypeFromDLPack(code, bits, lanes)
	if !ok {
		return nil, errorf(op, StatusUnsupported, "DLPack dtype code %d bits %d lanes %d has no Go type", code, bits, lanes)
	}
	shape := append([]int64(nil), desc[4:]...)
	t := &Tensor{dtype: dtype, shape: shape, data: makeData(dtype, elementCount(shape))}
	if capi.Pipego_tensor_copy(h, t.bytes()) != 0 {
		return nil, errorf(op, StatusInternal, "cannot copy a %v tensor of shape %v", dtype, shape)
	}
	return t, nil
}

// takeList copies every tensor of a libpipe list into Go, calling each DLPack deleter, and
// destroys the list.
func takeList(op string, list capi.SwigcptrPipe_tensor_list) (TensorList, error) {
	defer capi.Pipe_tensor_list_destroy(list)
	var n int64
	if err := call("pipe_tensor_list_size", func() int { return capi.Pipe_tensor_list_size(list, &n) }); err != nil {
		return nil, err
	}
	out := make(TensorList, 0, n)
	for i := int64(0); i < n; i++ {
		var name uintptr
		if err := call("pipe_tensor_list_name", func() int { return capi.Pipe_tensor_list_name(list, i, &name) }); err != nil {
			return nil, err
		}
		entry := NamedTensor{Name: cString(name)}
		var h capi.SwigcptrDLManagedTensor
		if err := call("pipe_tensor_list_take", func() int { return capi.Pipe_tensor_list_take(list, i, &h) }); err != nil {
			return nil, err
		}
		t, err := copyTensor(op, h)
		capi.Pipego_tensor_delete(h)
		if err != nil {
			return nil, err
		}
		entry.Tensor = t
		out = append(out, entry)
	}
	return out, nil
}
