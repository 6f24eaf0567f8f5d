#include "runtime/generate/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/topk.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <unordered_set>
#include <utility>

#include "runtime/device/cuda_graph.h"
#include "runtime/generate/graph_padding.h"
#include "runtime/generate/in_flight_policy.h"
#include "runtime/generate/step_planner.h"
#include "runtime/log.h"

namespace libpipe::generate {

// One sequence as the scheduler sees it. Only the scheduler thread changes it once it is in sequences_ (submit()
// creates it under the lock), so the scheduler may read it without the lock while it samples.
struct Engine::Sequence {
  uint64_t id = 0;
  std::shared_ptr<Generation> generation;
  std::vector<int64_t> prompt;
  std::vector<int64_t> sampled;  // its generated tokens: the cache holds prompt + sampled at positions [0, cached)
  GenerationOptions options;
  TokenRng rng;
  Clock::time_point submitted{};
  int64_t slot = -1;         // -1 while queued
  int64_t cached = 0;        // tokens of this sequence in its cache slot
  int64_t planned = 0;       // tokens handed to steps (cached, and those in steps still in the pipeline)
  int64_t generated = 0;     // tokens sampled for it
  int64_t next_token = -1;   // a decoding sequence's next input
  int in_flight = 0;         // steps in the pipeline holding one of its rows (prompt chunks may pipeline)
  bool ended = false;        // its generation finished; the slot goes back once no step holds it
  bool failed = false;       // ended by a failed step: what its slot holds is not trusted afterwards
  uint64_t ready_since = 0;  // the step counter when it last became ready, for oldest-first
  Clock::time_point last_token{};
};

struct Engine::Step {
  uint64_t id = 0;
  std::vector<PlannedRow> rows;
  int64_t sent_rows = 0;  // rows, and the padding rows of a step padded for CUDA graphs (graph_padding.h)
  std::shared_ptr<schedule::Request> request;
  Clock::time_point returned{};  // when its last stage finished (for the trace)
};

// What the scheduler tells generations once it has let go of its lock: callbacks run there.
struct Engine::Notice {
  std::shared_ptr<Generation> generation;
  std::vector<int64_t> tokens;
  std::vector<TokenLogprobs> logprobs;  // one per token, or none
  bool finish = false;
  FinishReason reason = FinishReason::None;
  Status status = Status::Ok;
  std::string message;
};

namespace {

schedule::SessionOptions step_session_options(schedule::SessionOptions options, int64_t steps_in_flight) {
  // A step is one micro-batch; pipelining comes from several steps in flight.
  options.num_microbatches = 1;
  options.adaptive_microbatches = false;
  options.input_specs.clear();
  options.output_specs.clear();
  options.max_inflight = std::max<int64_t>(options.max_inflight, steps_in_flight);
  // Logits that a GPU stage computed stay on its GPU: the sampler reduces greedy rows there, so that a step brings
  // back a token per row rather than [rows, vocab] floats (sampling.h).
  options.outputs_on_device = true;
  options.graph_steps = true;
  return options;
}

void check_option(int64_t value, const char* name) {
  if (value < 0)
    throw Error(Status::InvalidArgument,
                std::string(name) + " must be 0 (the default) or positive, got " + std::to_string(value));
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// `token`'s log-probability in one row of float32 logits, and the `top` likeliest tokens' (in float64, so that a
// vocabulary of any size sums without losing the small ones).
TokenLogprobs token_logprobs(const at::Tensor& row, int64_t token, int64_t top) {
  const at::Tensor log_p = at::log_softmax(row.to(at::kDouble), 0);
  TokenLogprobs out;
  out.logprob = static_cast<float>(log_p[token].item<double>());
  if (top > 0) {
    const auto [values, indices] = at::topk(log_p, std::min<int64_t>(top, log_p.size(0)));
    for (int64_t i = 0; i < values.size(0); ++i) {
      out.top_ids.push_back(indices[i].item<int64_t>());
      out.top_logprobs.push_back(static_cast<float>(values[i].item<double>()));
    }
  }
  return out;
}

}  // namespace

Engine::Engine(std::shared_ptr<const graph::Plan> plan, schedule::SessionOptions session_options, EngineOptions options)
    : options_(options) {
  check_option(options_.max_queued, "max_queued");
  check_option(options_.prefill_chunk, "prefill_chunk");
  check_option(options_.steps_in_flight, "steps_in_flight");
  check_option(options_.max_rows_per_step, "max_rows_per_step");
  // Before anything is built: a model that is no decoder is refused at once.
  decoder_ = read_decoder_info(*plan, session_options.stage.dtype);
  // Mixed steps need a decoder whose cost follows its valid tokens; LIBPIPE_MIXED_STEPS=0 turns them off (for
  // comparisons, as in bench/RESULTS.md).
  const char* mixed_env = std::getenv("LIBPIPE_MIXED_STEPS");
  mixed_steps_ = decoder_.skips_padding && !(mixed_env && std::string(mixed_env) == "0");
  if (options_.max_queued == 0) options_.max_queued = 4 * decoder_.slots;
  if (options_.prefill_chunk == 0) options_.prefill_chunk = 256;
  if (options_.max_rows_per_step == 0) options_.max_rows_per_step = decoder_.slots;
  options_.max_rows_per_step = std::min(options_.max_rows_per_step, decoder_.slots);
  // Room for a step per stage at least; the default keeps one per stage that can compute at once.
  const int64_t most_in_flight = std::max<int64_t>(options_.steps_in_flight, static_cast<int64_t>(plan->num_stages()));
  session_ = std::make_unique<schedule::Session>(std::move(plan),
                                                 step_session_options(std::move(session_options), most_in_flight));
  // Steps in flight: as given, or chosen by measurement between one per stage and one at a time where the
  // stages share this process's cores (in_flight_policy.h). LIBPIPE_STEPS_IN_FLIGHT=pipelined keeps one per
  // stage, =one one at a time (for comparisons).
  const bool chosen = options_.steps_in_flight == 0;
  const int64_t every_stage = static_cast<int64_t>(session_->concurrent_stages());
  if (chosen) options_.steps_in_flight = every_stage;
  const char* policy_env = std::getenv("LIBPIPE_STEPS_IN_FLIGHT");
  const std::string forced = policy_env ? policy_env : "";
  if (chosen && forced == "one") options_.steps_in_flight = 1;
  policy_ = std::make_unique<InFlightPolicy>(options_.steps_in_flight,
                                             chosen && forced.empty() && session_->spare_cores() != nullptr);
  // Decode steps are padded to the shapes GPU stages record as CUDA graphs (graph_padding.h) where a stage is on a
  // GPU and graphs are on. LIBPIPE_PAD_DECODE_STEPS=1 pads them anywhere (tests show on the CPU that padding changes
  // no token), =0 nowhere.
  const char* pad_env = std::getenv("LIBPIPE_PAD_DECODE_STEPS");
  const std::string pad = pad_env ? pad_env : "";
  bool on_gpu = false;
  for (const auto& d : session_->devices()) on_gpu |= d.is_cuda();
  pad_for_graphs_ = pad == "1" || (pad != "0" && on_gpu && device::cuda_graphs_enabled());
  probe();
  for (int64_t s = decoder_.slots - 1; s >= 0; --s) free_slots_.push_back(s);
  slot_contents_.resize(static_cast<size_t>(decoder_.slots));
  const char* reuse_env = std::getenv("LIBPIPE_PREFIX_REUSE");
  if (reuse_env && std::string(reuse_env) == "0") options_.prefix_reuse = false;
  waker_ = std::make_shared<Waker>();
  waker_->engine = this;
  scheduler_ = std::thread([this] { scheduler_loop(); });
}

void Engine::probe() {
  // One token in slot 0 at position 0: the model runs as a decoder or says why not, and its logits give the
  // vocabulary. The slot is overwritten by the first sequence that gets it.
  c10::InferenceMode inference;
  auto zeros = [] { return at::zeros({1}, at::kLong); };
  std::vector<c10::IValue> inputs{at::zeros({1, 1}, at::kLong), zeros(), at::ones({1}, at::kLong), zeros()};
  c10::IValue out;
  try {
    out = session_->submit_step(std::move(inputs))->take_single();
  } catch (const Error& e) {
    if (e.status() != Status::Execution && e.status() != Status::Input) throw;
    throw Error(Status::InvalidArgument, std::string("the model does not follow the decoder contract: a step of one "
                                                     "token at position 0 in slot 0 failed (") +
                                             e.what() + "). Expected: " + kDecoderContract);
  }
  if (!out.isTensor())
    throw Error(Status::InvalidArgument, "the model does not follow the decoder contract: its forward returned " +
                                             out.tagKind() + ", not a tensor. Expected: " + kDecoderContract);
  const at::Tensor logits = out.toTensor();
  if (logits.dim() != 2 || logits.size(0) != 1 || logits.scalar_type() != at::kFloat)
    throw Error(Status::InvalidArgument, "the model does not follow the decoder contract: for one row it returned a " +
                                             std::string(c10::toString(logits.scalar_type())) + " tensor of " +
                                             std::to_string(logits.dim()) + " dimensions " + c10::str(logits.sizes()) +
                                             ", not float32 [1, vocab]. Expected: " + kDecoderContract);
  decoder_.vocab = logits.size(1);
  // TorchScript's profiling executor records the first runs of a graph (getNumProfiledRuns, 1 by default) and
  // optimizes it at the next: as many more steps here keep that out of the first request, whose time to first token
  // it more than doubled (SmolLM2, one 128-token prompt in a fresh process: 550-740 ms -> 260-290 ms).
  for (size_t run = 0; run < torch::jit::getNumProfiledRuns(); ++run) {
    std::vector<c10::IValue> again{at::zeros({1, 1}, at::kLong), zeros(), at::ones({1}, at::kLong), zeros()};
    session_->submit_step(std::move(again))->take_single();
  }
}

Engine::~Engine() {
  {
    std::lock_guard lock(waker_->mutex);
    waker_->engine = nullptr;  // generations that outlive the engine wake nobody
  }
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    woken_ = true;
  }
  cv_.notify_all();
  scheduler_.join();
  session_.reset();
}

void Engine::wake() {
  {
    std::lock_guard lock(mutex_);
    woken_ = true;
  }
  cv_.notify_all();
}

std::shared_ptr<Generation> Engine::submit(std::vector<int64_t> prompt, GenerationOptions options) {
  if (prompt.empty()) throw Error(Status::InvalidArgument, "the prompt is empty: give at least one token id");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= decoder_.vocab)
      throw Error(Status::InvalidArgument, "prompt token " + std::to_string(i) + " is " + std::to_string(prompt[i]) +
                                               ", outside the model's vocabulary 0.." +
                                               std::to_string(decoder_.vocab - 1));
  if (static_cast<int64_t>(prompt.size()) + 1 > decoder_.max_len)
    throw Error(Status::InvalidArgument, "the prompt has " + std::to_string(prompt.size()) +
                                             " tokens, which leaves no room for a new one in the model's " +
                                             std::to_string(decoder_.max_len) +
                                             " positions (max_len): shorten it, or export the model with a larger "
                                             "--max-seq-len");
  if (options.max_new_tokens < 1)
    throw Error(Status::InvalidArgument,
                "max_new_tokens must be at least 1, got " + std::to_string(options.max_new_tokens));
  validate(options.sampling);
  if (options.top_logprobs < 0 || options.top_logprobs > kMaxTopLogprobs)
    throw Error(Status::InvalidArgument, "top_logprobs must be 0.." + std::to_string(kMaxTopLogprobs) + ", got " +
                                             std::to_string(options.top_logprobs));
  if (options.top_logprobs > 0 && !options.logprobs && !options.prompt_logprobs)
    throw Error(Status::InvalidArgument,
                "top_logprobs needs logprobs or prompt_logprobs: ask for the tokens' log-probabilities too");
  const std::string broken = session_->broken();
  if (!broken.empty())
    throw Error(Status::Communication, "the generator's session is broken (" + broken +
                                           "); destroy the generator, restart its workers and create a new one");

