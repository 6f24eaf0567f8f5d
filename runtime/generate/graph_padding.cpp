#include "runtime/generate/graph_padding.h"

#include <algorithm>

namespace libpipe::generate {

int64_t padded_rows(int64_t rows) {
  int64_t power = 1;
  while (power < rows) power *= 2;
  return power + 1;
}

int64_t padded_context(int64_t context, int64_t max_len) {
  const int64_t bucket = (context + kContextBucket - 1) / kContextBucket * kContextBucket;
  return std::min(std::max(bucket, context), max_len);
}

std::optional<DecodePadding> pad_decode_step(int64_t rows, int64_t context, int64_t max_len,
                                             const std::vector<int64_t>& free) {
  DecodePadding p;
  p.rows = padded_rows(rows);
  const auto extra = static_cast<size_t>(p.rows - rows);
  if (free.size() < extra) return std::nullopt;
  p.start = padded_context(context, max_len) - 1;
  p.slots.assign(free.begin(), free.begin() + static_cast<std::ptrdiff_t>(extra));
  return p;
}

}  // namespace libpipe::generate
