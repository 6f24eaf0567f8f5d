// The extern "C" layer: every exported function validates its arguments, calls the C++ runtime,
// and turns any exception into a status code plus a per-thread message. Nothing else lives here.
#include "pipe/pipe.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "capi/dlpack_bridge.h"
#include "runtime/comm/nccl_transport.h"
#include "runtime/error.h"
#include "runtime/graph/model.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/split_spec.h"
#include "runtime/io/safetensors.h"
#include "runtime/log.h"
#include "runtime/planner.h"
#include "runtime/schedule/session.h"
#include "runtime/schedule/worker_host.h"
#include "runtime/stage/stage_module.h"
#include "runtime/stage/weights.h"

// The DLPack layout the bridge assumes (see capi/dlpack_bridge.h).
static_assert(sizeof(DLTensor) == 48 && offsetof(DLTensor, shape) == 24 &&
                  offsetof(DLTensor, byte_offset) == 40,
              "DLTensor layout differs from LibTorch's");
static_assert(sizeof(DLManagedTensor) == 64 && offsetof(DLManagedTensor, deleter) == 56,
              "DLManagedTensor layout differs from LibTorch's");

#define PIPE_CHECK_STATUS(code, name) \
  static_assert(code == static_cast<int32_t>(libpipe::Status::name), #code " mismatch")
PIPE_CHECK_STATUS(PIPE_OK, Ok);
PIPE_CHECK_STATUS(PIPE_ERR_INVALID_ARGUMENT, InvalidArgument);
PIPE_CHECK_STATUS(PIPE_ERR_NOT_FOUND, NotFound);
PIPE_CHECK_STATUS(PIPE_ERR_INVALID_FORMAT, InvalidFormat);
PIPE_CHECK_STATUS(PIPE_ERR_SPLIT, Split);
PIPE_CHECK_STATUS(PIPE_ERR_INPUT, Input);
PIPE_CHECK_STATUS(PIPE_ERR_EXECUTION, Execution);
PIPE_CHECK_STATUS(PIPE_ERR_IO, Io);
PIPE_CHECK_STATUS(PIPE_ERR_OUT_OF_MEMORY, OutOfMemory);
PIPE_CHECK_STATUS(PIPE_ERR_UNSUPPORTED, Unsupported);
PIPE_CHECK_STATUS(PIPE_ERR_INTERNAL, Internal);
PIPE_CHECK_STATUS(PIPE_ERR_TIMEOUT, Timeout);
PIPE_CHECK_STATUS(PIPE_ERR_CANCELLED, Cancelled);
PIPE_CHECK_STATUS(PIPE_ERR_DEADLINE_EXCEEDED, DeadlineExceeded);
PIPE_CHECK_STATUS(PIPE_ERR_COMMUNICATION, Communication);
static_assert(PIPE_LOG_DEBUG == libpipe::log::Debug && PIPE_LOG_ERROR == libpipe::log::Error,
              "log level mismatch");

// The opaque handles of pipe.h are never defined: each is the address of one of these objects,
// cast at the boundary. So the public types stay incomplete everywhere, and the ABI check
// (abidw reads this file's debug information) sees no C++ behind them.
namespace libpipe::capi {

struct ModelHandle {
  std::shared_ptr<const libpipe::graph::Model> impl;
  std::vector<libpipe::graph::ModuleInfo> modules;  // computed once; the strings live here
};

struct PlanOptionsHandle {
  libpipe::PlanRequest request;
};

struct PlanHandle {
  std::shared_ptr<const libpipe::graph::Plan> impl;
  std::string json;
};

struct SessionHandle {
  std::unique_ptr<libpipe::schedule::Session> impl;
};

struct RequestHandle {
  std::shared_ptr<libpipe::schedule::Request> impl;
  std::vector<libpipe::chunk::OutputSpec> output_specs;  // the session's, which it may outlive
};

struct TensorListHandle {
  struct Entry {
    std::string name;
    at::Tensor tensor;
    DLManagedTensor* view = nullptr;  // made by get(), freed with the list or handed out by take()
    bool taken = false;
  };
  std::vector<Entry> entries;

  ~TensorListHandle() {
    for (auto& e : entries)
      if (e.view && e.view->deleter) e.view->deleter(e.view);
  }
};

// One pair of casts per handle type: the public pointer and the object behind it.
#define PIPE_HANDLE(public_type, object_type)                                                         \
  inline object_type* get(public_type* h) { return reinterpret_cast<object_type*>(h); }              \
  inline const object_type* get(const public_type* h) { return reinterpret_cast<const object_type*>(h); } \
  inline public_type* handle(object_type* o) { return reinterpret_cast<public_type*>(o); }
PIPE_HANDLE(pipe_model, ModelHandle)
PIPE_HANDLE(pipe_plan_options, PlanOptionsHandle)
PIPE_HANDLE(pipe_plan, PlanHandle)
PIPE_HANDLE(pipe_session, SessionHandle)
PIPE_HANDLE(pipe_request, RequestHandle)
PIPE_HANDLE(pipe_tensor_list, TensorListHandle)
#undef PIPE_HANDLE

}  // namespace libpipe::capi

using libpipe::capi::get;
using libpipe::capi::handle;

namespace {

using libpipe::Error;
using libpipe::Status;

thread_local std::string t_last_error;

pipe_status fail(pipe_status code, const std::string& message) {
  try {
    t_last_error = message;
  } catch (...) {
    // Out of memory while storing the message: the status still says what happened.
  }
  return code;
}

// Runs `body`, translating every exception into a status and this thread's last error.
// `function` is the exported function's name, handed to `body` for its messages.
template <typename F>
pipe_status guarded(const char* function, F&& body) noexcept {
  t_last_error.clear();
  try {
    body(function);
    return PIPE_OK;
  } catch (const Error& e) {
    return fail(static_cast<pipe_status>(e.status()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(PIPE_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const c10::Error& e) {
    return fail(PIPE_ERR_INTERNAL, std::string("unexpected LibTorch error: ") +
                                       e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(PIPE_ERR_INTERNAL, std::string("unexpected error: ") + e.what());
  } catch (...) {
    return fail(PIPE_ERR_INTERNAL, "unexpected non-standard exception");
  }
}

void require(const void* arg, const char* function, const char* name) {
  if (!arg)
    throw Error(Status::InvalidArgument, std::string(function) + ": " + name + " is NULL");
}

void require_index(size_t index, size_t size, const char* function, const char* what) {
  if (index >= size)
    throw Error(Status::InvalidArgument, std::string(function) + ": " + what + " " +
                                             std::to_string(index) + " is out of range (there are " +
                                             std::to_string(size) + ")");
}

libpipe::capi::TensorListHandle::Entry& live_entry(pipe_tensor_list* list, size_t index, const char* function) {
  require_index(index, get(list)->entries.size(), function, "index");
  auto& e = get(list)->entries[index];
  if (e.taken)
    throw Error(Status::InvalidArgument, std::string(function) + ": entry '" + e.name +
                                             "' was already taken out of the list");
  return e;
}

pipe_tensor_list* make_list(std::vector<libpipe::NamedTensor> tensors) {
  auto list = std::make_unique<libpipe::capi::TensorListHandle>();
  for (auto& t : tensors) list->entries.push_back({std::move(t.name), std::move(t.tensor)});
  return handle(list.release());
}

const std::vector<std::string>& stage_names(const pipe_plan* plan, size_t stage, int32_t kind,
                                            const char* function) {
  require(plan, function, "plan");
  require_index(stage, get(plan)->impl->num_stages(), function, "stage");
  const auto& sp = get(plan)->impl->stage(stage);
  if (kind == PIPE_NAMES_PARAMETERS) return sp.parameters;
  if (kind == PIPE_NAMES_BUFFERS) return sp.buffers;
  throw Error(Status::InvalidArgument, std::string(function) + ": kind " + std::to_string(kind) +
                                           " is not a PIPE_NAMES_* value");
}

libpipe::chunk::InputSpec input_spec(const pipe_chunk_spec& c, size_t index, const char* function) {
  using Kind = libpipe::chunk::InputSpec::Kind;
  libpipe::chunk::InputSpec spec;
  spec.dim = c.dim;
  switch (c.kind) {
    case PIPE_CHUNK_DEFAULT: spec.kind = Kind::Default; break;
    case PIPE_CHUNK_SPLIT: spec.kind = Kind::Split; break;
    case PIPE_CHUNK_REPLICATE: spec.kind = Kind::Replicate; break;
    default:
      throw Error(Status::InvalidArgument, std::string(function) + ": input_specs[" + std::to_string(index) +
                                               "].kind is " + std::to_string(c.kind) +
                                               "; inputs take PIPE_CHUNK_DEFAULT, PIPE_CHUNK_SPLIT or PIPE_CHUNK_REPLICATE");
  }
  return spec;
}

libpipe::chunk::OutputSpec output_spec(const pipe_chunk_spec& c, size_t index, const char* function) {
  using Kind = libpipe::chunk::OutputSpec::Kind;
  libpipe::chunk::OutputSpec spec;
  spec.dim = c.dim;
  switch (c.kind) {
    case PIPE_CHUNK_DEFAULT: spec.kind = Kind::Concat; spec.dim = 0; break;
    case PIPE_CHUNK_CONCAT: spec.kind = Kind::Concat; break;
    case PIPE_CHUNK_SUM: spec.kind = Kind::Sum; break;
    case PIPE_CHUNK_EQUAL: spec.kind = Kind::Equal; break;
    default:
      throw Error(Status::InvalidArgument, std::string(function) + ": output_specs[" + std::to_string(index) +
                                               "].kind is " + std::to_string(c.kind) +
                                               "; outputs take PIPE_CHUNK_DEFAULT, PIPE_CHUNK_CONCAT, PIPE_CHUNK_SUM or "
                                               "PIPE_CHUNK_EQUAL");
  }
  return spec;
}

libpipe::stage::StageOptions stage_options(const pipe_stage_options* o, const char* function) {
  libpipe::stage::StageOptions opts;
  if (!o) return opts;
  if (o->struct_size < sizeof(uint32_t))
    throw Error(Status::InvalidArgument, std::string(function) + ": stage options struct_size is " +
                                             std::to_string(o->struct_size) +
                                             "; initialise them with PIPE_STAGE_OPTIONS_INIT");
#define PIPE_HAS(field) (o->struct_size >= offsetof(pipe_stage_options, field) + sizeof(o->field))
  if (PIPE_HAS(dtype)) {
    switch (o->dtype) {
      case PIPE_DTYPE_KEEP: break;
      case PIPE_DTYPE_FLOAT32: opts.dtype = at::kFloat; break;
      case PIPE_DTYPE_FLOAT16: opts.dtype = at::kHalf; break;
      case PIPE_DTYPE_BFLOAT16: opts.dtype = at::kBFloat16; break;
      default:
        throw Error(Status::InvalidArgument, std::string(function) + ": stage options dtype " +
                                                 std::to_string(o->dtype) + " is not a PIPE_DTYPE_* value");
    }
  }
  if (PIPE_HAS(weights) && o->weights) opts.weights = o->weights;
  if (PIPE_HAS(progress_user_data) && o->progress) {
    auto fn = o->progress;
    void* user = o->progress_user_data;
    opts.progress = [fn, user](size_t stage, uint64_t done, uint64_t total) { fn(user, stage, done, total); };
  }
#undef PIPE_HAS
  return opts;
}

libpipe::schedule::RunOptions run_options(const pipe_run_options* o, const char* function) {
  libpipe::schedule::RunOptions opts;
  if (!o) return opts;
  if (o->struct_size < sizeof(uint32_t))
    throw Error(Status::InvalidArgument, std::string(function) + ": options->struct_size is " +
                                             std::to_string(o->struct_size) +
                                             "; initialise the options with PIPE_RUN_OPTIONS_INIT");
  if (o->struct_size >= offsetof(pipe_run_options, timeout_ms) + sizeof(int64_t)) {
    if (o->timeout_ms < 0)
      throw Error(Status::InvalidArgument, std::string(function) + ": options->timeout_ms is " +
                                               std::to_string(o->timeout_ms) + "; use 0 for no deadline");
    if (o->timeout_ms > 0) opts.deadline = libpipe::schedule::Clock::now() + std::chrono::milliseconds(o->timeout_ms);
  }
  return opts;
}

std::vector<c10::IValue> borrow_inputs(const DLManagedTensor* const* inputs, size_t num_inputs, const char* function) {
  if (num_inputs > 0) require(inputs, function, "inputs");
  std::vector<c10::IValue> args;
  args.reserve(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) {
    if (!inputs[i])
      throw Error(Status::InvalidArgument, std::string(function) + ": inputs[" + std::to_string(i) + "] is NULL");
    try {
      args.emplace_back(libpipe::capi::tensor_from_borrowed_dlpack(inputs[i]));
    } catch (const c10::Error& e) {
      throw Error(Status::Input, std::string(function) + ": inputs[" + std::to_string(i) +
                                     "] is not a tensor LibTorch can read: " + e.what_without_backtrace());
    }
  }
  return args;
}

}  // namespace

extern "C" {

const char* pipe_version(void) {
#define PIPE_STR2(x) #x
#define PIPE_STR(x) PIPE_STR2(x)
  return PIPE_STR(PIPE_VERSION_MAJOR) "." PIPE_STR(PIPE_VERSION_MINOR) "." PIPE_STR(PIPE_VERSION_PATCH);
}

const char* pipe_status_string(pipe_status status) {
  switch (status) {
    case PIPE_OK: return "PIPE_OK";
    case PIPE_ERR_INVALID_ARGUMENT: return "PIPE_ERR_INVALID_ARGUMENT";
    case PIPE_ERR_NOT_FOUND: return "PIPE_ERR_NOT_FOUND";
    case PIPE_ERR_INVALID_FORMAT: return "PIPE_ERR_INVALID_FORMAT";
    case PIPE_ERR_SPLIT: return "PIPE_ERR_SPLIT";
    case PIPE_ERR_INPUT: return "PIPE_ERR_INPUT";
    case PIPE_ERR_EXECUTION: return "PIPE_ERR_EXECUTION";
    case PIPE_ERR_IO: return "PIPE_ERR_IO";
    case PIPE_ERR_OUT_OF_MEMORY: return "PIPE_ERR_OUT_OF_MEMORY";
    case PIPE_ERR_UNSUPPORTED: return "PIPE_ERR_UNSUPPORTED";
    case PIPE_ERR_INTERNAL: return "PIPE_ERR_INTERNAL";
    case PIPE_ERR_TIMEOUT: return "PIPE_ERR_TIMEOUT";
    case PIPE_ERR_CANCELLED: return "PIPE_ERR_CANCELLED";
    case PIPE_ERR_DEADLINE_EXCEEDED: return "PIPE_ERR_DEADLINE_EXCEEDED";
    case PIPE_ERR_COMMUNICATION: return "PIPE_ERR_COMMUNICATION";
    default: return "PIPE_ERR_UNKNOWN";
  }
}

const char* pipe_last_error(void) { return t_last_error.c_str(); }

pipe_status pipe_set_log_callback(pipe_log_fn callback, void* user_data, int32_t min_level) {
  return guarded(__func__, [&](const char* fn) {
    if (min_level < PIPE_LOG_DEBUG || min_level > PIPE_LOG_ERROR)
      throw Error(Status::InvalidArgument, std::string(fn) + ": min_level " +
                                               std::to_string(min_level) + " is not a PIPE_LOG_* value");
    libpipe::log::set_sink(callback, user_data, min_level);
  });
}

/* ---- tensor lists ---- */

pipe_status pipe_tensor_list_size(const pipe_tensor_list* list, size_t* size) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(size, fn, "size");
    *size = get(list)->entries.size();
  });
}

pipe_status pipe_tensor_list_name(const pipe_tensor_list* list, size_t index, const char** name) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require_index(index, get(list)->entries.size(), fn, "index");
    *name = get(list)->entries[index].name.c_str();
  });
}

