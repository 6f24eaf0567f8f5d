// The TorchScript side of stage.h (torchscript_stages() in stage_format.h): a stage built by
// build_stage_module (stage_module.h), its weights loaded (weights.h), and on the CPU its linear layers
// packed (panel_rewrite.h), its attention read from the KV cache and its element-wise chains fused.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include "runtime/stage/checkpoint.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

class TorchScriptStage : public Stage {
 public:
  explicit TorchScriptStage(torch::jit::Module module) : module_(std::move(module)) {}
  c10::IValue forward(std::vector<c10::IValue> inputs) override { return module_.forward(std::move(inputs)); }

 private:
  torch::jit::Module module_;
};

std::unique_ptr<Stage> build_torchscript_stage(const graph::Plan& plan, size_t index, const BuildOptions& build);
void save_torchscript_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                            const std::string& path);
ShippedStage ship_torchscript_stage(const graph::Plan& plan, size_t index, const c10::Device& device,
                                    const StageOptions& options, const Checkpoint* checkpoint);
std::unique_ptr<Stage> receive_torchscript_stage(const ShippedStage& shipped, size_t index, const BuildOptions& build,
                                                 const std::string& what);

}  // namespace libpipe::stage
