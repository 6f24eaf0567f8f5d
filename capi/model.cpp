// The C ABI: loading a model and reading its inputs and module tree.
#include "capi/boundary.h"
#include "runtime/graph/load.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

// The format's code is the front-end's own value (io::ModelFormat follows the C constants).
static_assert(static_cast<int32_t>(libpipe::io::ModelFormat::TorchScript) == PIPE_MODEL_TORCHSCRIPT);
static_assert(static_cast<int32_t>(libpipe::io::ModelFormat::Exported) == PIPE_MODEL_EXPORTED);

extern "C" {

pipe_status pipe_model_load(const char* path, pipe_model** model) {
  return guarded(__func__, [&](const char* fn) {
    require(path, fn, "path");
    require(model, fn, "model");
    auto m = std::make_unique<libpipe::capi::ModelHandle>();
    m->impl = libpipe::graph::load_program(path);
    *model = handle(m.release());
  });
}

pipe_status pipe_model_format(const pipe_model* model, int32_t* format) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require(format, fn, "format");
    *format = static_cast<int32_t>(get(model)->impl->format());
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
    *count = get(model)->impl->modules().size();
  });
}

pipe_status pipe_model_module(const pipe_model* model, size_t index, const char** path, const char** type_name,
                              int32_t* depth, uint64_t* num_params, uint64_t* param_bytes) {
  return guarded(__func__, [&](const char* fn) {
    require(model, fn, "model");
    require_index(index, get(model)->impl->modules().size(), fn, "module");
    const auto& m = get(model)->impl->modules()[index];
    if (path) *path = m.path.c_str();
    if (type_name) *type_name = m.type.c_str();
    if (depth) *depth = m.depth;
    if (num_params) *num_params = m.num_params;
    if (param_bytes) *param_bytes = m.param_bytes;
  });
}

void pipe_model_destroy(pipe_model* model) { delete get(model); }

}  // extern "C"
