#include "runtime/generate/step_planner.h"

#include <algorithm>
#include <numeric>

namespace libpipe::generate {

std::vector<PlannedRow> plan_step(const std::vector<ReadyRow>& ready, const StepBudget& budget) {
  std::vector<PlannedRow> rows;
  if (ready.empty()) return rows;
  const int64_t d = std::max<int64_t>(budget.steps_in_flight, 1);
  const int64_t max_rows = std::max<int64_t>(budget.max_rows, 1);
  const int64_t row_cap = std::clamp<int64_t>((budget.active + d - 1) / d, 1, max_rows);

  // Oldest first; the input order breaks ties, so equal ages keep the engine's order.
  std::vector<size_t> order(ready.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return ready[a].ready_since < ready[b].ready_since; });

  const int64_t chunk = std::max<int64_t>(budget.prefill_chunk, 1);
  // The width of a waiting prompt's chunk when it may take `room` tokens: each prompt's own in a mixed step, the
  // oldest prompt's (which the others share) in a padded one.
  const auto chunk_width = [&](const ReadyRow& r, int64_t room) {
    int64_t width = std::min(r.remaining, room);
    // Fewer sequences than steps in flight: a prompt in one step would cross the stages alone, one busy and the
    // others idle. Cut into chunks that follow each other through the pipeline, its stages work at once.
    if (budget.active < d) width = std::min(width, std::max(kMinPipelinedChunk, (r.remaining + d - 1) / d));
    return width;
  };

  if (budget.mixed) {
    // Decode rows first (they never wait behind a prompt), then prompt chunks in the step's remaining token budget.
    int64_t tokens = 0;
    for (size_t i : order) {
      if (static_cast<int64_t>(rows.size()) >= row_cap) break;
      const ReadyRow& r = ready[i];
      if (r.remaining == 0) {
        rows.push_back({r.sequence, r.slot, r.cached, 1, true});
        ++tokens;
      }
    }
    int64_t room = std::max(chunk - tokens, std::min(chunk, kMinPipelinedChunk));
    // Each prompt takes what the budget still holds: nothing is padded, so the chunks need not share a width. (Cut to
    // the oldest prompt's width, the prompts behind one with a token or two left went a token or two a step: 32
    // prompts of 128 tokens beside their decode rows took 15 more steps of prefill.)
    for (size_t i : order) {
      if (static_cast<int64_t>(rows.size()) >= max_rows || room <= 0) break;
      const ReadyRow& r = ready[i];
      if (r.remaining <= 0) continue;
      const int64_t length = chunk_width(r, room);
      rows.push_back({r.sequence, r.slot, r.cached, length, length == r.remaining});
      room -= length;
    }
    return rows;
  }

  // One kind of row per step. Rows are right-padded to the longest, so a decode row beside a prompt chunk of T
  // tokens costs T positions of compute in every layer for its one token: mixing them multiplies the work of the
  // step (16 decode rows beside a 240-token chunk compute 3,840 positions for 256 tokens). The oldest ready row
  // decides the kind, so prompts and decoding are served first come, first served and neither starves: decode
  // rows that return after a prompt became ready wait behind it, and the prompt waits behind those before it.
  if (ready[order.front()].remaining == 0) {
    for (size_t i : order) {
      if (static_cast<int64_t>(rows.size()) >= row_cap) break;
      const ReadyRow& r = ready[i];
      if (r.remaining == 0) rows.push_back({r.sequence, r.slot, r.cached, 1, true});
    }
    return rows;
  }
  // A prefill step: the oldest prompt sets the padded width (its remaining tokens, at most prefill_chunk); the next
  // prompts join, cut to that width, while the padded step (rows x width) stays within prefill_chunk. A prompt
  // longer than the width is cut, and its next chunk starts where this one ends (start = cached).
  int64_t width = 0;
  for (size_t i : order) {
    if (static_cast<int64_t>(rows.size()) >= row_cap) break;
    const ReadyRow& r = ready[i];
    if (r.remaining <= 0) continue;
    if (width == 0) {
      width = chunk_width(r, chunk);
    } else if ((static_cast<int64_t>(rows.size()) + 1) * width > chunk) {
      break;
    }
    const int64_t length = std::min(r.remaining, width);
    rows.push_back({r.sequence, r.slot, r.cached, length, length == r.remaining});
  }
  return rows;
}

}  // namespace libpipe::generate
