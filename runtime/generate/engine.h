// Engine: token generation from a decoder (the decoder contract, pipe.h), with continuous batching across the
// pipeline. It owns a Session of the decoder's plan and one scheduler thread that forms steps (rows of many
// sequences: prompt chunks and single decode tokens, runtime/generate/step_planner.h), keeps up to
// steps_in_flight of them in the pipeline at once (by default one per stage, or per worker thread with shared
// stages, so that every stage is busy), samples the logits of each step that returns, hands the tokens to the
// sequences' Generations and admits queued sequences into the cache slots that finished ones free. Sequences join
// and leave between steps. No thread per sequence or per caller; over worker processes nothing changes here (the caches
// live where their layers run).
//
// Prefix reuse (llama-server's cache_prompt, vLLM's automatic prefix caching): a slot that a sequence gives back keeps
// the tokens whose keys and values it holds, and a new sequence takes the free slot whose tokens begin its prompt
// for longest (a shared system prompt, the earlier turns of a conversation), starting its prefill after them. With no
// match, the slot given back longest ago goes (least recently used). The decoder contract makes this safe: a step
// writes only its rows' positions [start, start + length) of their slots, and attends to a row's positions below its
// start and its own, so what lies beyond a slot's cached tokens is never read. EngineOptions::prefix_reuse (or
// LIBPIPE_PREFIX_REUSE=0) turns it off, for comparisons.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/generate/decoder_info.h"
#include "runtime/generate/generation.h"
#include "runtime/generate/in_flight_policy.h"
#include "runtime/generate/sampling.h"
#include "runtime/schedule/session.h"

namespace libpipe::generate {

struct EngineOptions {
  int64_t max_queued = 0;         // sequences waiting for a slot; 0: 4 x slots. One more: Error(Busy)
  int64_t prefill_chunk = 0;      // prompt tokens per step, all rows together; 0: 256
  int64_t steps_in_flight = 0;    // 0: chosen between Session::concurrent_stages() and 1 (in_flight_policy.h)
  int64_t max_rows_per_step = 0;  // 0: slots
  bool prefix_reuse = true;  // a prompt starts after the tokens a free slot holds of it (LIBPIPE_PREFIX_REUSE=0: off)
};

struct EngineStats {
  int64_t slots_in_use = 0;
  int64_t queued = 0;
  uint64_t sequences_finished = 0;
  uint64_t prompt_tokens = 0;         // prompt tokens computed (prefilled)
  uint64_t cached_prompt_tokens = 0;  // prompt tokens found in cache slots instead (prefix reuse)
  uint64_t generated_tokens = 0;
  uint64_t steps = 0;
  double tokens_per_s = 0;  // generated tokens / time during which at least one sequence held a slot
  double mean_time_to_first_token_ms = 0;
  double mean_inter_token_ms = 0;
  double mean_rows_per_step = 0;
  double sampling_ms = 0;
  int64_t steps_in_flight = 0;          // the limit now: one per stage, or 1 (in_flight_policy.h)
  uint64_t steps_one_at_a_time = 0;     // steps launched while the limit was 1
  uint64_t steps_pipelined = 0;         // steps launched while it was more
  bool steps_in_flight_chosen = false;  // the limit is chosen by measurement (not given, not fixed)
  uint64_t padded_steps = 0;            // decode steps padded to a CUDA graph's shape (graph_padding.h)
};

class Engine {
 public:
  // Builds the session (num_microbatches is ignored: a step is one micro-batch), reads the decoder's facts and
  // runs a probe step (one token in slot 0), then as many again as TorchScript's profiling executor needs before it
  // optimizes the stages (one), so that the first request does not pay for that. Throws Error(InvalidArgument) when the
  // model does not follow the decoder contract or an option is out of range, and the session's errors.
  Engine(std::shared_ptr<const graph::Plan> plan, schedule::SessionOptions session_options, EngineOptions options);
  // Cancels every sequence (their generations end with Cancelled), waits for the steps in flight, stops the
  // session.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts one sequence; never blocks. Throws Error(InvalidArgument) for an empty prompt, an id outside the
  // vocabulary, a prompt that leaves no room for a token in max_len, or bad options; Error(Busy) when max_queued
  // sequences already wait; Error(Communication) when the session is broken; Error(Cancelled) while the engine is
  // being destroyed. Thread-safe; may be called from a generation's callback.
  std::shared_ptr<Generation> submit(std::vector<int64_t> prompt, GenerationOptions options);

