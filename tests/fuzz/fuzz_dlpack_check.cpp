// libFuzzer target: a DLPack tensor as a caller of the C ABI may hand it (any rank, shape, strides,
// byte offset and dtype) through the checks the C boundary makes (capi/dlpack_check.h). Every input must be
// accepted or refused without undefined behaviour in the check; an accepted tensor whose extent fits the
// buffer behind it is then read by LibTorch (a copy), which must stay inside that buffer (AddressSanitizer
// watches) and may only fail with its own error: the check's arithmetic is what keeps the reads in bounds.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

#include "capi/dlpack_bridge.h"
#include "capi/dlpack_check.h"

namespace {

template <typename T>
bool take(const uint8_t*& data, size_t& size, T& out) {
  if (size < sizeof(T)) return false;
  std::memcpy(&out, data, sizeof(T));
  data += sizeof(T);
  size -= sizeof(T);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  DLManagedTensor t{};
  int8_t ndim = 0;
  uint8_t code = 0, bits = 0, with_strides = 0;
  uint16_t lanes = 0, offset = 0;
  if (!take(data, size, ndim) || !take(data, size, code) || !take(data, size, bits) || !take(data, size, lanes) ||
      !take(data, size, offset) || !take(data, size, with_strides))
    return 0;
  t.dl_tensor.ndim = ndim;
  t.dl_tensor.dtype.code = code % 6;
  t.dl_tensor.dtype.bits = bits;
  t.dl_tensor.dtype.lanes = lanes;
  t.dl_tensor.byte_offset = offset;
  t.dl_tensor.device.device_type = kDLCPU;
  std::vector<int64_t> shape(ndim > 0 ? ndim : 0), strides(shape.size());
  for (auto& d : shape)
    if (!take(data, size, d)) return 0;
  if (with_strides & 1)
    for (auto& s : strides)
      if (!take(data, size, s)) return 0;
  t.dl_tensor.shape = (with_strides & 2) ? nullptr : shape.data();
  t.dl_tensor.strides = (with_strides & 1) ? strides.data() : nullptr;
  // What is left is the buffer the tensor points into (NULL when empty, as a caller might pass).
  std::vector<uint8_t> buffer(data, data + size);
  t.dl_tensor.data = buffer.empty() ? nullptr : buffer.data();
  if (!libpipe::capi::dlpack_problem(t).empty()) return 0;
  // Accepted: read it only where its extent fits the buffer (the check cannot know the buffer's size).
  uint64_t elements = 1, last = 0;
  for (int i = 0; i < t.dl_tensor.ndim; ++i) elements *= static_cast<uint64_t>(t.dl_tensor.shape[i]);
  if (elements == 0 || !t.dl_tensor.data) return 0;
  for (int i = 0; i < t.dl_tensor.ndim; ++i)
    last += static_cast<uint64_t>(t.dl_tensor.shape[i] - 1) *
            static_cast<uint64_t>(t.dl_tensor.strides ? t.dl_tensor.strides[i] : 1);
  if (!t.dl_tensor.strides) last = elements - 1;
  const uint64_t end = t.dl_tensor.byte_offset + (last + 1) * (t.dl_tensor.dtype.bits / 8);
  // A broadcast tensor (stride 0) reads little but is copied whole: keep the copy to what a test may allocate.
  if (end > buffer.size() || elements * (t.dl_tensor.dtype.bits / 8) > (uint64_t{1} << 26)) return 0;
  try {
    libpipe::capi::tensor_from_borrowed_dlpack(&t).clone();
  } catch (const c10::Error&) {}
  return 0;
}
