// How many steps the engine keeps in the pipeline: one per stage (pipelined), or one at a time with every
// core on it, chosen by measuring both on the workload at hand.
//
// Stages in one process on the CPU share the machine's cores (a core per stage; an idle stage's core is lent
// to the busy one, stage/spare_cores.h). Pipelined, each stage streams its half of the weights on its own
// core for its half of the sequences: every step in flight reads the weights once. One at a time, all the
// sequences go in one step and every core works on each stage in turn (one thread runs the step's stages, the
// others lent to it: Session::runs_alone): the weights are read once per round, on all cores together. A decode step of
// few rows is bound by memory bandwidth, where one at a time wins (two cores reading one layer together read faster
// than each reading its own stage, bench/RESULTS.md); a prefill step of many tokens is bound by arithmetic, where
// pipelining loses nothing to the hand-overs and the lent cores' synchronisation. Where the turning point lies depends
// on the CPU, the model and the mix, so the policy measures instead of guessing.
//
// It runs windows of consecutive steps under one limit and measures tokens (prompt and decode, as the steps
// carried them) per second over each window, from the completion of its first step to that of its last (the
// first step's wait is the hand-over from the previous window's limit). Windows are classified by the
// workload they start in (sequences holding a slot, in powers of two, and whether prompts are waiting): each
// class learns each limit's rate (a moving average), tries a limit it has not measured, then keeps the faster
// one, and tries the other again after kExploreEvery windows, so that it follows a workload that changes. Each
// try that finds the same limit faster doubles the wait before the next (up to kExploreEvery << kMaxBackoff):
// a slower limit costs its windows (one of 1B Llama's decode steps pipelined at 8 sequences ran 1.45x slower
// than one at a time), and a steady workload need not keep paying for the proof.
// A pure state machine: the engine calls it with what it launched and what completed, and asks limit().
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <utility>

namespace libpipe::generate {

class InFlightPolicy {
 public:
  static constexpr int kExploreEvery = 8;       // windows before the slower limit is tried again, at first
  static constexpr int kMaxBackoff = 3;         // ... and at most kExploreEvery << kMaxBackoff
  static constexpr int64_t kStepsPerRound = 4;  // a window is this many steps per stage, at least 4 of them

  // `most`: the steps that keep every stage busy (Session::concurrent_stages()); `adaptive`: whether the stages
  // share this process's cores (otherwise the limit is always `most`).
  InFlightPolicy(int64_t most, bool adaptive);

  // The steps that may be in flight now, for a workload of `active` sequences holding slots (`prompts_waiting`:
  // whether any of them still has prompt tokens to prefill). Opens a window, choosing its limit, if none is open.
  int64_t limit(int64_t active, bool prompts_waiting);
  int64_t current_limit() const { return limit_; }
  bool adaptive() const { return adaptive_; }

  // A step carrying `tokens` tokens was launched under the current limit.
  void launched(uint64_t step, int64_t tokens);
  // Step `step` completed at `when` (in any order; steps outside the open window are ignored).
  void completed(uint64_t step, std::chrono::steady_clock::time_point when);
  // Nothing is in flight and nothing is ready: a window still open would time the idle gap, so it is dropped.
  void idle();

  // Steps measured per window: kStepsPerRound per stage, at least 4.
  int64_t window_size() const;

  // Steps launched under each limit, for the statistics: one at a time, pipelined.
  uint64_t steps_one_at_a_time() const { return one_at_a_time_; }
  uint64_t steps_pipelined() const { return pipelined_; }

  // The measured rate (tokens/s) of `limit` in the class of `active` and `prompts_waiting`; 0 if not measured.
  double rate(int64_t active, bool prompts_waiting, int64_t limit) const;

 private:
  using Class = std::pair<int, bool>;  // log2 bucket of active sequences, prompts waiting
  static Class class_of(int64_t active, bool prompts_waiting);
  void end_window(std::chrono::steady_clock::time_point when);
  int64_t choose(const Class& c);

  struct Rates {
    double rate[2] = {0, 0};  // [0]: one at a time, [1]: pipelined
    int windows = 0;
    int next_try = 0;       // the window at which the slower limit runs again
    int confirmations = 0;  // tries in a row that found the same limit faster
    int exploring = -1;     // the limit index the open window tries against the faster one, or -1
  };

  const int64_t most_;
  const bool adaptive_;
  int64_t limit_;
  std::map<Class, Rates> rates_;

  // The open window: its first `size` launched steps are measured.
  bool open_ = false;
  Class class_{0, false};
  uint64_t first_step_ = 0;
  int64_t launched_ = 0, completed_ = 0;
  int64_t tokens_after_first_ = 0;  // tokens of its steps after the first (those timed)
  bool first_done_ = false;
  std::chrono::steady_clock::time_point first_done_at_{};
  std::map<uint64_t, int64_t> pending_;  // its steps in flight: id -> tokens
  uint64_t one_at_a_time_ = 0, pipelined_ = 0;
};

}  // namespace libpipe::generate
