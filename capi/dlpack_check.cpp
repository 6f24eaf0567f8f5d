#include "capi/dlpack_check.h"

#include <cstdint>
#include <limits>

namespace libpipe::capi {

namespace {

// a * b into `out`, false on overflow (both non-negative).
bool multiply(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }
bool add(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_add_overflow(a, b, &out); }

}  // namespace

std::string dlpack_problem(const DLManagedTensor& managed) {
  const DLTensor& t = managed.dl_tensor;
  if (t.ndim < 0 || t.ndim > kMaxDlpackRank)
    return "its ndim is " + std::to_string(t.ndim) + " (0 .. " + std::to_string(kMaxDlpackRank) + " allowed)";
  if (t.ndim > 0 && !t.shape) return "its shape is NULL but ndim is " + std::to_string(t.ndim);
  if (t.dtype.lanes != 1) return "its dtype has " + std::to_string(t.dtype.lanes) + " lanes (only 1 is supported)";
  if (t.dtype.bits == 0 || t.dtype.bits % 8 != 0)
    return "its dtype has " + std::to_string(t.dtype.bits) + " bits (a whole number of bytes is needed)";
  const uint64_t item = t.dtype.bits / 8;
  uint64_t elements = 1;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return "shape[" + std::to_string(i) + "] is " + std::to_string(t.shape[i]);
    if (!multiply(elements, static_cast<uint64_t>(t.shape[i]), elements))
      return "its shape's element count overflows 64 bits";
  }
  uint64_t bytes = 0;  // what a dense copy of it takes (a broadcast tensor reads less, but is copied whole)
  if (!multiply(elements, item, bytes) || bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return "its size in bytes overflows 63 bits";
  if (elements == 0) return "";  // nothing is read
  if (!t.data) return "its data is NULL but it has " + std::to_string(elements) + " elements";
  // The largest element index the strides reach (compact row-major without strides).
  uint64_t last = 0;
  if (t.strides) {
    for (int i = 0; i < t.ndim; ++i) {
      if (t.strides[i] < 0)
        return "strides[" + std::to_string(i) + "] is " + std::to_string(t.strides[i]) +
               " (negative strides are not supported)";
      uint64_t reach = 0;
      if (!multiply(static_cast<uint64_t>(t.shape[i] - 1), static_cast<uint64_t>(t.strides[i]), reach) ||
          !add(last, reach, last))
        return "its strides reach past what 64 bits can address";
    }
  } else {
    last = elements - 1;
  }
  uint64_t end = 0;  // one past the last byte read, from data
  if (!add(last, 1, end) || !multiply(end, item, end) || !add(end, t.byte_offset, end) ||
      end > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return "its byte_offset and strides reach past what 64 bits can address";
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  if (base + end < base) return "its byte_offset and strides wrap around the address space from its data pointer";
  return "";
}

}  // namespace libpipe::capi
