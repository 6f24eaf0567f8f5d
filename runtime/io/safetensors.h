// Reader and writer for the safetensors format: an 8-byte little-endian header length, a JSON
// header mapping each tensor name to {dtype, shape, data_offsets}, then the raw bytes.
// Used for the CLI's input/output files; every malformed file is refused with an Error that
// names the entry and the problem, before any tensor is materialised.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/named_tensor.h"

namespace libpipe::io {

// One entry of a validated header; offsets are relative to the start of the data section.
struct TensorEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Validates and parses a header (the JSON text only), given the size of the data section that
// follows it. Throws Error(InvalidFormat) naming the offending entry. Entries keep file order.
std::vector<TensorEntry> parse_safetensors_header(const std::string& header_json, uint64_t data_size);

// Reads a whole file into CPU tensors. Throws Error(NotFound) if it cannot be opened,
// Error(InvalidFormat) if it is malformed, Error(Io) if reading fails midway.
std::vector<NamedTensor> read_safetensors(const std::string& path);

// Writes tensors (any device/layout; copied to contiguous CPU as needed). Names must be unique
// and non-empty. Writes to a temporary file and renames it over `path`.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors);

}  // namespace libpipe::io
