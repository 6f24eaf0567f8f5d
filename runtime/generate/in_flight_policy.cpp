#include "runtime/generate/in_flight_policy.h"

#include <algorithm>

namespace libpipe::generate {

InFlightPolicy::InFlightPolicy(int64_t most, bool adaptive)
    : most_(std::max<int64_t>(most, 1)), adaptive_(adaptive && most > 1), limit_(most_) {}

InFlightPolicy::Class InFlightPolicy::class_of(int64_t active, bool prompts_waiting) {
  int bucket = 0;
  while ((int64_t{1} << bucket) < active) ++bucket;  // 1, 2, 3-4, 5-8, ...
  return {bucket, prompts_waiting};
}

int64_t InFlightPolicy::window_size() const { return std::max<int64_t>(4, kStepsPerRound * most_); }

double InFlightPolicy::rate(int64_t active, bool prompts_waiting, int64_t limit) const {
  auto it = rates_.find(class_of(active, prompts_waiting));
  return it == rates_.end() ? 0 : it->second.rate[limit > 1 ? 1 : 0];
}

int64_t InFlightPolicy::choose(const Class& c) {
  Rates& r = rates_[c];
  ++r.windows;
  r.exploring = -1;
  if (r.rate[0] == 0) return 1;
  if (r.rate[1] == 0) {
    r.next_try = r.windows + kExploreEvery;
    return most_;
  }
  const int faster = r.rate[1] > r.rate[0] ? 1 : 0;
  int pick = faster;
  if (r.windows >= r.next_try) {
    pick = 1 - faster;
    r.exploring = pick;
    r.next_try = r.windows + (kExploreEvery << std::min(r.confirmations, kMaxBackoff));
  }
  return pick ? most_ : 1;
}

int64_t InFlightPolicy::limit(int64_t active, bool prompts_waiting) {
  if (!adaptive_ || open_) return limit_;
  open_ = true;
  class_ = class_of(active, prompts_waiting);
  limit_ = choose(class_);
  first_step_ = 0;
  launched_ = completed_ = tokens_after_first_ = 0;
  first_done_ = false;
  pending_.clear();
  return limit_;
}

void InFlightPolicy::launched(uint64_t step, int64_t tokens) {
  (limit_ > 1 ? pipelined_ : one_at_a_time_)++;
  if (!open_ || launched_ >= window_size()) return;  // the window is full: later steps belong to none
  if (launched_ == 0) first_step_ = step;
  else tokens_after_first_ += tokens;
  pending_[step] = tokens;
  ++launched_;
}

void InFlightPolicy::completed(uint64_t step, std::chrono::steady_clock::time_point when) {
  if (!open_) return;
  auto it = pending_.find(step);
  if (it == pending_.end()) return;
  pending_.erase(it);
  ++completed_;
  if (step == first_step_) {
    first_done_ = true;
    first_done_at_ = when;
  }
  if (completed_ == window_size()) end_window(when);
}

void InFlightPolicy::idle() {
  open_ = false;
  pending_.clear();
}

void InFlightPolicy::end_window(std::chrono::steady_clock::time_point when) {
  open_ = false;
  const double seconds = std::chrono::duration<double>(when - first_done_at_).count();
  if (!first_done_ || seconds <= 0 || tokens_after_first_ <= 0) return;
  Rates& r = rates_[class_];
  double& slot = r.rate[limit_ > 1 ? 1 : 0];
  const double measured = static_cast<double>(tokens_after_first_) / seconds;
  slot = slot == 0 ? measured : 0.5 * slot + 0.5 * measured;
  if (r.exploring >= 0) {  // a try of the slower limit: did the faster stay faster?
    const bool confirmed = r.rate[1 - r.exploring] >= r.rate[r.exploring];
    r.confirmations = confirmed ? r.confirmations + 1 : 0;
    if (!confirmed) r.next_try = r.windows + kExploreEvery;
    r.exploring = -1;
  }
}

}  // namespace libpipe::generate
