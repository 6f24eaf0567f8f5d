// The C ABI: sessions, their calls (blocking, or submitted as a request: capi/request.cpp),
// statistics and traces.
#include <chrono>
#include <cstddef>
#include <fstream>

#include "capi/boundary.h"
#include "capi/struct_sizes.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

namespace {

libpipe::chunk::InputSpec input_spec(const pipe_chunk_spec& c, size_t index, const char* function) {
  using Kind = libpipe::chunk::InputSpec::Kind;
  libpipe::chunk::InputSpec spec;
  spec.dim = c.dim;
  switch (c.kind) {
    case PIPE_CHUNK_DEFAULT: spec.kind = Kind::Default; break;
    case PIPE_CHUNK_SPLIT: spec.kind = Kind::Split; break;
    case PIPE_CHUNK_REPLICATE: spec.kind = Kind::Replicate; break;
    default:
      throw Error(Status::InvalidArgument,
                  std::string(function) + ": input_specs[" + std::to_string(index) + "].kind is " +
                      std::to_string(c.kind) +
                      "; inputs take PIPE_CHUNK_DEFAULT, PIPE_CHUNK_SPLIT or PIPE_CHUNK_REPLICATE");
  }
  return spec;
}

libpipe::chunk::OutputSpec output_spec(const pipe_chunk_spec& c, size_t index, const char* function) {
  using Kind = libpipe::chunk::OutputSpec::Kind;
  libpipe::chunk::OutputSpec spec;
  spec.dim = c.dim;
  switch (c.kind) {
    case PIPE_CHUNK_DEFAULT:
      spec.kind = Kind::Concat;
      spec.dim = 0;
      break;
    case PIPE_CHUNK_CONCAT: spec.kind = Kind::Concat; break;
    case PIPE_CHUNK_SUM: spec.kind = Kind::Sum; break;
    case PIPE_CHUNK_EQUAL: spec.kind = Kind::Equal; break;
    default:
      throw Error(Status::InvalidArgument,
                  std::string(function) + ": output_specs[" + std::to_string(index) + "].kind is " +
                      std::to_string(c.kind) +
                      "; outputs take PIPE_CHUNK_DEFAULT, PIPE_CHUNK_CONCAT, PIPE_CHUNK_SUM or "
                      "PIPE_CHUNK_EQUAL");
  }
  return spec;
}

libpipe::schedule::RunOptions run_options(const pipe_run_options* o, const char* function) {
  libpipe::schedule::RunOptions opts;
  if (!o) return opts;
  require_struct_size(o->struct_size, kRunOptions, function, "options->struct_size");
  if (o->struct_size >= offsetof(pipe_run_options, timeout_ms) + sizeof(int64_t)) {
    if (o->timeout_ms < 0)
      throw Error(Status::InvalidArgument, std::string(function) + ": options->timeout_ms is " +
                                               std::to_string(o->timeout_ms) + "; use 0 for no deadline");
    const auto now = libpipe::schedule::Clock::now();
    // A timeout past what the clock can count is no deadline (adding it would overflow).
    const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(opts.deadline - now).count();
    if (o->timeout_ms > 0 && o->timeout_ms < room) opts.deadline = now + std::chrono::milliseconds(o->timeout_ms);
  }
  return opts;
}

// A generator drives its session step by step (its caches hold its sequences): calls of the
// caller's own would interleave with them.
void require_owned(const pipe_session* session, const char* function) {
  if (get(session)->borrowed())
    throw Error(Status::InvalidArgument, std::string(function) +
                                             ": session is a generator's (pipe_generator_session), which only "
                                             "the generator runs; use pipe_generator_submit, or create a session "
                                             "of your own with pipe_session_create");
}

}  // namespace

