// DecoderInfo: the facts of a decoder (the C ABI's "decoder contract", pipe.h) that the generation engine needs
// before its first step, read from the model: the forward's arguments and the shape of its KV caches. What only a
// step can tell (the vocabulary, the result's dtype) the engine checks with a probe step.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "runtime/graph/plan.h"

namespace libpipe::generate {

struct DecoderInfo {
  int64_t slots = 0;                  // sequences that can hold a cache slot at once: dimension 0 of every cache
  int64_t max_len = 0;                // positions per slot: dimension 2 of every cache
  int64_t vocab = 0;                  // filled by the engine's probe step: the logits' last dimension
  uint64_t cache_bytes_per_slot = 0;  // K and V of every layer, all stages, in the stages' dtype
  int64_t num_layers = 0;             // attention layers (pairs of caches)
  // The root module's optional bool attribute `skips_padding`: the forward computes the valid tokens only, so a
  // call's cost follows its tokens, not B x T, and the engine puts decode rows and prompt chunks in one step.
  bool skips_padding = false;
};

// Reads `plan`'s model: forward takes exactly (tokens, start, lengths, slots) and the model has buffers named
// "*.k_cache" and "*.v_cache" of rank 4 [slots, kv_heads, max_len, head_dim] that agree on slots and max_len.
// `stage_dtype` is the dtype the stages cast floating tensors to (SessionOptions::stage.dtype), which the caches
// then have. Throws Error(InvalidArgument) "the model does not follow the decoder contract: ..." saying what
// differs. vocab stays 0.
DecoderInfo read_decoder_info(const graph::Plan& plan, std::optional<c10::ScalarType> stage_dtype);

// The contract in one sentence, appended to every refusal so the reader knows what is expected.
extern const char* const kDecoderContract;

}  // namespace libpipe::generate
