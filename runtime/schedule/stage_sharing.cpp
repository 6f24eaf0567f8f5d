#include "runtime/schedule/stage_sharing.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "runtime/error.h"

namespace libpipe::schedule {

namespace {

// Weight of the newest micro-batch in a stage's ratio: a few micro-batches follow a change of the machine's load.
constexpr double kNewest = 0.25;
// How far a cut may move from the worker's share of a micro-batch, as a part of the micro-batch's time.
constexpr double kMargin = 0.125;

}  // namespace

StageSharing::StageSharing(size_t stages, size_t workers)
    : stages_(stages),
      workers_(workers),
      passed_(new std::atomic<uint64_t>[stages]),
      ratio_(new std::atomic<double>[kClasses * stages]),
      holding_(new std::atomic<int>[workers]) {
  if (workers < 1 || workers > stages)
    throw Error(Status::Internal, "stage sharing needs 1 .. stages workers, got " + std::to_string(workers) + " for " +
                                      std::to_string(stages) + " stages");
  for (size_t s = 0; s < stages; ++s) passed_[s] = 0;
  for (size_t i = 0; i < kClasses * stages; ++i) ratio_[i] = 0;
  for (size_t w = 0; w < workers; ++w) holding_[w] = 0;
}

int StageSharing::owner(size_t stage) const {
  if (stage == 0) return 0;
  if (stage + 1 == stages_) return static_cast<int>(workers_ - 1);
  return shares() ? -1 : static_cast<int>(stage);
}

size_t StageSharing::class_of(double first_ns) {
  const double us = std::max(first_ns / 1e3, 1.0);
  return std::min(static_cast<size_t>(2 * std::log2(us)), kClasses - 1);
}

void StageSharing::passed(size_t stage, double ns, Ticket& ticket) {
  if (stage == 0) ticket.first_ns = ns;
  ticket.done_ns += ns;
  if (ticket.first_ns > 0) {
    // One micro-batch at a time runs a stage (keep() orders them), so load and store do.
    std::atomic<double>& r = ratio(class_of(ticket.first_ns), stage);
    const double now = ns / ticket.first_ns, before = r.load(std::memory_order_relaxed);
    r.store(before > 0 ? before + kNewest * (now - before) : now, std::memory_order_relaxed);
  }
  passed_[stage].fetch_add(1, std::memory_order_release);
}

double StageSharing::estimate_ns(size_t stage, const Ticket& ticket) const {
  if (ticket.first_ns <= 0) return -1;
  if (stage == 0) return ticket.first_ns;
  // The nearest class that has seen the stage (a step of a new size borrows its neighbours' shape).
  const size_t cls = class_of(ticket.first_ns);
  for (size_t d = 0; d < kClasses; ++d) {
    for (const size_t c : {cls - d, cls + d}) {
      if (c >= kClasses) continue;  // below 0 wraps around too
      const double r = ratio(c, stage).load(std::memory_order_relaxed);
      if (r > 0) return r * ticket.first_ns;
    }
  }
  return -1;
}

bool StageSharing::keep(size_t w, size_t next, const Ticket& ticket) const {
  if (w + 1 >= workers_) return next < stages_;  // the last worker runs everything to the end
  if (next > last_stage(w)) return false;
  // Every earlier micro-batch must have passed `next` (one may still wait for it in the next worker's queue).
  if (passed_[next].load(std::memory_order_acquire) != ticket.order) return false;
  double ahead = 0, cost = 0;
  bool known = true;
  for (size_t s = next; s < stages_ && known; ++s) {
    const double e = estimate_ns(s, ticket);
    known = e >= 0;
    ahead += e;
    if (s == next) cost = e;
  }
  const double share = static_cast<double>(w + 1) / static_cast<double>(workers_);
  // Until micro-batches like this one have run every stage, the stages count as equal and the share decides.
  if (!known) return static_cast<double>(next) + 0.5 <= static_cast<double>(stages_) * share;
  // Kept while the next worker has work and the stage's middle stays within a margin above w's share of the
  // micro-batch's time; handed on once the next worker runs out of work (or the margin is used up), unless the stage
  // lies a margin below the share. Handing over while the next worker is busy leaves w waiting (its next micro-batch
  // comes back from there); keeping while it is idle leaves that one waiting. The margin absorbs how the stages'
  // times vary from one micro-batch to the next; without a bound the cuts of two micro-batches that alternate drift
  // apart until one can go no further (only the last worker may run the last stage).
  const double total = ticket.done_ns + ahead;
  const double middle = ticket.done_ns + cost / 2, goal = total * share, margin = total * kMargin;
  if (middle <= goal - margin) return true;
  return middle <= goal + margin && holds_work(w + 1);
}

}  // namespace libpipe::schedule
