// libFuzzer target: a message as a peer process sends it (preamble, tensor headers, text and pickled
// structure, tensor bytes) through the checks and the decoder every transport between processes uses
// (runtime/comm/wire.h). Every input must be decoded or refused with libpipe's Error before anything it
// announces is allocated beyond the limits; anything else escaping, or a crash, is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/comm/wire.h"
#include "runtime/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace libpipe::comm;
  // Small limits: the target must not allocate what a real receiver would allow.
  wire::Limits limits;
  limits.max_meta_words = 256;
  limits.max_small_bytes = 1 << 16;
  limits.max_tensor_bytes = 1 << 20;
  wire::Preamble preamble{};
  if (size < sizeof preamble) return 0;
  std::memcpy(preamble.data(), data, sizeof preamble);
  data += sizeof preamble;
  size -= sizeof preamble;
  try {
    const auto sizes = wire::announced(preamble, limits);
    const size_t meta_bytes = sizes.meta_words * sizeof(int64_t);
    if (size < meta_bytes + sizes.bytes) return 0;  // a real receiver would wait for the rest
    std::vector<int64_t> meta(sizes.meta_words);
    if (meta_bytes) std::memcpy(meta.data(), data, meta_bytes);
    std::vector<uint8_t> bytes(data + meta_bytes, data + meta_bytes + sizes.bytes);
    data += meta_bytes + sizes.bytes;
    size -= meta_bytes + sizes.bytes;
    auto tensors = wire::allocate(meta, at::TensorOptions(), limits);
    for (auto& t : tensors) {  // filled from what is left, zeros past it
      const size_t n = static_cast<size_t>(t.nbytes());
      if (n == 0) continue;
      auto* out = static_cast<uint8_t*>(t.data_ptr());
      const size_t take = n < size ? n : size;
      if (take) std::memcpy(out, data, take);
      std::memset(out + take, 0, n - take);
      data += take;
      size -= take;
    }
    wire::decode(preamble, bytes, std::move(tensors));
  } catch (const libpipe::Error&) {}
  return 0;
}