  auto seq = std::make_unique<Sequence>();
  seq->prompt = std::move(prompt);
  seq->rng = TokenRng(options.seed);
  seq->options = std::move(options);
  seq->submitted = Clock::now();
  std::weak_ptr<Waker> waker = waker_;
  seq->generation = std::make_shared<Generation>(
      static_cast<int64_t>(seq->prompt.size()), seq->submitted,
      [waker] {
        if (auto w = waker.lock()) {
          std::lock_guard lock(w->mutex);
          if (w->engine) w->engine->wake();
        }
      },
      seq->options.logprobs, seq->options.prompt_logprobs);
  auto generation = seq->generation;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error(Status::Cancelled, "the generator is being destroyed");
    // A free slot is taken here, so that the queue holds only sequences that truly wait.
    if (queue_.empty() && !free_slots_.empty()) {
      take_slot(*seq, seq->submitted);
    } else if (static_cast<int64_t>(queue_.size()) >= options_.max_queued) {
      throw Error(Status::Busy, "the generator is busy: " + std::to_string(queue_.size()) +
                                    " sequences already wait for one of its " + std::to_string(decoder_.slots) +
                                    " cache slots (max_queued); retry when one has finished");
    } else {
      queue_.push_back(next_sequence_);
    }
    seq->id = next_sequence_++;
    sequences_.emplace(seq->id, std::move(seq));
    woken_ = true;
  }
  cv_.notify_all();
  return generation;
}

