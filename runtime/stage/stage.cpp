#include "runtime/stage/stage.h"

#include "runtime/error.h"
#include "runtime/io/archive_check.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage_format.h"

namespace libpipe::stage {

namespace {

const StageFormat& stages_of(io::ModelFormat format) {
  switch (format) {
    case io::ModelFormat::TorchScript: return torchscript_stages();
    case io::ModelFormat::Exported: return exported_stages();
  }
  throw Error(Status::Internal, "no stage builder for model format " + std::to_string(static_cast<int>(format)));
}

}  // namespace

WeightQuantization head_quantization(const StageOptions& options) {
  if (options.quantize == WeightQuantization::None) return WeightQuantization::None;
  if (options.quantize_head) return *options.quantize_head;
  return options.quantize == WeightQuantization::Int4 ? WeightQuantization::Int8 : options.quantize;
}

uint64_t stored_weight_bytes(const graph::Plan& plan, size_t index, const StageOptions& options) {
  if (options.quantize != WeightQuantization::None && !panel_linear_available())
    throw Error(Status::Unsupported,
                "quantized weights are for CPU stages on a CPU with AVX-512 (this one has none, or "
                "LIBPIPE_PACKED_LINEAR=0): no stage would store them; leave the weights unquantized");
  return stages_of(plan.model().format()).stored_bytes(plan, index, options);
}

std::unique_ptr<Stage> build_stage(const graph::Plan& plan, size_t index, const BuildOptions& build) {
  return stages_of(plan.model().format()).build(plan, index, build);
}

void save_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                const std::string& path) {
  stages_of(plan.model().format()).save(plan, index, options, checkpoint, path);
}

ShippedStage ship_stage(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                        Checkpoint* checkpoint) {
  return stages_of(plan.model().format()).ship(plan, index, device, options, checkpoint);
}

std::unique_ptr<Stage> receive_stage(ShippedStage shipped, size_t index, const BuildOptions& build,
                                     const std::string& what) {
  const auto format = io::check_model_archive(shipped.bytes.data(), shipped.bytes.size(), what);
  return stages_of(format).receive(std::move(shipped), index, build, what);
}

}  // namespace libpipe::stage