pipe_status pipe_tensor_list_find(const pipe_tensor_list* list, const char* name, size_t* index) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require(index, fn, "index");
    for (size_t i = 0; i < get(list)->entries.size(); ++i)
      if (get(list)->entries[i].name == name) {
        *index = i;
        return;
      }
    throw Error(Status::NotFound, std::string(fn) + ": no entry named '" + name + "'");
  });
}

pipe_status pipe_tensor_list_get(pipe_tensor_list* list, size_t index, const DLManagedTensor** tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(tensor, fn, "tensor");
    auto& e = live_entry(list, index, fn);
    if (!e.view) e.view = static_cast<DLManagedTensor*>(libpipe::capi::tensor_to_dlpack(e.tensor));
    *tensor = e.view;
  });
}

pipe_status pipe_tensor_list_take(pipe_tensor_list* list, size_t index, DLManagedTensor** tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(tensor, fn, "tensor");
    auto& e = live_entry(list, index, fn);
    DLManagedTensor* out =
        e.view ? e.view : static_cast<DLManagedTensor*>(libpipe::capi::tensor_to_dlpack(e.tensor));
    e.view = nullptr;
    e.tensor.reset();
    e.taken = true;
    *tensor = out;
  });
}

pipe_status pipe_tensor_list_create(pipe_tensor_list** list) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    *list = handle(new libpipe::capi::TensorListHandle());
  });
}