void Engine::take_slot(Sequence& seq, Clock::time_point now) {
  // The free slot whose tokens begin the prompt for longest; among equals (most often: none matches) the one given
  // back longest ago, so that the conversations used most recently stay cached longest.
  size_t best = 0;
  int64_t best_match = -1;
  for (size_t i = 0; i < free_slots_.size(); ++i) {
    const SlotContents& c = slot_contents_[static_cast<size_t>(free_slots_[i])];
    int64_t match = 0;
    // A prompt to score is computed whole: the cache would hold its tokens but not their log-probabilities.
    if (options_.prefix_reuse && !seq.options.prompt_logprobs) {
      const size_t n = std::min(c.tokens.size(), seq.prompt.size());
      while (static_cast<size_t>(match) < n && c.tokens[match] == seq.prompt[match]) ++match;
    }
    if (match > best_match ||
        (match == best_match && c.released < slot_contents_[static_cast<size_t>(free_slots_[best])].released)) {
      best = i;
      best_match = match;
    }
  }
  seq.slot = free_slots_[best];
  free_slots_.erase(free_slots_.begin() + static_cast<std::ptrdiff_t>(best));
  slot_contents_[static_cast<size_t>(seq.slot)].tokens.clear();  // rewritten from the match on
  // The prompt's last token is always computed: its logits give the first token.
  const int64_t reused = std::min<int64_t>(best_match, static_cast<int64_t>(seq.prompt.size()) - 1);
  seq.cached = seq.planned = reused;
  totals_.cached_prompt_tokens += static_cast<uint64_t>(reused);
  seq.ready_since = next_step_;
  if (active_++ == 0) active_since_ = now;
  seq.generation->started(now, reused);
}

