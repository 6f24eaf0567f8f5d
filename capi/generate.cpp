// The C ABI of token generation (pipe.h, "Generation"): generators (an Engine driving a decoder's
// session step by step) and generations (one sequence each: its tokens read without blocking, a
// callback or a pollable descriptor, its end waited for or cancelled).
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "capi/boundary.h"
#include "capi/struct_sizes.h"
#include "runtime/generate/engine.h"
#include "runtime/generate/generation.h"
#include "runtime/generate/sampling.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;
using libpipe::generate::FinishReason;

#define PIPE_CHECK_FINISH(code, name) static_assert(code == static_cast<int32_t>(FinishReason::name), #code " mismatch")
PIPE_CHECK_FINISH(PIPE_FINISH_NONE, None);
PIPE_CHECK_FINISH(PIPE_FINISH_STOP, Stop);
PIPE_CHECK_FINISH(PIPE_FINISH_LENGTH, Length);
PIPE_CHECK_FINISH(PIPE_FINISH_CANCELLED, Cancelled);
PIPE_CHECK_FINISH(PIPE_FINISH_DEADLINE, Deadline);
PIPE_CHECK_FINISH(PIPE_FINISH_ERROR, Error);
#undef PIPE_CHECK_FINISH

namespace libpipe::capi {

// The objects behind pipe_generator and pipe_generation (boundary.h says why handles are casts).
struct GeneratorHandle {
  std::unique_ptr<libpipe::generate::Engine> engine;
  // pipe_generator_session's handle: borrows the engine's session, and is destroyed with it.
  SessionHandle session;
};

struct GenerationHandle {
  // Shared with the engine while the sequence runs; the handle may outlive the engine.
  std::shared_ptr<libpipe::generate::Generation> impl;
};

inline GeneratorHandle* get(pipe_generator* h) { return reinterpret_cast<GeneratorHandle*>(h); }
inline const GeneratorHandle* get(const pipe_generator* h) { return reinterpret_cast<const GeneratorHandle*>(h); }
inline pipe_generator* handle(GeneratorHandle* o) { return reinterpret_cast<pipe_generator*>(o); }
inline GenerationHandle* get(pipe_generation* h) { return reinterpret_cast<GenerationHandle*>(h); }
inline const GenerationHandle* get(const pipe_generation* h) { return reinterpret_cast<const GenerationHandle*>(h); }
inline pipe_generation* handle(GenerationHandle* o) { return reinterpret_cast<pipe_generation*>(o); }

}  // namespace libpipe::capi

namespace {

using libpipe::schedule::Clock;

// The time point `timeout_ms` from now; Clock::time_point::max() for a negative timeout or one past
// what the clock counts (adding it would overflow into the past).
Clock::time_point after(int64_t timeout_ms) {
  const auto now = Clock::now();
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now).count();
  if (timeout_ms < 0 || timeout_ms >= room) return Clock::time_point::max();
  return now + std::chrono::milliseconds(timeout_ms);
}

// Writes `full` into the caller's `out` up to the caller's struct_size (checked by the caller),
// which stays as it was: a caller built against an older pipe.h has only those bytes.
template <typename T>
void fill(T* out, const T& full) {
  const uint32_t size = std::min<uint32_t>(out->struct_size, sizeof full);
  std::memcpy(reinterpret_cast<char*>(out) + sizeof(uint32_t), reinterpret_cast<const char*>(&full) + sizeof(uint32_t),
              size - sizeof(uint32_t));
}

// Zero means "the default" in pipe_generator_options; a negative value is a mistake.
int64_t non_negative(int64_t value, const char* function, const char* field, const char* zero_means) {
  if (value < 0)
    throw Error(Status::InvalidArgument, std::string(function) + ": generator_options->" + field + " is " +
                                             std::to_string(value) + "; give 0 (" + zero_means + ") or more");
  return value;
}

libpipe::generate::EngineOptions engine_options(const pipe_generator_options* o, const char* function) {
  libpipe::generate::EngineOptions opts;
  if (!o) return opts;
  require_struct_size(o->struct_size, kGeneratorOptions, function, "generator_options->struct_size");
#define PIPE_HAS(field) (o->struct_size >= offsetof(pipe_generator_options, field) + sizeof(o->field))
  if (PIPE_HAS(max_queued))
    opts.max_queued = non_negative(o->max_queued, function, "max_queued", "4 x the decoder's slots");
  if (PIPE_HAS(prefill_chunk))
    opts.prefill_chunk = non_negative(o->prefill_chunk, function, "prefill_chunk", "256 tokens");
  if (PIPE_HAS(steps_in_flight))
    opts.steps_in_flight = non_negative(o->steps_in_flight, function, "steps_in_flight", "the number of stages");
  if (PIPE_HAS(max_rows_per_step))
    opts.max_rows_per_step = non_negative(o->max_rows_per_step, function, "max_rows_per_step", "the decoder's slots");
#undef PIPE_HAS
  return opts;
}