pipe_status pipe_tensor_list_append(pipe_tensor_list* list, const char* name, const DLManagedTensor* tensor) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(name, fn, "name");
    require(tensor, fn, "tensor");
    if (!*name) throw Error(Status::InvalidArgument, std::string(fn) + ": name is empty");
    auto& entries = get(list)->entries;
    for (const auto& e : entries)
      if (e.name == name)
        throw Error(Status::InvalidArgument, std::string(fn) + ": the list already has an entry '" + name + "'");
    at::Tensor copy;
    try {
      copy = libpipe::capi::tensor_from_borrowed_dlpack(tensor).clone(at::MemoryFormat::Contiguous);
    } catch (const c10::Error& e) {
      throw Error(Status::Input, std::string(fn) + ": '" + name + "' is not a tensor LibTorch can read: " +
                                     e.what_without_backtrace());
    }
    entries.push_back({name, std::move(copy)});
  });
}

void pipe_tensor_list_destroy(pipe_tensor_list* list) { delete get(list); }

/* ---- safetensors ---- */

pipe_status pipe_safetensors_read(const char* path, pipe_tensor_list** list) {
  return guarded(__func__, [&](const char* fn) {
    require(path, fn, "path");
    require(list, fn, "list");
    *list = make_list(libpipe::io::read_safetensors(path));
  });
}