namespace libpipe::capi {

libpipe::schedule::SessionOptions session_options(const pipe_session_options* options, const char* function,
                                                  const char* param) {
  const pipe_session_options defaults = PIPE_SESSION_OPTIONS_INIT;
  const pipe_session_options* o = options ? options : &defaults;
  // "options->transport": the field as the caller's code names it.
  const auto field = [param](const char* name) { return std::string(param) + "->" + name; };
  const std::string fn = function;
  require_struct_size(o->struct_size, kSessionOptions, function, field("struct_size").c_str());
  // Fields beyond what the caller's struct_size covers keep their defaults.
#define PIPE_HAS(name) (o->struct_size >= offsetof(pipe_session_options, name) + sizeof(o->name))
  libpipe::schedule::SessionOptions opts;
  if (PIPE_HAS(num_microbatches)) opts.num_microbatches = o->num_microbatches;
  if (PIPE_HAS(threads_per_stage)) opts.threads_per_stage = o->threads_per_stage;
  if (PIPE_HAS(max_inflight)) opts.max_inflight = o->max_inflight;
  if (PIPE_HAS(num_input_specs) && o->num_input_specs > 0) {
    require(o->input_specs, function, field("input_specs").c_str());
    for (size_t i = 0; i < o->num_input_specs; ++i)
      opts.input_specs.push_back(input_spec(o->input_specs[i], i, function));
  }
  if (PIPE_HAS(num_output_specs) && o->num_output_specs > 0) {
    require(o->output_specs, function, field("output_specs").c_str());
    for (size_t i = 0; i < o->num_output_specs; ++i)
      opts.output_specs.push_back(output_spec(o->output_specs[i], i, function));
  }
  if (PIPE_HAS(stage_options)) opts.stage = stage_options(o->stage_options, function);
  if (PIPE_HAS(microbatching)) {
    if (o->microbatching != PIPE_MICROBATCHING_ADAPTIVE && o->microbatching != PIPE_MICROBATCHING_FIXED)
      throw Error(Status::InvalidArgument, fn + ": " + field("microbatching") + " is " +
                                               std::to_string(o->microbatching) +
                                               "; use PIPE_MICROBATCHING_ADAPTIVE or PIPE_MICROBATCHING_FIXED");
    opts.adaptive_microbatches = o->microbatching == PIPE_MICROBATCHING_ADAPTIVE;
  }
  auto& dist = opts.distributed;
  if (PIPE_HAS(transport)) {
    switch (o->transport) {
      case PIPE_TRANSPORT_LOCAL: dist.transport = libpipe::processes::TransportKind::Local; break;
      case PIPE_TRANSPORT_TCP: dist.transport = libpipe::processes::TransportKind::Tcp; break;
      case PIPE_TRANSPORT_NCCL: dist.transport = libpipe::processes::TransportKind::Nccl; break;
      default:
        throw Error(Status::InvalidArgument,
                    fn + ": " + field("transport") + " is " + std::to_string(o->transport) +
                        "; use PIPE_TRANSPORT_LOCAL, PIPE_TRANSPORT_TCP or PIPE_TRANSPORT_NCCL");
    }
  }
  if (PIPE_HAS(world_size)) dist.world_size = o->world_size == 0 ? 1 : o->world_size;  // zeroed structs
  if (PIPE_HAS(store) && o->store) dist.store = o->store;
  if (PIPE_HAS(token) && o->token) dist.token = o->token;
  if (PIPE_HAS(comm_timeout_ms)) {
    if (o->comm_timeout_ms < 0)
      throw Error(Status::InvalidArgument, fn + ": " + field("comm_timeout_ms") + " is " +
                                               std::to_string(o->comm_timeout_ms) + "; give 0 (one minute) or more");
    if (o->comm_timeout_ms > 0) dist.comm_timeout = std::chrono::milliseconds(o->comm_timeout_ms);
  }
  if (PIPE_HAS(devices) && o->devices) opts.devices = o->devices;
  if (PIPE_HAS(outputs)) {
    if (o->outputs != PIPE_OUTPUTS_ON_CPU && o->outputs != PIPE_OUTPUTS_ON_DEVICE)
      throw Error(Status::InvalidArgument, fn + ": " + field("outputs") + " is " + std::to_string(o->outputs) +
                                               "; use PIPE_OUTPUTS_ON_CPU or PIPE_OUTPUTS_ON_DEVICE");
    opts.outputs_on_device = o->outputs == PIPE_OUTPUTS_ON_DEVICE;
  }
#undef PIPE_HAS
  // The rules among the options (a transport and its world size, a store, NCCL's presence) are the
  // session's (Session's constructor), for every way a session is made.
  return opts;
}

}  // namespace libpipe::capi

