// Decode steps padded to the few shapes a GPU stage records as CUDA graphs (stage/graphed_stage.h).
//
// A graph replays one shape: its rows and, through the attention mask, the longest context among them. Left as they
// come, decode steps would take a new shape at almost every step (the context grows by one each time), so an
// engine whose stages may record graphs pads each decode step: to 2^k + 1 rows (2, 3, 5, 9, 17, ...), and with
// a longest context that is a multiple of kContextBucket. The padding rows hold token 0, one token each, in free
// cache slots, at the bucket's last position: the first of them makes the bucket the step's longest context (the
// decoder reads the context from the rows' ends, so no change to the decoder contract is needed), and every step
// has at least one. They write one cache entry of a free slot each (whose kept tokens for prefix reuse are cut
// there), and their logits are never read.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace libpipe::generate {

// Attention contexts go up in steps of this many positions (capped at the caches' length).
constexpr int64_t kContextBucket = 256;

// The rows a step of `rows` decode rows is padded to: the smallest 2^k + 1 above `rows`.
int64_t padded_rows(int64_t rows);

// The longest context a step is padded to: `context` rounded up to a multiple of kContextBucket, at most max_len.
int64_t padded_context(int64_t context, int64_t max_len);

struct DecodePadding {
  int64_t rows = 0;            // the step's rows, padding included
  int64_t start = 0;           // the padding rows' position (the padded context - 1)
  std::vector<int64_t> slots;  // the padding rows' slots, rows - the step's own rows of them
};

// The padding of a decode step of `rows` rows whose longest context (start + 1) is `context`, from the `free`
// slots, taken in their order (the engine lists first those whose kept tokens the padding costs least); nullopt when
// there are not enough free slots (the step then runs as it is, unrecorded).
std::optional<DecodePadding> pad_decode_step(int64_t rows, int64_t context, int64_t max_len,
                                             const std::vector<int64_t>& free);

}  // namespace libpipe::generate