pipe_status pipe_safetensors_write(const pipe_tensor_list* list, const char* path) {
  return guarded(__func__, [&](const char* fn) {
    require(list, fn, "list");
    require(path, fn, "path");
    std::vector<libpipe::NamedTensor> tensors;
    for (const auto& e : get(list)->entries) {
      if (e.taken)
        throw Error(Status::InvalidArgument, std::string(fn) + ": entry '" + e.name +
                                                 "' was taken out of the list and cannot be written");
      tensors.push_back({e.name, e.tensor});
    }
    libpipe::io::write_safetensors(path, tensors);
  });
}

/* ---- model ---- */

pipe_status pipe_model_load(const char* path, pipe_model** model) {
  return guarded(__func__, [&](const char* fn) {
    require(path, fn, "path");
    require(model, fn, "model");
    auto m = std::make_unique<libpipe::capi::ModelHandle>();
    m->impl = libpipe::graph::Model::load(path);
    m->modules = m->impl->modules();
    *model = handle(m.release());
  });
}

pipe_status pipe_model_num_inputs(const pipe_model* model, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require(count, fn, "count");
    *count = get(model)->impl->input_names().size();
  });
}

pipe_status pipe_model_input_name(const pipe_model* model, size_t index, const char** name) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require(name, fn, "name");
    const auto& names = get(model)->impl->input_names();
    require_index(index, names.size(), fn, "input");
    *name = names[index].c_str();
  });
}

