// The wire format shared by the Gloo and NCCL transports. A message consists of four parts, in
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

// What the preamble announces. Throws Error(Communication) for a preamble that is not libpipe's
// (a peer from another program or version).
struct Announced {
  size_t meta_words = 0;
  size_t bytes = 0;
};
Announced announced(const Preamble& preamble);

// Empty tensors shaped as `meta` describes, with `options` (device), to receive into.
// Throws Error(Communication) for malformed meta.
std::vector<at::Tensor> allocate(const std::vector<int64_t>& meta, const at::TensorOptions& options);

// The message, from what was received (tensors as allocate() made them, then filled).
Message decode(const Preamble& preamble, const std::vector<uint8_t>& bytes, std::vector<at::Tensor> tensors);

// A flat uint8 view of a contiguous tensor's bytes (what step 4 sends and receives into).
at::Tensor byte_view(const at::Tensor& tensor);

}  // namespace libpipe::comm::wire
