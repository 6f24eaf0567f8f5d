package pipe

import (
	"strings"

	"github.com/libpipe/libpipe/bindings/go/internal/capi"
)

// ReadSafetensors reads every tensor of a safetensors file, in file order (libpipe's reader).
// ErrNotFound if the file cannot be opened; ErrInvalidFormat if it is malformed.
func ReadSafetensors(path string) (TensorList, error) {
	var list capi.SwigcptrPipe_tensor_list
	if err := call("pipe_safetensors_read", func() int { return capi.Pipe_safetensors_read(path, &list) }); err != nil {
		return nil, err
	}
	return takeList("ReadSafetensors", list)
}

// WriteSafetensors writes tensors to a safetensors file, in list order, with libpipe's writer:
// the tensors are copied into a libpipe list (pipe_tensor_list_append) which
// pipe_safetensors_write writes. libpipe writes a temporary file and renames it, so a failed
// write never leaves a truncated file at path.
//
// Errors: ErrInvalidArgument for a nil tensor, an empty, repeated or reserved ("__metadata__")
// name, or a name or path holding a NUL byte; ErrIO when the file cannot be written.
func WriteSafetensors(path string, tensors TensorList) error {
	const op = "WriteSafetensors"
	// Go strings reach C as NUL-terminated copies: a NUL inside would silently cut the name
	// (or path) short, so refuse it instead.
	if strings.IndexByte(path, 0) >= 0 {
		return errorf(op, StatusInvalidArgument, "path %q holds a NUL byte", path)
	}
	for i, e := range tensors {
		if e.Tensor == nil {
			return errorf(op, StatusInvalidArgument, "tensor %d (%q) is nil", i, e.Name)
		}
		if strings.IndexByte(e.Name, 0) >= 0 {
			return errorf(op, StatusInvalidArgument, "tensor %d: name %q holds a NUL byte", i, e.Name)
		}
	}
	var list capi.SwigcptrPipe_tensor_list
	if err := call("pipe_tensor_list_create", func() int { return capi.Pipe_tensor_list_create(&list) }); err != nil {
		return err
	}
	defer capi.Pipe_tensor_list_destroy(list)
	for _, e := range tensors {
		if err := appendTensor(op, list, e.Name, e.Tensor); err != nil {
			return err
		}
	}
	return call("pipe_safetensors_write", func() int { return capi.Pipe_safetensors_write(list, path) })
}

// appendTensor copies t into list under name. libpipe copies the elements during the call
// (pipe_tensor_list_append), so t's slice is pinned only for that call.
func appendTensor(op string, list capi.SwigcptrPipe_tensor_list, name string, t *Tensor) error {
	c, err := wrapTensors(op, []*Tensor{t})
	if err != nil {
		return err
	}
	defer c.free()
	return call("pipe_tensor_list_append", func() int { return capi.Pipe_tensor_list_append(list, name, c.handles[0]) })
}