std::vector<int64_t> Engine::padding_slots() const {
  // Those whose kept tokens (prefix reuse) the padding costs least first.
  std::vector<int64_t> slots = free_slots_;
  std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
    return slot_contents_[static_cast<size_t>(a)].tokens.size() < slot_contents_[static_cast<size_t>(b)].tokens.size();
  });
  return slots;
}

void Engine::release_slot(Sequence& seq, Clock::time_point now) {
  if (seq.slot < 0) return;
  // Called once no step holds the sequence's rows: positions [0, cached) hold its prompt and the sampled tokens
  // fed back, as every step that wrote them succeeded.
  SlotContents& contents = slot_contents_[static_cast<size_t>(seq.slot)];
  contents.tokens.clear();
  if (!seq.failed) {
    const int64_t prompt_len = static_cast<int64_t>(seq.prompt.size());
    contents.tokens.assign(seq.prompt.begin(), seq.prompt.begin() + std::min(seq.cached, prompt_len));
    for (int64_t i = prompt_len; i < seq.cached; ++i) contents.tokens.push_back(seq.sampled[i - prompt_len]);
  }
  contents.released = ++releases_;
  free_slots_.push_back(seq.slot);
  seq.slot = -1;
  if (--active_ == 0) active_ns_ += std::chrono::duration<double, std::nano>(now - active_since_).count();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mutex_);
  EngineStats st = totals_;
  st.steps_in_flight = policy_->current_limit();
  st.steps_one_at_a_time = policy_->steps_one_at_a_time();
  st.steps_pipelined = policy_->steps_pipelined();
  st.steps_in_flight_chosen = policy_->adaptive();
  st.slots_in_use = decoder_.slots - static_cast<int64_t>(free_slots_.size());
  st.queued = static_cast<int64_t>(queue_.size());
  double active_ns = active_ns_;
  if (active_ > 0) active_ns += std::chrono::duration<double, std::nano>(Clock::now() - active_since_).count();
  st.tokens_per_s = active_ns > 0 ? static_cast<double>(st.generated_tokens) / (active_ns / 1e9) : 0;
  st.mean_time_to_first_token_ms = ttft_count_ ? ttft_sum_ms_ / static_cast<double>(ttft_count_) : 0;
  st.mean_inter_token_ms = itl_count_ ? itl_sum_ms_ / static_cast<double>(itl_count_) : 0;
  st.mean_rows_per_step = st.steps ? static_cast<double>(rows_total_) / static_cast<double>(st.steps) : 0;
  return st;
}

