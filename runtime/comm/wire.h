// The wire format shared by the transports between processes. A message consists of four parts, in
// this order (a transport may pack the small first three into fewer transfers):
//   1. the preamble: kPreambleWords int64 (magic, kind, request, micro-batch, status, text bytes,
//      pickle bytes, meta words);
//   2. the meta, int64 (when meta words > 0): per tensor its dtype, rank and sizes, so the
//      receiver can allocate it (batch size and sequence length may change every message);
//   3. the bytes, uint8 (when > 0): the text, then the pickled structure of `values` in which each
//      tensor is a reference into the tensor table (torch::jit::pickle with a tensor table), so
//      tuples, lists, dicts, ints and None travel as they are;
//   4. each tensor of the table with at least one byte, as its raw contiguous bytes.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

#include "runtime/comm/transport.h"

namespace libpipe::comm::wire {

constexpr size_t kPreambleWords = 8;
using Preamble = std::array<int64_t, kPreambleWords>;

struct Frame {
  Preamble preamble{};
  std::vector<int64_t> meta;
  std::vector<uint8_t> bytes;
  std::vector<at::Tensor> tensors;  // contiguous, on the device they were on
};

// Throws Error(Unsupported) for a tensor that cannot travel (sparse, quantized, ...).
Frame encode(const Message& message);

// What a receiver accepts before it allocates anything. A peer holds the session's secret (the transports
// authenticate every connection), so these bounds guard against a broken or mismatched peer rather than a
// stranger; still nothing a frame announces is allocated before it is checked against them.
struct Limits {
  size_t max_meta_words = size_t{1} << 16;        // 16 K tensors' headers at most (dtype, rank, sizes)
  size_t max_small_bytes = size_t{64} << 20;      // text and pickled structure together
  int64_t max_rank = 64;                          // dimensions of one tensor
  uint64_t max_tensor_bytes = uint64_t{1} << 40;  // every tensor of one message together
};
// The process's limits: the defaults, with LIBPIPE_MAX_MESSAGE_BYTES (the tensors of one message; default
// 1 TiB, for stages shipped with their weights) read once.
const Limits& limits();

// What the preamble announces. Throws Error(Communication) for a preamble that is not libpipe's
// (a peer from another program or version), negative sizes, or sizes beyond `limits`.
struct Announced {
  size_t meta_words = 0;
  size_t bytes = 0;
};
Announced announced(const Preamble& preamble, const Limits& limits = wire::limits());

// Empty tensors shaped as `meta` describes, with `options` (device), to receive into. Throws
// Error(Communication) for malformed meta: an unknown dtype, a rank or size out of range, sizes whose
// product overflows, or more bytes in all than limits.max_tensor_bytes.
std::vector<at::Tensor> allocate(const std::vector<int64_t>& meta, const at::TensorOptions& options,
                                 const Limits& limits = wire::limits());

// The message, from what was received (tensors as allocate() made them, then filled).
Message decode(const Preamble& preamble, const std::vector<uint8_t>& bytes, std::vector<at::Tensor> tensors);

// A flat uint8 view of a contiguous tensor's bytes (what step 4 sends and receives into).
at::Tensor byte_view(const at::Tensor& tensor);

}  // namespace libpipe::comm::wire