pipe_status pipe_model_num_modules(const pipe_model* model, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require(count, fn, "count");
    *count = get(model)->modules.size();
  });
}

pipe_status pipe_model_module(const pipe_model* model, size_t index, const char** path, const char** type_name,
                              int32_t* depth, uint64_t* num_params, uint64_t* param_bytes) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require_index(index, get(model)->modules.size(), fn, "module");
    const auto& m = get(model)->modules[index];
    if (path) *path = m.path.c_str();
    if (type_name) *type_name = m.type.c_str();
    if (depth) *depth = m.depth;
    if (num_params) *num_params = m.num_params;
    if (param_bytes) *param_bytes = m.param_bytes;
  });
}

void pipe_model_destroy(pipe_model* model) { delete get(model); }

/* ---- plan ---- */

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
      copies.emplace_back(libpipe::capi::tensor_from_borrowed_dlpack(inputs[i]).clone());
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

pipe_status pipe_plan_stage_name(const pipe_plan* plan, size_t stage, int32_t kind, size_t index,
                                 const char** name) {
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
    auto module = libpipe::stage::build_stage_module(*get(plan)->impl, stage);
    libpipe::stage::load_stage_weights(module, *get(plan)->impl, stage, opts, checkpoint.get());
    try {
      module.save(path);
    } catch (const c10::Error& e) {
      throw Error(Status::Io, std::string(fn) + ": cannot write '" + path + "': " + e.what_without_backtrace());
    }
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

/* ---- session ---- */

pipe_status pipe_session_create(const pipe_plan* plan, const pipe_session_options* options,
                                pipe_session** session) {
  return guarded(__func__, [&](const char* fn) {
    require(plan, fn, "plan");
    require(session, fn, "session");
    const pipe_session_options defaults = PIPE_SESSION_OPTIONS_INIT;
    const pipe_session_options* o = options ? options : &defaults;
    if (o->struct_size < offsetof(pipe_session_options, num_microbatches))
      throw Error(Status::InvalidArgument, std::string(fn) + ": options->struct_size is " +
                                               std::to_string(o->struct_size) +
                                               "; initialise the options with PIPE_SESSION_OPTIONS_INIT");
    // Fields beyond what the caller's struct_size covers keep their defaults.
#define PIPE_HAS(field) (o->struct_size >= offsetof(pipe_session_options, field) + sizeof(o->field))
    libpipe::schedule::SessionOptions opts;
    if (PIPE_HAS(num_microbatches)) opts.num_microbatches = o->num_microbatches;
    if (PIPE_HAS(threads_per_stage)) opts.threads_per_stage = o->threads_per_stage;
    if (PIPE_HAS(max_inflight)) opts.max_inflight = o->max_inflight;
    if (PIPE_HAS(num_input_specs) && o->num_input_specs > 0) {
      require(o->input_specs, fn, "options->input_specs");
      for (size_t i = 0; i < o->num_input_specs; ++i)
        opts.input_specs.push_back(input_spec(o->input_specs[i], i, fn));
    }
    if (PIPE_HAS(num_output_specs) && o->num_output_specs > 0) {
      require(o->output_specs, fn, "options->output_specs");
      for (size_t i = 0; i < o->num_output_specs; ++i)
        opts.output_specs.push_back(output_spec(o->output_specs[i], i, fn));
    }
    if (PIPE_HAS(stage_options)) opts.stage = stage_options(o->stage_options, fn);
    if (PIPE_HAS(microbatching)) {
      if (o->microbatching != PIPE_MICROBATCHING_ADAPTIVE && o->microbatching != PIPE_MICROBATCHING_FIXED)
        throw Error(Status::InvalidArgument,
                    std::string(fn) + ": options->microbatching is " + std::to_string(o->microbatching) +
                        "; use PIPE_MICROBATCHING_ADAPTIVE or PIPE_MICROBATCHING_FIXED");
      opts.adaptive_microbatches = o->microbatching == PIPE_MICROBATCHING_ADAPTIVE;
    }
    auto& dist = opts.distributed;
    if (PIPE_HAS(transport)) {
      switch (o->transport) {
        case PIPE_TRANSPORT_LOCAL: dist.transport = libpipe::schedule::TransportKind::Local; break;
        case PIPE_TRANSPORT_GLOO: dist.transport = libpipe::schedule::TransportKind::Gloo; break;
        case PIPE_TRANSPORT_NCCL: dist.transport = libpipe::schedule::TransportKind::Nccl; break;
        default:
          throw Error(Status::InvalidArgument, std::string(fn) + ": options->transport is " +
                                                   std::to_string(o->transport) +
                                                   "; use PIPE_TRANSPORT_LOCAL, PIPE_TRANSPORT_GLOO or PIPE_TRANSPORT_NCCL");
      }
    }
    if (PIPE_HAS(world_size)) dist.world_size = o->world_size == 0 ? 1 : o->world_size;  // zeroed structs
    if (PIPE_HAS(store) && o->store) dist.store = o->store;
    if (PIPE_HAS(comm_timeout_ms)) {
      if (o->comm_timeout_ms < 0)
        throw Error(Status::InvalidArgument, std::string(fn) + ": options->comm_timeout_ms is " +
                                                 std::to_string(o->comm_timeout_ms) + "; give 0 (one minute) or more");
      if (o->comm_timeout_ms > 0) dist.comm_timeout = std::chrono::milliseconds(o->comm_timeout_ms);
    }
    if (dist.transport == libpipe::schedule::TransportKind::Local && !dist.store.empty())
      throw Error(Status::InvalidArgument, std::string(fn) + ": options->store is set but the transport is local; "
                                                             "choose PIPE_TRANSPORT_GLOO or NCCL, or leave store NULL");
    if (dist.transport != libpipe::schedule::TransportKind::Local && dist.world_size < 2)
      throw Error(Status::InvalidArgument, std::string(fn) + ": a Gloo or NCCL session needs options->world_size >= 2 "
                                                             "(this process and at least one worker), got " +
                                               std::to_string(dist.world_size));
    if (dist.transport == libpipe::schedule::TransportKind::Nccl) {
      std::string why;
      if (!libpipe::comm::nccl_available(&why)) throw Error(Status::Unsupported, std::string(fn) + ": " + why);
    }
#undef PIPE_HAS
    auto s = std::make_unique<libpipe::capi::SessionHandle>();
    s->impl = std::make_unique<libpipe::schedule::Session>(get(plan)->impl, std::move(opts));
    *session = handle(s.release());
  });
}

pipe_status pipe_session_run(pipe_session* session, const DLManagedTensor* const* inputs, size_t num_inputs,
                             const pipe_run_options* options, pipe_tensor_list** outputs) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(outputs, fn, "outputs");
    auto args = borrow_inputs(inputs, num_inputs, fn);
    *outputs = make_list(get(session)->impl->run(args, run_options(options, fn)));
  });
}

