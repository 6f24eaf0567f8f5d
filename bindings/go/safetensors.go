package pipe

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

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

// WriteSafetensors writes tensors to a safetensors file, in list order. It is written in Go:
// pipe.h can only write lists that libpipe made (pipe_safetensors_write takes a
// pipe_tensor_list, and there is no way to build one from caller tensors). Like libpipe, it
// writes a temporary file next to path and renames it, so a failed write never leaves a
// truncated file at path. Names must be unique and non-empty.
func WriteSafetensors(path string, tensors TensorList) error {
	const op = "WriteSafetensors"
	var header bytes.Buffer
	header.WriteByte('{')
	seen := make(map[string]bool, len(tensors))
	offset := 0
	for i, e := range tensors {
		if e.Name == "" || e.Name == "__metadata__" || seen[e.Name] {
			return errorf(op, StatusInvalidArgument, "tensor %d: name %q is empty, reserved or repeated", i, e.Name)
		}
		seen[e.Name] = true
		if e.Tensor == nil {
			return errorf(op, StatusInvalidArgument, "tensor %q is nil", e.Name)
		}
		info, ok := dtypes[e.Tensor.dtype]
		if !ok {
			return errorf(op, StatusInvalidArgument, "tensor %q has unknown dtype %v", e.Name, e.Tensor.dtype)
		}
		name, _ := json.Marshal(e.Name)
		shape := e.Tensor.shape
		if shape == nil {
			shape = []int64{}
		}
		shapeJSON, _ := json.Marshal(shape)
		size := len(e.Tensor.bytes())
		if i > 0 {
			header.WriteByte(',')
		}
		fmt.Fprintf(&header, `%s:{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}`,
			name, info.st, shapeJSON, offset, offset+size)
		offset += size
	}
	header.WriteByte('}')
	// The data starts 8-byte aligned, as the format recommends: pad the header with spaces.
	for (8+header.Len())%8 != 0 {
		header.WriteByte(' ')
	}

	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return errorf(op, StatusIO, "%v", err)
	}
	fail := func(err error) error {
		tmp.Close()
		os.Remove(tmp.Name())
		return errorf(op, StatusIO, "%v", err)
	}
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(header.Len()))
	if _, err := tmp.Write(n[:]); err != nil {
		return fail(err)
	}
	if _, err := tmp.Write(header.Bytes()); err != nil {
		return fail(err)
	}
	for _, e := range tensors {
		// Elements are written as they lie in memory: little-endian on every platform
		// libpipe supports (amd64, arm64).
		if _, err := tmp.Write(e.Tensor.bytes()); err != nil {
			return fail(err)
		}
	}
	if err := tmp.Chmod(0o644); err != nil {
		return fail(err)
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return errorf(op, StatusIO, "%v", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return errorf(op, StatusIO, "%v", err)
	}
	return nil
}
