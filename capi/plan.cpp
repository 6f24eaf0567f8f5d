// The C ABI: plan options (split points, stage counts, example inputs), plans, and saving a stage.
#include "capi/boundary.h"
#include "capi/dlpack_bridge.h"
#include "runtime/graph/split_spec.h"
#include "runtime/stage/stage.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

namespace {

const std::vector<std::string>& stage_names(const pipe_plan* plan, size_t stage, int32_t kind, const char* function) {
  require(plan, function, "plan");
  require_index(stage, get(plan)->impl->num_stages(), function, "stage");
  const auto& sp = get(plan)->impl->stage(stage);
  if (kind == PIPE_NAMES_PARAMETERS) return sp.parameters;
  if (kind == PIPE_NAMES_BUFFERS) return sp.buffers;
  throw Error(Status::InvalidArgument,
              std::string(function) + ": kind " + std::to_string(kind) + " is not a PIPE_NAMES_* value");
}

}  // namespace

extern "C" {

pipe_status pipe_plan_options_create(pipe_plan_options** options) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    *options = handle(new libpipe::capi::PlanOptionsHandle());
  });
}

void pipe_plan_options_destroy(pipe_plan_options* options) { delete get(options); }

pipe_status pipe_plan_options_add_split_point(pipe_plan_options* options, const char* split_point) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    require(split_point, fn, "split_point");
    libpipe::graph::parse_split_point(split_point);  // syntax errors now, unknown modules at plan time
    get(options)->request.split_points.emplace_back(split_point);
  });
}

pipe_status pipe_plan_options_set_stages(pipe_plan_options* options, int32_t num_stages, const char* policy) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    require(policy, fn, "policy");
    libpipe::PlanRequest probe;
    probe.num_stages = num_stages;
    probe.policy = policy;
    libpipe::validate_stage_request(probe);
    get(options)->request.num_stages = num_stages;
    get(options)->request.policy = policy;
  });
}

pipe_status pipe_plan_options_set_example_inputs(pipe_plan_options* options, const DLManagedTensor* const* inputs,
                                                 size_t num_inputs) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    if (num_inputs > 0) require(inputs, fn, "inputs");
    std::vector<c10::IValue> copies;
    for (size_t i = 0; i < num_inputs; ++i) {
      if (!inputs[i])
        throw Error(Status::InvalidArgument, std::string(fn) + ": inputs[" + std::to_string(i) + "] is NULL");
      libpipe::capi::require_readable_dlpack(*inputs[i], fn, "inputs[" + std::to_string(i) + "]");
      try {
        copies.emplace_back(libpipe::capi::tensor_from_borrowed_dlpack(inputs[i]).clone());
      } catch (const c10::Error& e) {
        throw Error(Status::Input, std::string(fn) + ": inputs[" + std::to_string(i) +
                                       "] is not a tensor LibTorch can read: " + e.what_without_backtrace());
      }
    }
    get(options)->request.example_inputs = std::move(copies);
  });
}

pipe_status pipe_plan_create(const pipe_model* model, const pipe_plan_options* options, pipe_plan** plan) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require(plan, fn, "plan");
    auto p = std::make_unique<libpipe::capi::PlanHandle>();
    p->impl = libpipe::make_plan(get(model)->impl, options ? get(options)->request : libpipe::PlanRequest{});
    p->json = p->impl->describe_json();
    *plan = handle(p.release());
  });
}

pipe_status pipe_plan_num_stages(const pipe_plan* plan, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(count, fn, "count");
    *count = get(plan)->impl->num_stages();
  });
}

pipe_status pipe_plan_stage_count_names(const pipe_plan* plan, size_t stage, int32_t kind, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    const auto& names = stage_names(plan, stage, kind, fn);
    require(count, fn, "count");
    *count = names.size();
  });
}

pipe_status pipe_plan_stage_name(const pipe_plan* plan, size_t stage, int32_t kind, size_t index, const char** name) {
  return guarded(__func__, [&](const char* fn) {
    const auto& names = stage_names(plan, stage, kind, fn);
    require(name, fn, "name");
    require_index(index, names.size(), fn, "index");
    *name = names[index].c_str();
  });
}

pipe_status pipe_plan_stage_param_bytes(const pipe_plan* plan, size_t stage, uint64_t* bytes) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(bytes, fn, "bytes");
    require_index(stage, get(plan)->impl->num_stages(), fn, "stage");
    *bytes = get(plan)->impl->stage(stage).param_bytes;
  });
}

pipe_status pipe_plan_stage_estimated_ms(const pipe_plan* plan, size_t stage, double* ms) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(ms, fn, "ms");
    require_index(stage, get(plan)->impl->num_stages(), fn, "stage");
    *ms = get(plan)->impl->stage(stage).estimated_ms;
  });
}

pipe_status pipe_plan_save_stage(const pipe_plan* plan, size_t stage, const pipe_stage_options* options,
                                 const char* path) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(path, fn, "path");
    require_index(stage, get(plan)->impl->num_stages(), fn, "stage");
    const auto opts = stage_options(options, fn);
    auto checkpoint = opts.weights.empty() ? nullptr : libpipe::stage::Checkpoint::open(opts.weights);
    try {
      libpipe::stage::save_stage(*get(plan)->impl, stage, opts, checkpoint.get(), path);
    } catch (const Error& e) {
      if (e.status() != Status::Io) throw;
      throw Error(Status::Io, std::string(fn) + ": " + e.what());
    }
  });
}

pipe_status pipe_plan_stage_weight_bytes(const pipe_plan* plan, size_t stage, const pipe_stage_options* options,
                                         uint64_t* bytes) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(bytes, fn, "bytes");
    require_index(stage, get(plan)->impl->num_stages(), fn, "stage");
    *bytes = libpipe::stage::stored_weight_bytes(*get(plan)->impl, stage, stage_options(options, fn));
  });
}

pipe_status pipe_plan_describe(const pipe_plan* plan, const char** json) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(json, fn, "json");
    *json = get(plan)->json.c_str();
  });
}

void pipe_plan_destroy(pipe_plan* plan) { delete get(plan); }

}  // extern "C"
