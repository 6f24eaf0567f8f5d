// Generation: the caller's side of one sequence being generated. The engine's scheduler thread appends tokens and
// finishes it; the caller reads tokens without blocking, learns that some arrived from a callback or a pollable
// eventfd, waits for the end, or cancels. Thread-safe; outlives the engine (a destroyed engine cancels it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/error.h"
#include "runtime/generate/sampling.h"
#include "runtime/schedule/request.h"

namespace libpipe::generate {

using Clock = schedule::Clock;

// Mirrors PIPE_FINISH_* (pipe.h).
enum class FinishReason : int32_t { None = 0, Stop = 1, Length = 2, Cancelled = 3, Deadline = 4, Error = 5 };

// The most alternatives a token's log-probabilities may list (OpenAI's top_logprobs allows 20).
constexpr int64_t kMaxTopLogprobs = 20;

struct GenerationOptions {
  int64_t max_new_tokens = 16;  // >= 1
  SamplingParams sampling;
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;
  Clock::time_point deadline = Clock::time_point::max();
  bool logprobs = false;     // keep each token's log-probability (TokenLogprobs)
  int64_t top_logprobs = 0;  // and that many of the likeliest tokens at its position (0..kMaxTopLogprobs; logprobs
                             // or prompt_logprobs)
  // Score the prompt too: each prompt token's log-probability given those before it (OpenAI's echo with logprobs,
  // perplexity). The prompt then goes through the pipeline one token a step, as decode rows do, since the decoder
  // gives the logits of a row's last token only; nothing of it is taken from the cache (prefix reuse).
  bool prompt_logprobs = false;
};

// A generated token's log-probability under the model's distribution at its position (the log-softmax of the
// logits, before temperature, top-k and top-p: what the model says, whatever the sampler then did), and the
// likeliest tokens there, most likely first.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<int64_t> top_ids;
  std::vector<float> top_logprobs;
};

struct GenerationInfo {
  FinishReason finish_reason = FinishReason::None;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t cached_tokens = 0;           // prompt tokens found in the cache slot (prefix reuse), not computed again
  double queued_ms = -1;               // submit -> slot; -1 while queued
  double time_to_first_token_ms = -1;  // submit -> first token; -1 before it
  double mean_inter_token_ms = -1;     // between tokens after the first; -1 before the second
};

class Generation {
 public:
  // Told that `available` tokens are unread, or (finished = true, once, last) that the sequence ended.
  using EventFn = std::function<void(size_t available, bool finished)>;
  // `wake` asks the engine to look at this generation again (after cancel()); it may be called after the engine
  // is gone, so the engine hands a function that holds no reference to it that could dangle.
  // `keeps_logprobs`: the options asked for each token's log-probabilities (GenerationOptions::logprobs).
  // `keeps_prompt_logprobs`: and the prompt's (GenerationOptions::prompt_logprobs).
  Generation(int64_t prompt_tokens, Clock::time_point submitted, std::function<void()> wake,
             bool keeps_logprobs = false, bool keeps_prompt_logprobs = false);
  ~Generation();  // closes the eventfd if abandon() did not
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Copies up to `capacity` unread tokens; `*finished` is true once the sequence ended and every token was read.
  // Clears the eventfd when it has read every token of a sequence that goes on. Never blocks.
  size_t read(int64_t* tokens, size_t capacity, bool* finished);
  // Waits until the sequence ended or `until` passes; true if it ended.
  bool wait_until(Clock::time_point until);
  // Once ended: Ok (stop or length), Cancelled, DeadlineExceeded or the failed step's status, and its message.
  Status status();
  std::string message();
  // Asks the engine to stop the sequence (FinishReason::Cancelled); does nothing once it ended.
  void cancel();
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }
  // One callback per generation (false if one was set before): runs at once on this thread when tokens are unread
  // or the sequence ended, then on the engine's thread, never under this generation's lock.
  bool on_event(EventFn fn);
  // A Linux eventfd, made on the first call: readable while tokens are unread or once the sequence ended. Owned
  // by the generation. Throws Error(Io) when the system has no descriptor left.
  int event_fd();
  // The owner lets go: cancels, waits for a callback running on another thread, closes the eventfd. Afterwards
  // no callback runs.
  void abandon();
  GenerationInfo info();
  // The index-th generated token's log-probabilities (0: the first token); false when there is no such token yet,
  // or the generation was not asked for them.
  bool logprobs(size_t index, TokenLogprobs* out);
  bool keeps_logprobs() const { return keeps_logprobs_; }
  // The log-probabilities of the prompt's token at `position` (1 .. prompt tokens - 1) given the tokens before it;
  // false for position 0 (nothing precedes it), a position not scored yet (all are once the first token arrived),
  // or a generation not asked for them.
  bool prompt_logprobs(size_t position, TokenLogprobs* out);
  bool keeps_prompt_logprobs() const { return keeps_prompt_logprobs_; }

  // ---- The engine's side (its scheduler thread) ----
  // The sequence got its cache slot, holding the first `cached_tokens` of its prompt already.
  void started(Clock::time_point now, int64_t cached_tokens);
  // Appends generated tokens (with their log-probabilities when asked: null or `count` of them) and tells the caller.
  void publish(const int64_t* tokens, size_t count, Clock::time_point now, const TokenLogprobs* logprobs = nullptr);
  // Records the prompt token at `position`'s log-probabilities (a generation that keeps them); tells nobody: the
  // caller reads them once the first token (published after them) arrives.
  void scored(int64_t position, TokenLogprobs logprobs);
  // Ends the sequence (first call only) and tells the caller; `status` Ok for Stop and Length.
  void finish(FinishReason reason, Status status, const std::string& message);
  bool finished();

 private:
  // With mutex_ held by `lock`: makes the eventfd say what is pending and runs the callback (lock released while
  // it runs) when there is something to tell.
  void notify(std::unique_lock<std::mutex>& lock);
  void set_fd_locked(bool readable);

  const int64_t prompt_tokens_;
  const Clock::time_point submitted_;
  const std::function<void()> wake_;
  const bool keeps_logprobs_;
  const bool keeps_prompt_logprobs_;
  std::atomic<bool> cancel_requested_{false};

  std::mutex mutex_;
  std::condition_variable ended_;
  std::vector<int64_t> tokens_;
  std::vector<TokenLogprobs> logprobs_;         // one per token when the options asked for them
  std::vector<TokenLogprobs> prompt_logprobs_;  // per prompt position when asked for (0: none)
  std::vector<bool> prompt_scored_;
  size_t read_ = 0;  // tokens the caller has read
  FinishReason reason_ = FinishReason::None;
  Status status_ = Status::Ok;
  std::string message_;
  Clock::time_point started_{}, first_token_{}, last_token_{};
  bool has_started_ = false;
  int64_t cached_tokens_ = 0;
  // Callback and eventfd.
  bool callback_set_ = false;
  EventFn callback_;
  bool callback_running_ = false;
  bool callback_pending_ = false;  // news arrived while the callback ran: it runs again
  bool told_finished_ = false;     // the callback heard finished = true
  bool abandoned_ = false;
  std::thread::id callback_thread_;
  std::condition_variable callback_returned_;
  int event_fd_ = -1;
  bool fd_readable_ = false;
};

}  // namespace libpipe::generate
