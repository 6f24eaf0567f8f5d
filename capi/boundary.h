// What every file of the C ABI shares: the objects behind the opaque handles of pipe.h, the
// translation of exceptions into a status and this thread's last error, argument checks, and the
// conversions more than one handle family needs. Internal: never installed.
#pragma once

#include <c10/util/Exception.h>

#include <memory>
#include <new>
#include <string>
#include <vector>

#include "pipe/pipe.h"
#include "runtime/error.h"
#include "runtime/graph/program.h"
#include "runtime/graph/plan.h"
#include "runtime/named_tensor.h"
#include "runtime/planner/planner.h"
#include "runtime/schedule/session.h"
#include "runtime/stage/stage.h"

// The opaque handles of pipe.h are never defined: each is the address of one of these objects,
// cast at the boundary. So the public types stay incomplete everywhere, and the ABI check
// (abidw reads the debug information of the C ABI's files) sees no C++ behind them.
namespace libpipe::capi {

struct ModelHandle {
  std::shared_ptr<const libpipe::graph::Program> impl;
};

struct PlanOptionsHandle {
  libpipe::PlanRequest request;
};

struct PlanHandle {
  std::shared_ptr<const libpipe::graph::Plan> impl;
  std::string json;
};

// A session the caller created owns it; the session of a generator (pipe_generator_session) is
// the generator's engine's, lent to the caller for statistics and traces: `owned` is then empty,
// and pipe_session_destroy, run and submit refuse it (the engine alone drives that session).
struct SessionHandle {
  std::unique_ptr<libpipe::schedule::Session> owned;
  libpipe::schedule::Session* impl = nullptr;  // owned.get(), or the generator's session
  bool borrowed() const { return !owned; }
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
#define PIPE_HANDLE(public_type, object_type)                                                             \
  inline object_type* get(public_type* h) { return reinterpret_cast<object_type*>(h); }                   \
  inline const object_type* get(const public_type* h) { return reinterpret_cast<const object_type*>(h); } \
  inline public_type* handle(object_type* o) { return reinterpret_cast<public_type*>(o); }
PIPE_HANDLE(pipe_model, ModelHandle)
PIPE_HANDLE(pipe_plan_options, PlanOptionsHandle)
PIPE_HANDLE(pipe_plan, PlanHandle)
PIPE_HANDLE(pipe_session, SessionHandle)
PIPE_HANDLE(pipe_request, RequestHandle)
PIPE_HANDLE(pipe_tensor_list, TensorListHandle)
#undef PIPE_HANDLE

// This thread's message for pipe_last_error(); valid until its next call into libpipe.
std::string& last_error();

// Stores `message` as this thread's last error and returns `code`.
pipe_status fail(pipe_status code, const std::string& message);

// Runs `body`, translating every exception into a status and this thread's last error.
// `function` is the exported function's name, handed to `body` for its messages.
template <typename F>
pipe_status guarded(const char* function, F&& body) noexcept {
  last_error().clear();
  try {
    body(function);
    return PIPE_OK;
  } catch (const libpipe::Error& e) {
    return fail(static_cast<pipe_status>(e.status()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(PIPE_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const c10::Error& e) {
    return fail(PIPE_ERR_INTERNAL, std::string("unexpected LibTorch error: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(PIPE_ERR_INTERNAL, std::string("unexpected error: ") + e.what());
  } catch (...) {
    return fail(PIPE_ERR_INTERNAL, "unexpected non-standard exception");
  }
}

// Error(InvalidArgument) "<function>: <name> is NULL" for a NULL argument.
void require(const void* arg, const char* function, const char* name);
// Error(InvalidArgument) for an index past `size`, naming `what` and the count.
void require_index(size_t index, size_t size, const char* function, const char* what);

// A new tensor list handle owning `tensors`.
pipe_tensor_list* make_list(std::vector<libpipe::NamedTensor> tensors);
// The caller's DLPack inputs as tensors viewing their memory (Error(Input) for one LibTorch cannot read).
// Throws Error(InvalidArgument), naming `what` and the field, unless `tensor` passes dlpack_check.h's checks.
void require_readable_dlpack(const DLManagedTensor& tensor, const char* function, const std::string& what);

std::vector<c10::IValue> borrow_inputs(const DLManagedTensor* const* inputs, size_t num_inputs, const char* function);
// pipe_stage_options (NULL: defaults) as the runtime's StageOptions, within the caller's struct_size.
libpipe::stage::StageOptions stage_options(const pipe_stage_options* o, const char* function);
// pipe_session_options (NULL: defaults) as the runtime's SessionOptions, within the caller's
// struct_size, as pipe_session_create and pipe_generator_create take them (capi/session.cpp).
// Error(InvalidArgument) for a bad value, naming the field as `param`->field ("options->outputs").
libpipe::schedule::SessionOptions session_options(const pipe_session_options* options, const char* function,
                                                  const char* param);

}  // namespace libpipe::capi