pipe_status pipe_session_submit(pipe_session* session, const DLManagedTensor* const* inputs, size_t num_inputs,
                                const pipe_run_options* options, pipe_request** request) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    require(request, fn, "request");
    auto args = borrow_inputs(inputs, num_inputs, fn);
    // The call outlives this function, the caller's tensors may not: it runs on copies.
    for (auto& a : args) a = a.toTensor().clone();
    auto r = std::make_unique<libpipe::capi::RequestHandle>();
    r->output_specs = get(session)->impl->options().output_specs;
    r->impl = get(session)->impl->submit(args, run_options(options, fn));
    *request = handle(r.release());
  });
}

pipe_status pipe_request_wait(pipe_request* request, int64_t timeout_ms, pipe_tensor_list** outputs) {
  return guarded(__func__, [&](const char* fn) {
    require(request, fn, "request");
    require(outputs, fn, "outputs");
    const auto until = timeout_ms < 0 ? libpipe::schedule::Clock::time_point::max()
                                      : libpipe::schedule::Clock::now() + std::chrono::milliseconds(timeout_ms);
    if (!get(request)->impl->wait_until(until))
      throw Error(Status::Timeout, std::string(fn) + ": the call is still running after " +
                                       std::to_string(timeout_ms) + " ms; wait again, or cancel it");
    *outputs = make_list(get(request)->impl->result(get(request)->output_specs));
  });
}

