#include "capi/dlpack_bridge.h"

#include <ATen/DLConvertor.h>

#include <cstddef>

namespace libpipe::capi {

// The layout pipe.h's DLManagedTensor has on LP64 (checked by the same asserts in boundary.cpp).
static_assert(sizeof(DLTensor) == 48 && offsetof(DLTensor, shape) == 24 && offsetof(DLTensor, byte_offset) == 40,
              "LibTorch's DLTensor layout differs from DLPack 0.6");
static_assert(sizeof(DLManagedTensor) == 64 && offsetof(DLManagedTensor, deleter) == 56,
              "LibTorch's DLManagedTensor layout differs from DLPack 0.6");

at::Tensor tensor_from_borrowed_dlpack(const void* managed_tensor) {
  auto* src = const_cast<DLManagedTensor*>(static_cast<const DLManagedTensor*>(managed_tensor));
  return at::fromDLPack(src, [](void*) {});
}

void* tensor_to_dlpack(const at::Tensor& tensor) { return at::toDLPack(tensor); }

}  // namespace libpipe::capi