libpipe::generate::GenerationOptions generation_options(const pipe_generation_options* options, const char* function) {
  const pipe_generation_options defaults = PIPE_GENERATION_OPTIONS_INIT;
  const pipe_generation_options* o = options ? options : &defaults;
  require_struct_size(o->struct_size, kGenerationOptions, function, "options->struct_size");
  const std::string fn = function;
  libpipe::generate::GenerationOptions opts;
#define PIPE_HAS(field) (o->struct_size >= offsetof(pipe_generation_options, field) + sizeof(o->field))
  if (PIPE_HAS(max_new_tokens)) opts.max_new_tokens = o->max_new_tokens;
  if (PIPE_HAS(temperature)) opts.sampling.temperature = o->temperature;
  if (PIPE_HAS(top_k)) opts.sampling.top_k = o->top_k;
  if (PIPE_HAS(top_p)) opts.sampling.top_p = o->top_p;
  if (PIPE_HAS(seed)) opts.seed = o->seed;
  if (PIPE_HAS(num_stop_ids) && o->num_stop_ids > 0) {
    if (!o->stop_ids)
      throw Error(Status::InvalidArgument, fn + ": options->stop_ids is NULL but options->num_stop_ids is " +
                                               std::to_string(o->num_stop_ids) + "; give the ids, or 0");
    opts.stop_ids.assign(o->stop_ids, o->stop_ids + o->num_stop_ids);
  }
  if (PIPE_HAS(timeout_ms)) {
    if (o->timeout_ms < 0)
      throw Error(Status::InvalidArgument,
                  fn + ": options->timeout_ms is " + std::to_string(o->timeout_ms) + "; use 0 for no deadline");
    if (o->timeout_ms > 0) opts.deadline = after(o->timeout_ms);
  }
  if (PIPE_HAS(logprobs)) {
    if (o->logprobs != 0 && o->logprobs != 1)
      throw Error(Status::InvalidArgument,
                  fn + ": options->logprobs is " + std::to_string(o->logprobs) + "; give 1 (keep them) or 0");
    opts.logprobs = o->logprobs == 1;
  }
  if (PIPE_HAS(top_logprobs)) {
    if (o->top_logprobs < 0 || o->top_logprobs > libpipe::generate::kMaxTopLogprobs)
      throw Error(Status::InvalidArgument, fn + ": options->top_logprobs is " + std::to_string(o->top_logprobs) +
                                               "; give 0.." + std::to_string(libpipe::generate::kMaxTopLogprobs));
    opts.top_logprobs = o->top_logprobs;
  }
  if (PIPE_HAS(prompt_logprobs)) {
    if (o->prompt_logprobs != 0 && o->prompt_logprobs != 1)
      throw Error(Status::InvalidArgument, fn + ": options->prompt_logprobs is " + std::to_string(o->prompt_logprobs) +
                                               "; give 1 (score it) or 0");
    opts.prompt_logprobs = o->prompt_logprobs == 1;
  }
  if (opts.top_logprobs > 0 && !opts.logprobs && !opts.prompt_logprobs)
    throw Error(Status::InvalidArgument, fn + ": options->top_logprobs is " + std::to_string(opts.top_logprobs) +
                                             " but options->logprobs and prompt_logprobs are 0; set one to 1 as well");
#undef PIPE_HAS
  if (opts.max_new_tokens < 1)
    throw Error(Status::InvalidArgument,
                fn + ": options->max_new_tokens is " + std::to_string(opts.max_new_tokens) + "; give 1 or more");
  // Checked here too so that the message names this function; the engine checks it again.
  try {
    libpipe::generate::validate(opts.sampling);
  } catch (const Error& e) {
    throw Error(e.status(), fn + ": options: " + e.what());
  }
  return opts;
}

}  // namespace

extern "C" {

pipe_status pipe_generator_create(const pipe_plan* plan, const pipe_session_options* session_options,
                                  const pipe_generator_options* generator_options, pipe_generator** generator) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(generator, fn, "generator");
    auto session = libpipe::capi::session_options(session_options, fn, "session_options");
    const auto engine = engine_options(generator_options, fn);
    auto g = std::make_unique<GeneratorHandle>();
    g->engine = std::make_unique<libpipe::generate::Engine>(get(plan)->impl, std::move(session), engine);
    g->session.impl = &g->engine->session();
    *generator = handle(g.release());
  });
}

