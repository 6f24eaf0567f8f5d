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

  // Decode rows first: one token each, and each is a token for its caller. When a prompt waits, they leave it one
  // row (if there are two or more), so a stream of decode rows can never starve a prefill.
  const bool prompt_waits = std::any_of(ready.begin(), ready.end(), [](const ReadyRow& r) { return r.remaining > 0; });
  const int64_t decode_cap = prompt_waits && row_cap > 1 ? row_cap - 1 : row_cap;
  for (size_t i : order) {
    if (static_cast<int64_t>(rows.size()) >= decode_cap) break;
    const ReadyRow& r = ready[i];
    if (r.remaining > 0) continue;
    rows.push_back({r.sequence, r.slot, r.cached, 1, true});
  }
  // Then prompt chunks within what the decode rows left of the token budget (at least one token, so prompts always
  // advance).
  const int64_t chunk = std::max<int64_t>(budget.prefill_chunk, 1);
  int64_t budget_left = std::max<int64_t>(chunk - static_cast<int64_t>(rows.size()), 1);
  for (size_t i : order) {
    if (static_cast<int64_t>(rows.size()) >= row_cap || budget_left <= 0) break;
    const ReadyRow& r = ready[i];
    if (r.remaining <= 0) continue;
    const int64_t length = std::min(r.remaining, budget_left);
    rows.push_back({r.sequence, r.slot, r.cached, length, length == r.remaining});
    budget_left -= length;
  }
  return rows;
}

}  // namespace libpipe::generate