void Engine::scheduler_loop() {
  c10::InferenceMode inference;
  std::unique_lock lock(mutex_);
  std::vector<Notice> notices;
  std::optional<stage::SpareCores::Busy> busy;  // while this thread samples, no stage borrows its core
  for (;;) {
    busy.emplace(session_->spare_cores());
    woken_ = false;
    const auto now = Clock::now();
    // Cancels and deadlines first: a sequence cancelled while its step was in a stage must not get that step's
    // token when the step returns in the same turn.
    if (!stopping_) expire_and_cancel(now, notices);
    // Steps that came back: sample, hand out tokens, end sequences.
    while (!returned_.empty()) {
      const uint64_t id = returned_.front();
      returned_.pop_front();
      complete_step(lock, id, notices);
    }
    if (stopping_) {
      for (auto& [id, seq] : sequences_)
        if (!seq->ended) end(*seq, FinishReason::Cancelled, Status::Cancelled, "the generator was destroyed", notices);
      // The pipeline drops what it has not run yet. Outside the lock: a cancelled request runs its callback here.
      std::vector<std::shared_ptr<schedule::Request>> requests;
      for (auto& [id, step] : in_flight_)
        if (step->request && !step->request->failed()) requests.push_back(step->request);
      if (!requests.empty()) {
        lock.unlock();
        for (auto& r : requests) r->cancel();
        lock.lock();
      }
    }
    retire_ended(now);
    if (!stopping_) {
      admit(now);
      launch_steps(lock);
    }
    if (!notices.empty()) {
      lock.unlock();
      const auto delivering = Clock::now();
      const double count = static_cast<double>(notices.size());
      deliver(notices);
      session_->trace_event("engine", "deliver", delivering, Clock::now(), {{"notices", count}});
      lock.lock();
      continue;  // callbacks may have submitted or cancelled
    }
    if (stopping_ && in_flight_.empty()) break;
    if (!returned_.empty() || woken_) continue;  // news came while the lock was let go
    const auto until = next_deadline();
    const auto news = [&] { return woken_ || !returned_.empty(); };
    busy.reset();
    if (until == Clock::time_point::max()) cv_.wait(lock, news);
    else cv_.wait_until(lock, until, news);
  }
}

void Engine::deliver(std::vector<Notice>& notices) {
  const auto now = Clock::now();
  for (auto& n : notices) {
    if (!n.tokens.empty())
      n.generation->publish(n.tokens.data(), n.tokens.size(), now, n.logprobs.empty() ? nullptr : n.logprobs.data());
    if (n.finish) n.generation->finish(n.reason, n.status, n.message);
  }
  notices.clear();
}

Clock::time_point Engine::next_deadline() const {
  auto until = Clock::time_point::max();
  for (const auto& [id, seq] : sequences_)
    if (!seq->ended) until = std::min(until, seq->options.deadline);
  return until;
}

void Engine::end(Sequence& seq, FinishReason reason, Status status, const std::string& message,
                 std::vector<Notice>& notices) {
  if (seq.ended) return;
  seq.ended = true;
  totals_.sequences_finished++;
  notices.push_back({seq.generation, {}, {}, true, reason, status, message});
}

void Engine::expire_and_cancel(Clock::time_point now, std::vector<Notice>& notices) {
  for (auto& [id, seq] : sequences_) {
    if (seq->ended) continue;
    if (seq->generation->cancel_requested())
      end(*seq, FinishReason::Cancelled, Status::Cancelled, "the generation was cancelled", notices);
    else if (now >= seq->options.deadline)
      end(*seq, FinishReason::Deadline, Status::DeadlineExceeded, "the generation did not finish before its deadline",
          notices);
  }
}

