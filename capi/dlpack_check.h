// What the C boundary checks in a DLPack tensor a caller hands it, before LibTorch reads it.
//
// at::fromDLPack trusts the struct: a negative rank, a NULL shape or data pointer with elements, a negative
// size, or strides whose extent overflows would be read as they are, and the memory behind them with them.
// DLPack carries no buffer size, so "outside the buffer" can only be checked as far as arithmetic goes: the
// offset of the last element (byte_offset + the strides' extent) must be computable without overflow, and
// the address it lands on must not wrap around. Plain C++ over Debian's <dlpack/dlpack.h>, so that a fuzz
// target can drive it without the C ABI.
#pragma once

#include <dlpack/dlpack.h>

#include <string>

namespace libpipe::capi {

// The rank a tensor may have here (LibTorch's own limit is larger; no model needs more).
constexpr int kMaxDlpackRank = 64;

// "" when `tensor` is a DLPack tensor libpipe may hand to LibTorch, else what is wrong with it, naming the
// field (e.g. "its shape is NULL but ndim is 2"). `tensor` must not be NULL.
std::string dlpack_problem(const DLManagedTensor& tensor);

}  // namespace libpipe::capi
