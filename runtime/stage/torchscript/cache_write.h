// Writes of keys and values into a KV cache, as one copy per token and head.
//
// A decoder that follows the decoder contract (libpipe.decoders.cache.write_packed) writes each step's
// keys and values with advanced indexing:
//   k_cache[where, :, at] = k.to(k_cache.dtype)          (k: [N, kv_heads, head_dim])
// which compiles to aten::index_put_(k_cache[:, :], [where, None, at], k, False): ATen's generic
// indexing machinery (index tensors broadcast, a TensorIterator built) for N x kv_heads rows of
// head_dim elements, about 10 us a call, two calls per layer: 5% of a one-sequence decode step
// (bench/step_breakdown.py). fuse_cache_writes rewrites that pattern in a stage's forward into
// pipe::cache_write_(cache, where, at, values), which copies the rows where they go; where its
// preconditions do not hold (another layout, dtype or device, an index out of range or negative) it
// calls index_put_ itself, with index_put_'s result or error. LIBPIPE_CACHE_WRITE=0 leaves stages as
// they are.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

namespace libpipe::stage {

// Call before the stage's first run. Returns the number of writes rewritten.
size_t fuse_cache_writes(torch::jit::Module& stage);

// The op itself: cache.index_put_({where, None, at}, values) for a cache [slots, heads, length, dim]; returns cache.
at::Tensor& cache_write_(at::Tensor& cache, const at::Tensor& where, const at::Tensor& at, const at::Tensor& values);

}  // namespace libpipe::stage