pipe_status pipe_generator_get_info(const pipe_generator* generator, pipe_generator_info* info) {
  return guarded(__func__, [&](const char* fn) {
    require(generator, fn, "generator");
    require(info, fn, "info");
    require_struct_size(info->struct_size, kGeneratorInfo, fn, "info->struct_size");
    const auto& d = get(generator)->engine->decoder();
    pipe_generator_info full = PIPE_GENERATOR_INFO_INIT;
    full.slots = d.slots;
    full.max_len = d.max_len;
    full.vocab = d.vocab;
    full.cache_bytes_per_slot = d.cache_bytes_per_slot;
    fill(info, full);
  });
}

pipe_status pipe_generator_session(pipe_generator* generator, pipe_session** session) {
  return guarded(__func__, [&](const char* fn) {
    require(generator, fn, "generator");
    require(session, fn, "session");
    *session = handle(&get(generator)->session);
  });
}

void pipe_generator_destroy(pipe_generator* generator) {
  // The engine cancels its sequences and waits for its steps; their handles stay the caller's.
  delete get(generator);
}

pipe_status pipe_generator_get_stats(const pipe_generator* generator, pipe_generator_stats* stats) {
  return guarded(__func__, [&](const char* fn) {
    require(generator, fn, "generator");
    require(stats, fn, "stats");
    require_struct_size(stats->struct_size, kGeneratorStats, fn, "stats->struct_size");
    const auto st = get(generator)->engine->stats();
    pipe_generator_stats full = PIPE_GENERATOR_STATS_INIT;
    full.slots_in_use = st.slots_in_use;
    full.queued = st.queued;
    full.sequences_finished = st.sequences_finished;
    full.prompt_tokens = st.prompt_tokens;
    full.generated_tokens = st.generated_tokens;
    full.steps = st.steps;
    full.tokens_per_s = st.tokens_per_s;
    full.mean_time_to_first_token_ms = st.mean_time_to_first_token_ms;
    full.mean_inter_token_ms = st.mean_inter_token_ms;
    full.mean_rows_per_step = st.mean_rows_per_step;
    full.sampling_ms = st.sampling_ms;
    full.steps_in_flight = st.steps_in_flight;
    full.steps_one_at_a_time = st.steps_one_at_a_time;
    full.steps_pipelined = st.steps_pipelined;
    full.cached_prompt_tokens = st.cached_prompt_tokens;
    fill(stats, full);
  });
}

pipe_status pipe_generator_submit(pipe_generator* generator, const int64_t* prompt, size_t prompt_len,
                                  const pipe_generation_options* options, pipe_generation** generation) {
  return guarded(__func__, [&](const char* fn) {
    require(generator, fn, "generator");
    require(generation, fn, "generation");
    if (prompt_len > 0 && !prompt)
      throw Error(Status::InvalidArgument, std::string(fn) + ": prompt is NULL but prompt_len is " +
                                               std::to_string(prompt_len) + "; give the prompt's token ids");
    auto opts = generation_options(options, fn);
    std::vector<int64_t> ids(prompt, prompt + prompt_len);
    auto g = std::make_unique<GenerationHandle>();
    g->impl = get(generator)->engine->submit(std::move(ids), std::move(opts));
    *generation = handle(g.release());
  });
}

pipe_status pipe_generation_on_event(pipe_generation* generation, pipe_generation_fn fn, void* user_data) {
  return guarded(__func__, [&](const char* function) {
    require(generation, function, "generation");
    require(reinterpret_cast<const void*>(fn), function, "fn");
    // The handle is the caller's until pipe_generation_destroy, after which no callback runs.
    auto event = [fn, user_data, generation](size_t available, bool finished) {
      fn(user_data, generation, available, finished ? 1 : 0);
    };
    if (!get(generation)->impl->on_event(event))
      throw Error(Status::InvalidArgument, std::string(function) +
                                               ": the generation already has a callback (one per generation); "
                                               "tell every listener from that one");
  });
}

pipe_status pipe_generation_fd(pipe_generation* generation, int* fd) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    require(fd, fn, "fd");
    const int descriptor = get(generation)->impl->event_fd();  // Error(Io) leaves *fd untouched
    *fd = descriptor;
  });
}

pipe_status pipe_generation_read(pipe_generation* generation, int64_t* tokens, size_t capacity, size_t* count,
                                 int32_t* finished) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    require(count, fn, "count");
    require(finished, fn, "finished");
    if (capacity > 0) require(tokens, fn, "tokens");
    bool ended = false;
    const size_t n = get(generation)->impl->read(tokens, capacity, &ended);
    *count = n;
    *finished = ended ? 1 : 0;
  });
}

