#include "capi/boundary.h"

#include <cstddef>

#include "capi/dlpack_bridge.h"
#include "capi/dlpack_check.h"
#include "capi/struct_sizes.h"
#include "runtime/device/cuda_library.h"

// The DLPack layout the bridge assumes (see capi/dlpack_bridge.h).
static_assert(sizeof(DLTensor) == 48 && offsetof(DLTensor, shape) == 24 && offsetof(DLTensor, byte_offset) == 40,
              "DLTensor layout differs from LibTorch's");
static_assert(sizeof(DLManagedTensor) == 64 && offsetof(DLManagedTensor, deleter) == 56,
              "DLManagedTensor layout differs from LibTorch's");

namespace libpipe::capi {

std::string& last_error() {
  thread_local std::string message;
  return message;
}

pipe_status fail(pipe_status code, const std::string& message) {
  try {
    last_error() = message;
  } catch (...) {
    // Out of memory while storing the message: the status still says what happened.
  }
  return code;
}

void require(const void* arg, const char* function, const char* name) {
  if (!arg) throw Error(Status::InvalidArgument, std::string(function) + ": " + name + " is NULL");
}

void require_index(size_t index, size_t size, const char* function, const char* what) {
  if (index >= size)
    throw Error(Status::InvalidArgument, std::string(function) + ": " + what + " " + std::to_string(index) +
                                             " is out of range (there are " + std::to_string(size) + ")");
}

pipe_tensor_list* make_list(std::vector<libpipe::NamedTensor> tensors) {
  auto list = std::make_unique<libpipe::capi::TensorListHandle>();
  for (auto& t : tensors) list->entries.push_back({std::move(t.name), std::move(t.tensor)});
  return handle(list.release());
}

void require_readable_dlpack(const DLManagedTensor& tensor, const char* function, const std::string& what) {
  const std::string problem = dlpack_problem(tensor);
  if (!problem.empty())
    throw Error(Status::InvalidArgument,
                std::string(function) + ": " + what + " is not a valid DLPack tensor: " + problem);
}

std::vector<c10::IValue> borrow_inputs(const DLManagedTensor* const* inputs, size_t num_inputs, const char* function) {
  if (num_inputs > 0) require(inputs, function, "inputs");
  std::vector<c10::IValue> args;
  args.reserve(num_inputs);
  for (size_t i = 0; i < num_inputs; ++i) {
    if (!inputs[i])
      throw Error(Status::InvalidArgument, std::string(function) + ": inputs[" + std::to_string(i) + "] is NULL");
    require_readable_dlpack(*inputs[i], function, "inputs[" + std::to_string(i) + "]");
    const DLTensor& dl = inputs[i]->dl_tensor;
    if (dl.device.device_type == kDLCUDA)
      libpipe::device::require_device_memory(
          dl.data, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dl.device.device_id)),
          std::string(function) + ": inputs[" + std::to_string(i) + "]");
    try {
      args.emplace_back(libpipe::capi::tensor_from_borrowed_dlpack(inputs[i]));
    } catch (const c10::Error& e) {
      throw Error(Status::Input, std::string(function) + ": inputs[" + std::to_string(i) +
                                     "] is not a tensor LibTorch can read: " + e.what_without_backtrace());
    }
  }
  return args;
}

libpipe::stage::StageOptions stage_options(const pipe_stage_options* o, const char* function) {
  libpipe::stage::StageOptions opts;
  if (!o) return opts;
  require_struct_size(o->struct_size, kStageOptions, function, "the stage options' struct_size");
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
  if (PIPE_HAS(quantize)) {
    switch (o->quantize) {
      case PIPE_QUANTIZE_NONE: break;
      case PIPE_QUANTIZE_INT8: opts.quantize = libpipe::stage::WeightQuantization::Int8; break;
      case PIPE_QUANTIZE_INT4: opts.quantize = libpipe::stage::WeightQuantization::Int4; break;
      default:
        throw Error(Status::InvalidArgument,
                    std::string(function) + ": stage options quantize " + std::to_string(o->quantize) +
                        " is not PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_INT8 or PIPE_QUANTIZE_INT4");
    }
  }
  if (PIPE_HAS(quantize_head) && o->quantize_head != PIPE_QUANTIZE_HEAD_DEFAULT) {
    using libpipe::stage::WeightQuantization;
    switch (o->quantize_head) {
      case PIPE_QUANTIZE_HEAD_INT8: opts.quantize_head = WeightQuantization::Int8; break;
      case PIPE_QUANTIZE_HEAD_INT4: opts.quantize_head = WeightQuantization::Int4; break;
      case PIPE_QUANTIZE_HEAD_NONE: opts.quantize_head = WeightQuantization::None; break;
      default:
        throw Error(Status::InvalidArgument, std::string(function) + ": stage options quantize_head " +
                                                 std::to_string(o->quantize_head) +
                                                 " is not PIPE_QUANTIZE_HEAD_DEFAULT, _INT8, _INT4 or _NONE");
    }
    // The head's storage is a choice among quantized weights: alone it would quantize one layer of a float model.
    if (opts.quantize == WeightQuantization::None)
      throw Error(Status::InvalidArgument,
                  std::string(function) + ": stage options quantize_head " + std::to_string(o->quantize_head) +
                      " needs quantized weights: set quantize to PIPE_QUANTIZE_INT8 or PIPE_QUANTIZE_INT4 too, or "
                      "leave quantize_head PIPE_QUANTIZE_HEAD_DEFAULT");
  }
  if (PIPE_HAS(quantize_embedding)) {
    switch (o->quantize_embedding) {
      case PIPE_QUANTIZE_EMBEDDING_NONE: break;
      case PIPE_QUANTIZE_EMBEDDING_INT8: opts.quantize_embedding = libpipe::stage::WeightQuantization::Int8; break;
      default:
        throw Error(Status::InvalidArgument,
                    std::string(function) + ": stage options quantize_embedding " +
                        std::to_string(o->quantize_embedding) +
                        " is not PIPE_QUANTIZE_EMBEDDING_NONE or PIPE_QUANTIZE_EMBEDDING_INT8: "
                        "set one of those (NONE keeps the embedding's dtype)");
    }
  }
  if (PIPE_HAS(quantize_group) && o->quantize_group != 0) {
    if (opts.quantize != libpipe::stage::WeightQuantization::Int4 &&
        opts.quantize_head != libpipe::stage::WeightQuantization::Int4)
      throw Error(Status::InvalidArgument,
                  std::string(function) + ": stage options quantize_group " + std::to_string(o->quantize_group) +
                      " is for PIPE_QUANTIZE_INT4 only (quantize, or quantize_head PIPE_QUANTIZE_HEAD_INT4)");
    if (o->quantize_group != 32 && o->quantize_group != 64 && o->quantize_group != 128)
      throw Error(Status::InvalidArgument, std::string(function) + ": stage options quantize_group " +
                                               std::to_string(o->quantize_group) + " is not 32, 64 or 128 (or 0: 32)");
    opts.quantize_group = o->quantize_group;
  }
#undef PIPE_HAS
  return opts;
}

}  // namespace libpipe::capi