extern "C" {

pipe_status pipe_session_create(const pipe_plan* plan, const pipe_session_options* options, pipe_session** session) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(session, fn, "session");
    auto opts = session_options(options, fn, "options");
    auto s = std::make_unique<libpipe::capi::SessionHandle>();
    s->owned = std::make_unique<libpipe::schedule::Session>(get(plan)->impl, std::move(opts));
    s->impl = s->owned.get();
    *session = handle(s.release());
  });
}

pipe_status pipe_session_run(pipe_session* session, const DLManagedTensor* const* inputs, size_t num_inputs,
                             const pipe_run_options* options, pipe_tensor_list** outputs) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(outputs, fn, "outputs");
    require_owned(session, fn);
    const auto run = run_options(options, fn);
    auto args = borrow_inputs(inputs, num_inputs, fn);
    *outputs = make_list(get(session)->impl->run(args, run));
  });
}

pipe_status pipe_session_submit(pipe_session* session, const DLManagedTensor* const* inputs, size_t num_inputs,
                                const pipe_run_options* options, pipe_request** request) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(request, fn, "request");
    require_owned(session, fn);
    const auto run = run_options(options, fn);  // checked before the inputs are copied
    auto args = borrow_inputs(inputs, num_inputs, fn);
    // The call outlives this function, the caller's tensors may not: it runs on copies.
    for (auto& a : args) a = a.toTensor().clone();
    auto r = std::make_unique<libpipe::capi::RequestHandle>();
    r->output_specs = get(session)->impl->options().output_specs;
    r->impl = get(session)->impl->submit(args, run);
    *request = handle(r.release());
  });
}

pipe_status pipe_session_num_stages(const pipe_session* session, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(count, fn, "count");
    *count = get(session)->impl->num_stages();
  });
}

pipe_status pipe_session_stage_stats(const pipe_session* session, size_t stage, pipe_stage_stats* stats) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(stats, fn, "stats");
    require_index(stage, get(session)->impl->num_stages(), fn, "stage");
    require_struct_size(stats->struct_size, kStageStats, fn, "stats->struct_size");
    const auto st = get(session)->impl->stats(stage);
    pipe_stage_stats full = PIPE_STAGE_STATS_INIT;
    full.microbatches = st.microbatches;
    full.failures = st.failures;
    full.busy_ms = st.busy_ms;
    full.idle_ms = st.idle_ms;
    full.queue_depth = st.queue_depth;
    // Write only what the caller's struct has room for; struct_size stays the caller's.
    const uint32_t size = std::min<uint32_t>(stats->struct_size, sizeof full);
    std::memcpy(reinterpret_cast<char*>(stats) + sizeof(uint32_t),
                reinterpret_cast<const char*>(&full) + sizeof(uint32_t), size - sizeof(uint32_t));
  });
}

pipe_status pipe_session_trace_start(pipe_session* session) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    get(session)->impl->start_trace();
  });
}

pipe_status pipe_session_trace_start_with_operators(pipe_session* session) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    get(session)->impl->start_trace(/*operators=*/true);
  });
}

pipe_status pipe_session_trace_stop(pipe_session* session, const char* path) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    const std::string json = get(session)->impl->stop_trace();
    if (!path) return;
    const std::string tmp = std::string(path) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw Error(Status::Io, std::string(fn) + ": cannot create '" + tmp + "' (does the directory exist?)");
      out << json;
      if (!out.flush()) throw Error(Status::Io, std::string(fn) + ": failed writing '" + tmp + "'");
    }
    if (std::rename(tmp.c_str(), path) != 0)
      throw Error(Status::Io, std::string(fn) + ": cannot rename '" + tmp + "' to '" + path + "'");
  });
}

pipe_status pipe_session_check(const pipe_session* session) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    const std::string why = get(session)->impl->broken();
    if (!why.empty())
      throw Error(Status::Communication, "the session is broken (" + why +
                                             "); destroy it, restart its workers and "
                                             "create a new one");
  });
}

void pipe_session_destroy(pipe_session* session) {
  // A generator's session is freed with its generator; the handle stays the generator's.
  if (session && get(session)->borrowed()) return;
  delete get(session);
}

}  // extern "C"