void Engine::retire_ended(Clock::time_point now) {
  // An ended sequence leaves once no step holds its row: until then a stage may still write its cache slot.
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    Sequence& seq = *it->second;
    if (seq.ended && seq.in_flight == 0) {
      if (seq.slot < 0) queue_.erase(std::remove(queue_.begin(), queue_.end(), seq.id), queue_.end());
      release_slot(seq, now);
      it = sequences_.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::admit(Clock::time_point now) {
  while (!queue_.empty() && !free_slots_.empty()) {
    Sequence& seq = *sequences_.at(queue_.front());
    queue_.pop_front();
    take_slot(seq, now);
  }
}

void Engine::launch_steps(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    bool prompts_waiting = false;
    for (const auto& [id, seq] : sequences_)
      prompts_waiting |= !seq->ended && seq->slot >= 0 && seq->planned < static_cast<int64_t>(seq->prompt.size());
    const int64_t limit = policy_->limit(active_, prompts_waiting);
    // One sequence decoding has one step in flight whatever the limit (each waits for the last one's token).
    session_->expect_steps_in_flight(active_ <= 1 && !prompts_waiting ? 1 : limit);
    if (static_cast<int64_t>(in_flight_.size()) >= limit) return;
    const auto planning = Clock::now();
    std::vector<ReadyRow> ready;
    for (const auto& [id, seq] : sequences_) {
      if (seq->ended || seq->slot < 0) continue;
      // A prompt's next chunk may follow the previous one into the pipeline at once: each stage runs steps in the
      // order they were submitted, so the earlier chunk's keys and values are in the caches before the later one
      // reads them. A decoding sequence waits for its token.
      const int64_t prompt_len = static_cast<int64_t>(seq->prompt.size());
      if (seq->planned < prompt_len && seq->options.prompt_logprobs)  // one token a row, planned as a decode row
        ready.push_back({id, seq->slot, seq->planned, 0, seq->ready_since});
      else if (seq->planned < prompt_len)
        ready.push_back({id, seq->slot, seq->planned, prompt_len - seq->planned, seq->ready_since});
      else if (seq->in_flight == 0) ready.push_back({id, seq->slot, seq->cached, 0, seq->ready_since});
    }
    if (ready.empty()) {
      if (in_flight_.empty()) policy_->idle();
      return;
    }
    StepBudget budget;
    budget.active = active_;
    budget.steps_in_flight = limit;
    budget.max_rows = options_.max_rows_per_step;
    budget.prefill_chunk = options_.prefill_chunk;
    budget.mixed = mixed_steps_;
    auto step = std::make_unique<Step>();
    step->id = next_step_++;
    step->rows = plan_step(ready, budget);
    if (step->rows.empty()) return;
    for (PlannedRow& r : step->rows)  // a prompt being scored gives a token only from its last row
      r.completes_prompt = r.start + r.length >= static_cast<int64_t>(sequences_.at(r.sequence)->prompt.size());

    const int64_t b = static_cast<int64_t>(step->rows.size());
    int64_t t = 0, context = 0;
    for (const auto& r : step->rows) {
      t = std::max(t, r.length);
      context = std::max(context, r.start + r.length);
    }
    // A decode step (one token a row) for stages that replay CUDA graphs: padded to a recorded shape.
    std::optional<DecodePadding> padding;
    if (pad_for_graphs_ && t == 1) padding = pad_decode_step(b, context, decoder_.max_len, padding_slots());
    step->sent_rows = padding ? padding->rows : b;
    const int64_t sent = step->sent_rows;
    at::Tensor tokens = at::zeros({sent, t}, at::kLong);
    at::Tensor start = at::empty({sent}, at::kLong), lengths = at::empty({sent}, at::kLong),
               slots = at::empty({sent}, at::kLong);
    int64_t* tok = tokens.data_ptr<int64_t>();
    int64_t step_tokens = 0, prompt_rows = 0;
    for (int64_t i = 0; i < b; ++i) {
      const PlannedRow& r = step->rows[i];
      Sequence& seq = *sequences_.at(r.sequence);
      seq.in_flight++;
      seq.planned = r.start + r.length;
      if (!r.completes_prompt) seq.ready_since = next_step_;  // its next chunk queues behind rows ready now
      const int64_t prompt_len = static_cast<int64_t>(seq.prompt.size());
      if (r.start < prompt_len) std::copy_n(seq.prompt.data() + r.start, r.length, tok + i * t);
      else tok[i * t] = seq.next_token;
      step_tokens += r.length;
      prompt_rows += r.start < prompt_len;
      start.data_ptr<int64_t>()[i] = r.start;
      lengths.data_ptr<int64_t>()[i] = r.length;
      slots.data_ptr<int64_t>()[i] = r.slot;
      rows_total_++;
    }
    if (padding) {
      totals_.padded_steps++;
      for (int64_t i = b; i < sent; ++i) {  // token 0 (tokens are zeros), one each, at the padded context's end
        const int64_t slot = padding->slots[static_cast<size_t>(i - b)];
        start.data_ptr<int64_t>()[i] = padding->start;
        lengths.data_ptr<int64_t>()[i] = 1;
        slots.data_ptr<int64_t>()[i] = slot;
        // Its cache entry at the padding's position is overwritten: the slot's kept tokens end before it.
        auto& kept = slot_contents_[static_cast<size_t>(slot)].tokens;
        if (static_cast<int64_t>(kept.size()) > padding->start) kept.resize(static_cast<size_t>(padding->start));
      }
    }
    totals_.steps++;
    policy_->launched(step->id, step_tokens);
    Step* raw = step.get();
    in_flight_.emplace(step->id, std::move(step));
    // Outside the lock: a request that finishes at once runs its callback on this thread, and the callback locks.
    lock.unlock();
    std::shared_ptr<schedule::Request> request;
    std::string error;
    Status status = Status::Ok;
    try {
      request = session_->submit_step({tokens, start, lengths, slots}, padding.has_value());
    } catch (const Error& e) {
      status = e.status();
      error = e.what();
    }
    lock.lock();
    if (!request) {
      // Treated as a step that failed: its sequences end with the error.
      failed_submits_.push_back({raw->id, status, error});
      returned_.push_back(raw->id);
      continue;
    }
    raw->request = request;
    const uint64_t id = raw->id;
    if (session_->tracing())
      session_->trace_event("engine", "launch step " + std::to_string(id), planning, Clock::now(),
                            {{"step", static_cast<double>(id)},
                             {"request", static_cast<double>(request->id())},
                             {"rows", static_cast<double>(b)},
                             {"tokens", static_cast<double>(step_tokens)},
                             {"prompt_rows", static_cast<double>(prompt_rows)}});
    lock.unlock();
    request->on_done([this, id](Status) {
      // Notified under the lock: once it is released this callback touches nothing of the engine, which may be
      // destroyed as soon as its scheduler has seen the last step return.
      std::lock_guard guard(mutex_);
      if (auto it = in_flight_.find(id); it != in_flight_.end()) it->second->returned = Clock::now();
      returned_.push_back(id);
      cv_.notify_all();
    });
    lock.lock();
  }
}

void Engine::complete_step(std::unique_lock<std::mutex>& lock, uint64_t step_id, std::vector<Notice>& notices) {
  auto node = in_flight_.extract(step_id);
  if (node.empty()) return;
  std::unique_ptr<Step> step = std::move(node.mapped());
  const auto now = Clock::now();
  policy_->completed(step_id, step->request ? step->returned : now);
  if (step->request && session_->tracing())
    session_->trace_event(
        "engine", "collect step " + std::to_string(step_id), step->returned, now,
        {{"step", static_cast<double>(step_id)}, {"request", static_cast<double>(step->request->id())}});
  Status status = Status::Ok;
  std::string message;
  at::Tensor logits;
  auto failed = std::find_if(failed_submits_.begin(), failed_submits_.end(),
                             [&](const FailedSubmit& f) { return f.step == step_id; });
  if (failed != failed_submits_.end()) {
    status = failed->status;
    message = failed->message;
    failed_submits_.erase(failed);
  } else {
    try {
      c10::IValue out = step->request->take_single();
      if (!out.isTensor()) throw Error(Status::Execution, "the decoder's forward returned " + out.tagKind());
      logits = out.toTensor();
      if (logits.dim() != 2 || logits.size(0) != step->sent_rows || logits.size(1) != decoder_.vocab ||
          logits.scalar_type() != at::kFloat)
        throw Error(Status::Execution, "the decoder returned logits of shape " + c10::str(logits.sizes()) +
                                           " and dtype " + c10::toString(logits.scalar_type()) + ", not float32 [" +
                                           std::to_string(step->sent_rows) + ", " + std::to_string(decoder_.vocab) +
                                           "]");
      // The padding rows' logits (graph_padding.h) are nobody's.
      if (step->sent_rows != static_cast<int64_t>(step->rows.size()))
        logits = logits.narrow(0, 0, static_cast<int64_t>(step->rows.size()));
    } catch (const Error& e) {
      status = e.status();
      message = e.what();
    } catch (const std::exception& e) {
      status = Status::Internal;
      message = e.what();
    }
  }

  // Rows whose sequence still wants a token: sample them together. Rows of a prompt being scored: the logits of
  // its next token.
  std::vector<int64_t> sample_rows;
  struct Score {
    int64_t row = 0, position = 0, token = 0, top = 0;
    std::shared_ptr<Generation> generation;
  };
  std::vector<Score> scores;
  for (size_t i = 0; i < step->rows.size(); ++i) {
    const PlannedRow& r = step->rows[i];
    Sequence& seq = *sequences_.at(r.sequence);
    seq.in_flight--;
    seq.ready_since = next_step_;
    if (status != Status::Ok) {
      seq.failed = true;
      end(seq, FinishReason::Error, status, message, notices);
      continue;
    }
    seq.cached = std::max(seq.cached, r.start + r.length);
    if (!seq.ended && seq.generation->cancel_requested())  // cancelled since this turn began: no token
      end(seq, FinishReason::Cancelled, Status::Cancelled, "the generation was cancelled", notices);
    if (!seq.ended && r.completes_prompt) sample_rows.push_back(static_cast<int64_t>(i));
    const int64_t next = r.start + r.length;
    if (!seq.ended && seq.options.prompt_logprobs && next < static_cast<int64_t>(seq.prompt.size()))
      scores.push_back({static_cast<int64_t>(i), next, seq.prompt[static_cast<size_t>(next)], seq.options.top_logprobs,
                        seq.generation});
    if (r.start < static_cast<int64_t>(seq.prompt.size())) totals_.prompt_tokens += r.length;
  }
  if (sample_rows.empty() && scores.empty()) return;

  std::vector<SamplingParams> params;
  std::vector<TokenRng*> rngs;
  std::vector<Sequence*> seqs;
  for (int64_t i : sample_rows) {
    Sequence& seq = *sequences_.at(step->rows[i].sequence);
    params.push_back(seq.options.sampling);
    rngs.push_back(&seq.rng);
    seqs.push_back(&seq);
  }
  at::Tensor rows_logits;
  if (!sample_rows.empty())
    rows_logits =
        static_cast<size_t>(logits.size(0)) == sample_rows.size()
            ? logits
            : logits.index_select(0, at::tensor(sample_rows, at::TensorOptions().dtype(at::kLong)).to(logits.device()));
  const at::Tensor all_logits = logits;
  std::vector<std::string> row_errors;
  std::vector<int64_t> tokens;
  // Sampling reads only these sequences, which nothing but this thread changes: the lock can go meanwhile, so
  // submit() and stats() do not wait for it.
  lock.unlock();
  const auto sampling_start = Clock::now();
  std::string sample_error;
  Status sample_status = Status::Ok;
  std::vector<TokenLogprobs> logprobs(seqs.size());
  try {
    // Told to their generations before the first token is published (below, under the lock), so that a caller who
    // has a token finds every prompt position scored.
    for (const Score& sc : scores)
      sc.generation->scored(sc.position, token_logprobs(all_logits[sc.row], sc.token, sc.top));
    if (!seqs.empty()) tokens = sampler_.sample(rows_logits, params, rngs, &row_errors);
    for (size_t k = 0; k < seqs.size(); ++k)
      if (seqs[k]->options.logprobs && (row_errors.empty() || row_errors[k].empty()))
        logprobs[k] = token_logprobs(rows_logits[static_cast<int64_t>(k)], tokens[k], seqs[k]->options.top_logprobs);
  } catch (const Error& e) {
    sample_status = e.status();
    sample_error = e.what();
  }
  const auto sampled = Clock::now();
  if (session_->tracing())
    session_->trace_event("engine", "sample step " + std::to_string(step_id), sampling_start, sampled,
                          {{"step", static_cast<double>(step_id)}, {"rows", static_cast<double>(seqs.size())}});
  lock.lock();
  totals_.sampling_ms += ms_between(sampling_start, sampled);

  for (size_t k = 0; k < seqs.size(); ++k) {
    Sequence& seq = *seqs[k];
    if (seq.ended) continue;
    if (sample_status != Status::Ok) {
      end(seq, FinishReason::Error, sample_status, sample_error, notices);
      continue;
    }
    if (!row_errors.empty() && !row_errors[k].empty()) {
      end(seq, FinishReason::Error, Status::Execution, row_errors[k], notices);
      continue;
    }
    const int64_t token = tokens[k];
    seq.generated++;
    totals_.generated_tokens++;
    if (seq.generated == 1) {
      ttft_sum_ms_ += ms_between(seq.submitted, sampled);
      ttft_count_++;
    } else {
      itl_sum_ms_ += ms_between(seq.last_token, sampled);
      itl_count_++;
    }
    seq.last_token = sampled;
    seq.next_token = token;
    seq.sampled.push_back(token);
    Notice notice{seq.generation, {token}, {}, false, FinishReason::None, Status::Ok, {}};
    if (seq.options.logprobs) notice.logprobs.push_back(std::move(logprobs[k]));
    notices.push_back(std::move(notice));
    const auto& stops = seq.options.stop_ids;
    if (std::find(stops.begin(), stops.end(), token) != stops.end())
      end(seq, FinishReason::Stop, Status::Ok, "", notices);
    else if (seq.generated >= seq.options.max_new_tokens || seq.cached + 1 > decoder_.max_len)
      end(seq, FinishReason::Length, Status::Ok, "", notices);
  }
}

}  // namespace libpipe::generate