  const DecoderInfo& decoder() const { return decoder_; }
  const EngineOptions& options() const { return options_; }  // defaults resolved
  EngineStats stats() const;
  schedule::Session& session() { return *session_; }

 private:
  struct Sequence;
  struct Step;
  struct Notice;
  // How generations wake the engine (Generation::cancel): through this, which the engine's destructor empties, so a
  // generation that outlives its engine wakes nobody.
  struct Waker {
    std::mutex mutex;
    Engine* engine = nullptr;
  };
  struct FailedSubmit {
    uint64_t step = 0;
    Status status = Status::Ok;
    std::string message;
  };

  void probe();
  void wake();
  void scheduler_loop();
  // The scheduler's parts, with mutex_ held (those taking `lock` let go of it for a while).
  void complete_step(std::unique_lock<std::mutex>& lock, uint64_t step_id, std::vector<Notice>& notices);
  void expire_and_cancel(Clock::time_point now, std::vector<Notice>& notices);
  void end(Sequence& seq, FinishReason reason, Status status, const std::string& message, std::vector<Notice>& notices);
  void retire_ended(Clock::time_point now);
  void admit(Clock::time_point now);
  void launch_steps(std::unique_lock<std::mutex>& lock);
  void take_slot(Sequence& seq, Clock::time_point now);
  void release_slot(Sequence& seq, Clock::time_point now);
  // The free slots, in the order decode steps take them for padding rows (graph_padding.h).
  std::vector<int64_t> padding_slots() const;
  Clock::time_point next_deadline() const;
  // Without the lock: tokens and ends reach the generations, whose callbacks run here.
  static void deliver(std::vector<Notice>& notices);

  std::unique_ptr<schedule::Session> session_;
  DecoderInfo decoder_;
  bool mixed_steps_ = false;     // decode rows and prompt chunks share steps (step_planner.h)
  bool pad_for_graphs_ = false;  // decode steps padded to the shapes of CUDA graphs (graph_padding.h)
  EngineOptions options_;
  std::shared_ptr<Waker> waker_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool woken_ = false;  // something changed that the scheduler has not looked at yet
  // The scheduler's state, under mutex_.
  std::map<uint64_t, std::unique_ptr<Sequence>> sequences_;  // every sequence queued or holding a slot
  std::deque<uint64_t> queue_;                               // waiting for a slot, oldest first
  std::vector<int64_t> free_slots_;
  // Per slot: the tokens at positions 0.. of its caches, left by the sequence that last held it (empty while held,
  // or when nothing there can be trusted), and when it was given back (a counter), for least recently used.
  struct SlotContents {
    std::vector<int64_t> tokens;
    uint64_t released = 0;
  };
  std::vector<SlotContents> slot_contents_;
  uint64_t releases_ = 0;
  int64_t active_ = 0;  // sequences holding a slot
  std::map<uint64_t, std::unique_ptr<Step>> in_flight_;
  std::deque<uint64_t> returned_;  // steps whose request finished, in the order they did
  std::vector<FailedSubmit> failed_submits_;
  uint64_t next_sequence_ = 1, next_step_ = 1;
  Sampler sampler_;                         // used by the scheduler thread only
  std::unique_ptr<InFlightPolicy> policy_;  // under mutex_
  std::thread scheduler_;

  // Statistics, under mutex_.
  EngineStats totals_;
  double active_ns_ = 0;  // time with at least one sequence holding a slot, up to active_since_
  Clock::time_point active_since_{};
  double ttft_sum_ms_ = 0, itl_sum_ms_ = 0;
  uint64_t ttft_count_ = 0, itl_count_ = 0, rows_total_ = 0;
};

}  // namespace libpipe::generate
