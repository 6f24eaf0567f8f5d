#include "runtime/stage/torchscript/torchscript_stage.h"

#include <torch/csrc/jit/serialization/import.h>

#include <sstream>

#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage_format.h"
#include "runtime/stage/torchscript/cache_attention.h"
#include "runtime/stage/torchscript/cache_write.h"
#include "runtime/stage/torchscript/fused_elementwise.h"
#include "runtime/stage/torchscript/panel_rewrite.h"
#include "runtime/stage/torchscript/stage_module.h"
#include "runtime/stage/torchscript/weights.h"

namespace libpipe::stage {

namespace {

std::unique_ptr<Stage> finish(torch::jit::Module module, const BuildOptions& build) {
  const WeightQuantization quantize = build.options->quantize;
  if (quantize != WeightQuantization::None &&
      (!build.cpu_rewrites || !build.device.is_cpu() || !panel_linear_available()))
    throw Error(Status::Unsupported,
                "quantized weights are for CPU stages on a CPU with AVX-512 (this stage runs on " + build.device.str() +
                    (build.device.is_cpu() ? ", without AVX-512 or with LIBPIPE_PACKED_LINEAR=0" : "") +
                    "); leave the weights unquantized");
  // The int8 lookup is plain C++ (no panel kernels), but it is one of the CPU rewrites.
  if (build.options->quantize_embedding != WeightQuantization::None && (!build.cpu_rewrites || !build.device.is_cpu()))
    throw Error(Status::Unsupported, "int8 embeddings are for CPU stages (this stage runs on " + build.device.str() +
                                         (build.device.is_cpu() ? ", without the CPU rewrites" : "") +
                                         "); leave the embedding unquantized");
  if (build.cpu_rewrites && build.device.is_cpu()) {
    if (build.options->quantize_embedding == WeightQuantization::Int8) quantize_embeddings(module);
    panel_linear_weights(module, quantize, build.options->quantize_group, build.options->quantize_head);
    fuse_cache_attention(module);
    fuse_cache_writes(module);
    fuse_elementwise(module);
  }
  module.eval();
  return std::make_unique<TorchScriptStage>(std::move(module));
}

}  // namespace

std::unique_ptr<Stage> build_torchscript_stage(const graph::Plan& plan, size_t index, const BuildOptions& build) {
  auto module = build_stage_module(plan, index, build.device, build.options->dtype);
  load_stage_weights(module, plan, index, *build.options, build.checkpoint, build.device);
  return finish(std::move(module), build);
}

void save_torchscript_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                            const std::string& path) {
  auto module = build_stage_module(plan, index, c10::Device(c10::kCPU), options.dtype);
  load_stage_weights(module, plan, index, options, checkpoint);
  try {
    module.save(path);
  } catch (const c10::Error& e) {
    throw Error(Status::Io, "cannot write '" + path + "': " + e.what_without_backtrace());
  }
}

ShippedStage ship_torchscript_stage(const graph::Plan& plan, size_t index, const c10::Device& device,
                                    const StageOptions& options, const Checkpoint* checkpoint) {
  const auto aliases = checkpoint ? alias_groups(graph::torchscript_model(plan).module()) : AliasGroups{};
  // Device constants baked in by tracing are rewritten for the device the stage will use (the same
  // GPU numbering on every machine is assumed).
  auto module = build_stage_module(plan, index, device, options.dtype);
  // With a checkpoint, each worker reads its own stages' tensors from it: only their shapes travel.
  // Those it lacks (non-persistent buffers) travel with their data.
  if (checkpoint) strip_stage_weights(module, *checkpoint, aliases);
  ShippedStage out;
  std::ostringstream bytes;
  module.save(bytes);
  out.bytes = bytes.str();
  for (const auto& p : module.named_parameters())
    if (auto it = aliases.find(p.name); it != aliases.end()) out.aliases.insert(*it);
  for (const auto& b : module.named_buffers())
    if (auto it = aliases.find(b.name); it != aliases.end()) out.aliases.insert(*it);
  return out;
}

std::unique_ptr<Stage> receive_torchscript_stage(const ShippedStage& shipped, size_t index, const BuildOptions& build,
                                                 const std::string& what) {
  std::istringstream in(shipped.bytes);
  torch::jit::Module module;
  try {
    module = torch::jit::load(in, c10::Device(c10::kCPU));
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat, what + " could not be loaded: " + e.what_without_backtrace());
  }
  load_stage_weights(module, shipped.aliases, index, *build.options, build.checkpoint, build.device);
  return finish(std::move(module), build);
}

namespace {

class TorchScriptStages final : public StageFormat {
 public:
  std::unique_ptr<Stage> build(const graph::Plan& plan, size_t index, const BuildOptions& build) const override {
    return build_torchscript_stage(plan, index, build);
  }
  void save(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
            const std::string& path) const override {
    save_torchscript_stage(plan, index, options, checkpoint, path);
  }
  ShippedStage ship(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                    Checkpoint* checkpoint) const override {
    return ship_torchscript_stage(plan, index, device, options, checkpoint);
  }
  std::unique_ptr<Stage> receive(ShippedStage shipped, size_t index, const BuildOptions& build,
                                 const std::string& what) const override {
    return receive_torchscript_stage(shipped, index, build, what);
  }
  uint64_t stored_bytes(const graph::Plan& plan, size_t index, const StageOptions& options) const override {
    // The module as a build makes it, before its weights are loaded: the rewrite's analysis reads shapes only.
    auto module = build_stage_module(plan, index, c10::Device(c10::kCPU), options.dtype);
    return stage::stored_bytes(module, options);
  }
};

}  // namespace

const StageFormat& torchscript_stages() {
  static const TorchScriptStages stages;
  return stages;
}

}  // namespace libpipe::stage
