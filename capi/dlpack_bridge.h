// Conversions between DLPack and ATen tensors, using ATen's own converter.
//
// pipe.h exposes DLPack through Debian's <dlpack/dlpack.h> (v0.6) so consumers need no LibTorch
// header, while ATen's converter is declared against the DLPack copy LibTorch ships (v1.x). Both
// define DLManagedTensor with the same layout (the legacy, unversioned struct; each side checks
// the layout with static_asserts), but the two headers cannot meet in one translation unit. So
// the converter lives in its own file and this interface passes the struct as void*.
#pragma once

#include <ATen/Tensor.h>

namespace libpipe::capi {

// A tensor viewing the caller's memory; the DLPack deleter is never called (the caller keeps
// ownership). Throws c10::Error for a DLPack tensor ATen cannot represent.
at::Tensor tensor_from_borrowed_dlpack(const void* managed_tensor);

// A new DLManagedTensor owning a reference to `tensor`; freed by calling its deleter.
void* tensor_to_dlpack(const at::Tensor& tensor);

}  // namespace libpipe::capi
