// The TorchScript stage builder: one stage of a plan made from a TorchScript model, as a
// standalone TorchScript module. forward(self, <stage inputs>) runs the stage's nodes; it returns
// a tuple of the values later stages read, or, for the last stage, the model's own result. The module holds only the
// attributes the stage reads, under a tree of submodules that mirrors the original, so its state_dict keys are the
// original names.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <optional>

#include "runtime/graph/plan.h"

namespace libpipe::stage {

// `device` is where the stage will run: Device constants that tracing baked into the graph
// (torch.ones(..., device="cuda:0")) are rewritten to it. Weights stay where they are; placing
// them is the session's job. `dtype` is the one its floating weights and inputs will be converted
// to (load_stage_weights): the casts a trace fixed at the model's own dtype are adapted to it (see
// dtype_casts.h), or Error(Unsupported) says why they cannot be.
torch::jit::Module build_stage_module(const graph::Plan& plan, size_t stage_index,
                                      c10::Device device = c10::Device(c10::kCPU),
                                      std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace libpipe::stage