pipe_status pipe_request_cancel(pipe_request* request) {
  return guarded(__func__, [&](const char* fn) {
    require(request, fn, "request");
    get(request)->impl->cancel();
  });
}

void pipe_request_destroy(pipe_request* request) {
  if (!request) return;
  get(request)->impl->cancel();  // no-op for a finished call; the workers drop what is left
  delete get(request);
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
    if (stats->struct_size < sizeof(uint32_t))
      throw Error(Status::InvalidArgument, std::string(fn) + ": stats->struct_size is " +
                                               std::to_string(stats->struct_size) +
                                               "; initialise it with PIPE_STAGE_STATS_INIT");
    const auto st = get(session)->impl->stats(stage);
    pipe_stage_stats full = PIPE_STAGE_STATS_INIT;
    full.microbatches = st.microbatches;
    full.failures = st.failures;
    full.busy_ms = st.busy_ms;
    full.idle_ms = st.idle_ms;
    full.queue_depth = st.queue_depth;
    // Write only what the caller's struct has room for; struct_size stays the caller's.
    const uint32_t size = std::min<uint32_t>(stats->struct_size, sizeof full);
    std::memcpy(reinterpret_cast<char*>(stats) + sizeof(uint32_t), reinterpret_cast<const char*>(&full) + sizeof(uint32_t),
                size - sizeof(uint32_t));
  });
}

