// Stage sharing: a pipeline of more CPU stages than cores, in one process, runs on one worker thread per core, and
// the stages between two workers' fixed ones go to whichever of the two would otherwise wait.
//
// Why: with a fixed cut, each stage's share of a step changes with the work (a decode step of 4 rows spends a quarter
// of the second stage's time in a language model's head; a step of long contexts spends more in the first stage's
// attention), so with as many steps in flight as stages the faster stage waits for the slower one every step. One
// thread per stage on fewer cores does not help either (measured: fewer tokens/s than two stages): the threads'
// hand-overs land on busy cores. Here worker w of W runs stages w .. N-W+w: worker 0 always runs stage 0, the last
// worker always the last stage, and after each stage a worker either keeps the micro-batch for the next stage or
// hands it to the next worker (StageSharing::keep says which).
//
// Order: every stage still runs micro-batches in the order they entered the pipeline (a generation engine relies on
// it: a prompt's next chunk may follow the previous one in, and must find its keys and values in the caches). A
// micro-batch gets its place when worker 0 takes it; a worker keeps one for the next stage only if every earlier one
// has passed that stage, otherwise hands it on behind them (each worker's queue is FIFO and it receives from one
// worker only, so handed-on micro-batches stay in order).
//
// Estimates: the stages still ahead of a micro-batch are estimated from its own first stage's time, times each
// stage's ratio to the first stage in earlier micro-batches of about the same first-stage time (half-octave classes).
// Why not each stage's recent average: steps of different kinds alternate (a 256-token prefill step takes ten times
// a decode step, and its share in the last stage is smaller), and an average of the last few steps misjudged the
// first prefill step after decode ones by its whole size (measured: the first worker handed it on, then waited
// 300 ms for it).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace libpipe::schedule {

class StageSharing {
 public:
  // What a micro-batch carries for the order.
  struct Ticket {
    uint64_t order = 0;   // its place in the pipeline (worker 0 gives it)
    double first_ns = 0;  // its time in stage 0 (0 until it ran there)
    double done_ns = 0;   // its time in the stages it ran so far
  };

  // `stages` run on `workers` threads (1 <= workers <= stages); workers == stages is the plain pipeline: worker w runs
  // stage w only and nothing is shared.
  StageSharing(size_t stages, size_t workers);

  size_t stages() const { return stages_; }
  size_t workers() const { return workers_; }
  bool shares() const { return workers_ < stages_; }
  // The stages worker w may run: first_stage(w) .. last_stage(w).
  size_t first_stage(size_t w) const { return w; }
  size_t last_stage(size_t w) const { return stages_ - workers_ + w; }
  // The worker that always runs a stage, or -1 for a shared one (its statistics report that worker's waiting).
  int owner(size_t stage) const;

  // Worker 0 takes a new micro-batch (for stage 0): its place in the order. Worker 0's thread only.
  uint64_t enter() { return next_order_++; }
  // Worker w is given a micro-batch (queued), and is done with one (handed on or finished).
  void given(size_t w) { holding_[w].fetch_add(1, std::memory_order_relaxed); }
  void done(size_t w) { holding_[w].fetch_sub(1, std::memory_order_relaxed); }
  // Stage `stage` is done with the micro-batch: it ran in `ns` (recorded in the ticket), or was passed over (a failed
  // call).
  void passed(size_t stage, double ns, Ticket& ticket);
  void passed_over(size_t stage) { passed_[stage].fetch_add(1, std::memory_order_release); }
  // Whether worker w, done with stage next-1 of the micro-batch, runs stage `next` itself.
  bool keep(size_t w, size_t next, const Ticket& ticket) const;

  // The micro-batch's expected time in `stage` (ns), or a negative number while no micro-batch like it ran there.
  double estimate_ns(size_t stage, const Ticket& ticket) const;

 private:
  static constexpr size_t kClasses = 64;  // half-octaves of a first stage's time in microseconds
  static size_t class_of(double first_ns);
  std::atomic<double>& ratio(size_t cls, size_t stage) const { return ratio_[cls * stages_ + stage]; }
  bool holds_work(size_t w) const { return holding_[w].load(std::memory_order_relaxed) > 0; }

  const size_t stages_, workers_;
  uint64_t next_order_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> passed_;  // per stage: micro-batches that passed it
  // Per class of first-stage time and stage: a moving average of the stage's time over the first stage's (0: none).
  std::unique_ptr<std::atomic<double>[]> ratio_;
  std::unique_ptr<std::atomic<int>[]> holding_;  // per worker: micro-batches queued or in hand
};

}  // namespace libpipe::schedule
