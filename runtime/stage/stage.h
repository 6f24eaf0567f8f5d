// Stage: one stage of a plan, built and ready to run, whatever format its model came in. A
// TorchScript model's stages are TorchScript modules (stage_module.h); an exported program's are
// exported programs run by LibTorch's nativert (exported_stage.h). The session, the worker
// processes and the profiler run stages through this interface only, and build, save and ship
// them through the functions below, which pick the implementation from the plan's model.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/graph/plan.h"
#include "runtime/stage/weights.h"

namespace libpipe::stage {

class Stage {
 public:
  virtual ~Stage() = default;
  // Runs the stage on its inputs (the plan's crossing values it reads, in order). Returns a tuple of
  // the values it defines for later stages, or, for the last stage, the model's own result. Called by
  // one thread at a time.
  virtual c10::IValue forward(std::vector<c10::IValue> inputs) = 0;
};

// How a stage is built for running: its weights (from the model, or the checkpoint in
// `options.weights`, open as `checkpoint`), its dtype and its device. `cpu_rewrites` applies the
// CPU rewrites (linear layers on panels, both formats; for TorchScript stages also attention from the
// KV cache; see panel_linear.h, cache_attention.h); false leaves the stage's code as the model wrote
// it.
struct BuildOptions {
  const StageOptions* options = nullptr;  // required
  Checkpoint* checkpoint = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  bool cpu_rewrites = false;
};

// Throws Error as the format's builder does (Unsupported, NotFound, Input for weights that do not fit).
std::unique_ptr<Stage> build_stage(const graph::Plan& plan, size_t index, const BuildOptions& build);

// Writes stage `index` to `path` as a model of its own (a TorchScript archive, or a .pt2 holding one
// exported program named "model"), on the CPU, with its weights. Throws Error(Io) when the file
// cannot be written.
void save_stage(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
                const std::string& path);

// A stage as it travels to a worker process: bytes, and the tied-weight names the worker needs to
// look its tensors up in `checkpoint`. With a checkpoint, the tensors it holds are left out (the
// worker reads them itself); the rest travel with their data.
struct ShippedStage {
  std::string bytes;
  AliasGroups aliases;
};
ShippedStage ship_stage(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                        Checkpoint* checkpoint);
// The worker's side: builds the stage from what ship_stage sent (the format is read from the bytes).
// Throws Error(InvalidFormat) naming `what` for bytes that are no stage.
std::unique_ptr<Stage> receive_stage(ShippedStage shipped, size_t index, const BuildOptions& build,
                                     const std::string& what);

}  // namespace libpipe::stage