pipe_status pipe_session_trace_start(pipe_session* session) {
  return guarded(__func__, [&](const char* fn) {
    require(session, fn, "session");
    get(session)->impl->start_trace();
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
      throw Error(Status::Communication, "the session is broken (" + why + "); destroy it, restart its workers and "
                                         "create a new one");
  });
}

void pipe_session_destroy(pipe_session* session) { delete get(session); }

pipe_status pipe_worker_run(const pipe_worker_options* options) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    if (options->struct_size < offsetof(pipe_worker_options, store) + sizeof(options->store))
      throw Error(Status::InvalidArgument, std::string(fn) + ": options->struct_size is " +
                                               std::to_string(options->struct_size) +
                                               "; initialise the options with PIPE_WORKER_OPTIONS_INIT");
#define PIPE_HAS(field) (options->struct_size >= offsetof(pipe_worker_options, field) + sizeof(options->field))
    require(options->store, fn, "options->store");
    libpipe::schedule::WorkerOptions w;
    w.rank = options->rank;
    w.world_size = options->world_size;
    w.store = options->store;
    if (PIPE_HAS(comm_timeout_ms)) {
      if (options->comm_timeout_ms < 0)
        throw Error(Status::InvalidArgument, std::string(fn) + ": options->comm_timeout_ms is " +
                                                 std::to_string(options->comm_timeout_ms) + "; give 0 (one minute) or more");
      if (options->comm_timeout_ms > 0) w.comm_timeout = std::chrono::milliseconds(options->comm_timeout_ms);
    }
    if (PIPE_HAS(threads_per_stage)) {
      if (options->threads_per_stage < 0)
        throw Error(Status::InvalidArgument, std::string(fn) + ": options->threads_per_stage is " +
                                                 std::to_string(options->threads_per_stage) + "; give 0 (the driver's) or more");
      w.threads_per_stage = options->threads_per_stage;
    }
#undef PIPE_HAS
    libpipe::schedule::serve_worker(w);
  });
}

}  // extern "C"
