// Attention straight from a KV cache, without gathering it.
//
// A decoder that follows the decoder contract (pipe.h, "Generation"; libpipe.decoders) attends over
// each row's cache slot by gathering the slots first:
//   keys = k_cache.narrow(2, 0, context).index_select(0, slots)      (and the same for values)
//   out  = scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=s, enable_gqa=...)
// The gather copies B x kv_heads x context x head_dim per layer twice, and SDPA then runs its
// generic path on the copy with a boolean mask; with 32 sequences that is a third of a decode
// step (bench/step_breakdown.py, bench/RESULTS.md). fuse_cache_attention rewrites that pattern in a
// stage's forward into pipe::cache_attention(q, k_cache, v_cache, slots, context, mask, s, gqa),
// which multiplies each row's queries by its slot's keys and values where they lie in the cache
// (two batched GEMMs, MKL's cblas_sgemm_batch, with a masked softmax between them): the same
// result as the pattern up to float32 rounding, for prompt chunks (T > 1) and single tokens alike,
// masks of any form (causal, sliding window) included. Where its preconditions do not hold
// (another dtype or device, a mask that is not boolean, a LibTorch without MKL) the op computes the
// original pattern. LIBPIPE_CACHE_ATTENTION=0 leaves stages as they are.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include <optional>

namespace libpipe::stage {

// Call after the stage's weights are loaded and placed, before its first run. Returns the number of
// attention calls rewritten.
size_t fuse_cache_attention(torch::jit::Module& stage);

// The op itself: scaled_dot_product_attention(query, k_cache.narrow(2, 0, context).index_select(0, slots),
// v_cache.narrow(2, 0, context).index_select(0, slots), mask, 0.0, false, scale, enable_gqa).
at::Tensor cache_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, int64_t context, const std::optional<at::Tensor>& mask,
                           std::optional<double> scale, bool enable_gqa);

}  // namespace libpipe::stage