namespace {

// The outputs of pipe_generation_logprobs and pipe_generation_prompt_logprobs: the top lists only where there is
// room for them.
void require_logprob_outputs(const char* fn, const float* logprob, const int64_t* top_ids, const float* top_logprobs,
                             size_t capacity, const size_t* count) {
  require(logprob, fn, "logprob");
  require(count, fn, "count");
  if (capacity > 0) {
    require(top_ids, fn, "top_ids");
    require(top_logprobs, fn, "top_logprobs");
  }
}

void copy_logprobs(const libpipe::generate::TokenLogprobs& lp, float* logprob, int64_t* top_ids, float* top_logprobs,
                   size_t capacity, size_t* count) {
  const size_t n = std::min(capacity, lp.top_ids.size());
  std::copy_n(lp.top_ids.begin(), n, top_ids);
  std::copy_n(lp.top_logprobs.begin(), n, top_logprobs);
  *logprob = lp.logprob;
  *count = n;
}

}  // namespace

pipe_status pipe_generation_logprobs(const pipe_generation* generation, size_t index, float* logprob, int64_t* top_ids,
                                     float* top_logprobs, size_t capacity, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    require_logprob_outputs(fn, logprob, top_ids, top_logprobs, capacity, count);
    auto& g = *get(generation)->impl;
    if (!g.keeps_logprobs())
      throw Error(Status::InvalidArgument, std::string(fn) +
                                               ": the generation keeps no log-probabilities; submit it with "
                                               "pipe_generation_options.logprobs = 1");
    libpipe::generate::TokenLogprobs lp;
    if (!g.logprobs(index, &lp))
      throw Error(Status::InvalidArgument, std::string(fn) + ": no token " + std::to_string(index) +
                                               " has been generated yet (" + std::to_string(g.info().generated_tokens) +
                                               " so far; the first is 0)");
    copy_logprobs(lp, logprob, top_ids, top_logprobs, capacity, count);
  });
}

pipe_status pipe_generation_prompt_logprobs(const pipe_generation* generation, size_t position, float* logprob,
                                            int64_t* top_ids, float* top_logprobs, size_t capacity, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    require_logprob_outputs(fn, logprob, top_ids, top_logprobs, capacity, count);
    auto& g = *get(generation)->impl;
    if (!g.keeps_prompt_logprobs())
      throw Error(Status::InvalidArgument, std::string(fn) +
                                               ": the generation did not score its prompt; submit it with "
                                               "pipe_generation_options.prompt_logprobs = 1");
    const int64_t prompt_tokens = g.info().prompt_tokens;
    if (position == 0 || position >= static_cast<size_t>(prompt_tokens))
      throw Error(Status::InvalidArgument, std::string(fn) + ": position " + std::to_string(position) +
                                               " is not scored: positions 1.." + std::to_string(prompt_tokens - 1) +
                                               " are (the first token has nothing before it)");
    libpipe::generate::TokenLogprobs lp;
    if (!g.prompt_logprobs(position, &lp))
      throw Error(Status::InvalidArgument, std::string(fn) + ": prompt position " + std::to_string(position) +
                                               " is not scored yet; read it once the first token arrived");
    copy_logprobs(lp, logprob, top_ids, top_logprobs, capacity, count);
  });
}

pipe_status pipe_generation_wait(pipe_generation* generation, int64_t timeout_ms) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    auto& g = *get(generation)->impl;
    if (!g.wait_until(after(timeout_ms)))
      throw Error(Status::Timeout, std::string(fn) + ": the sequence is still being generated after " +
                                       std::to_string(timeout_ms) + " ms; wait again, or cancel it");
    const Status status = g.status();
    if (status == Status::Ok) return;
    std::string message = g.message();
    if (message.empty()) message = "the sequence ended without finishing (no message)";
    throw Error(status, message);
  });
}

pipe_status pipe_generation_cancel(pipe_generation* generation) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    get(generation)->impl->cancel();
  });
}

pipe_status pipe_generation_get_info(const pipe_generation* generation, pipe_generation_info* info) {
  return guarded(__func__, [&](const char* fn) {
    require(generation, fn, "generation");
    require(info, fn, "info");
    require_struct_size(info->struct_size, kGenerationInfo, fn, "info->struct_size");
    const auto i = get(generation)->impl->info();
    pipe_generation_info full = PIPE_GENERATION_INFO_INIT;
    full.finish_reason = static_cast<int32_t>(i.finish_reason);
    full.prompt_tokens = i.prompt_tokens;
    full.generated_tokens = i.generated_tokens;
    full.queued_ms = i.queued_ms;
    full.time_to_first_token_ms = i.time_to_first_token_ms;
    full.mean_inter_token_ms = i.mean_inter_token_ms;
    full.cached_tokens = i.cached_tokens;
    fill(info, full);
  });
}

void pipe_generation_destroy(pipe_generation* generation) {
  if (!generation) return;
  // Cancels a sequence that goes on, waits for a callback on another thread and closes the
  // descriptor; afterwards no callback runs, so the handle can go.
  get(generation)->impl->abandon();
  delete get(generation);
}

}  // extern "C"
