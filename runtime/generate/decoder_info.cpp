#include "runtime/generate/decoder_info.h"

#include <c10/core/ScalarType.h>

#include "runtime/error.h"

namespace libpipe::generate {

const char* const kDecoderContract =
    "a decoder's forward takes (tokens int64[B,T], start int64[B], lengths int64[B], slots int64[B]) and returns "
    "float32 logits [B, vocab] of each row's last token, and every attention layer keeps buffers `k_cache` and "
    "`v_cache` of shape [slots, kv_heads, max_len, head_dim] that it updates in place (see pipe.h, \"Generation\"; "
    "`python -m libpipe.export_llm` writes such a model)";

namespace {

[[noreturn]] void refuse(const std::string& what) {
  throw Error(Status::InvalidArgument,
              "the model does not follow the decoder contract: " + what + ". Expected: " + kDecoderContract);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

DecoderInfo read_decoder_info(const graph::Plan& plan, std::optional<c10::ScalarType> stage_dtype) {
  const auto& names = plan.model().input_names();
  if (names.size() != 4) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    refuse("its forward takes " + std::to_string(names.size()) + " argument" + (names.size() == 1 ? "" : "s") + " (" +
           list + "), not 4");
  }
  const std::vector<graph::BufferInfo> buffers = plan.model().buffers();
  const bool skips_padding = plan.model().root_flag("skips_padding");

  DecoderInfo info;
  std::string first;  // the cache that fixed slots and max_len, for messages
  int64_t k_caches = 0, v_caches = 0;
  for (const auto& item : buffers) {
    const bool k = ends_with(item.name, ".k_cache") || item.name == "k_cache";
    const bool v = ends_with(item.name, ".v_cache") || item.name == "v_cache";
    if (!k && !v) continue;
    const auto& size = item.sizes;
    if (size.size() != 4)
      refuse("buffer '" + item.name + "' has " + std::to_string(size.size()) +
             " dimensions; a cache has 4 [slots, kv_heads, max_len, head_dim]");
    if (first.empty()) {
      first = item.name;
      info.slots = size[0];
      info.max_len = size[2];
    } else if (size[0] != info.slots || size[2] != info.max_len) {
      refuse("buffer '" + item.name + "' has " + std::to_string(size[0]) + " slots and max_len " +
             std::to_string(size[2]) + " but '" + first + "' has " + std::to_string(info.slots) + " and " +
             std::to_string(info.max_len));
    }
    const auto dtype = stage_dtype && at::isFloatingType(item.dtype) ? *stage_dtype : item.dtype;
    info.cache_bytes_per_slot += static_cast<uint64_t>(size[1] * size[2] * size[3]) * c10::elementSize(dtype);
    (k ? k_caches : v_caches)++;
  }
  if (first.empty()) refuse("it has no buffer named '*.k_cache' or '*.v_cache'");
  if (k_caches != v_caches)
    refuse("it has " + std::to_string(k_caches) + " k_cache buffers but " + std::to_string(v_caches) + " v_cache");
  if (info.slots < 1 || info.max_len < 2)
    refuse("its caches have " + std::to_string(info.slots) + " slots and max_len " + std::to_string(info.max_len) +
           " (at least 1 slot and 2 positions are needed)");
  info.num_layers = k_caches;
  info.skips_padding = skips_padding;
  return info;
}

}  // namespace libpipe::generate
