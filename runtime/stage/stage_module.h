// The TorchScript stage builder: one stage of a plan made from a TorchScript model, as a
// standalone TorchScript module. forward(self, <stage inputs>) runs the stage's nodes; it returns
// a tuple of the values later stages read, or, for the last stage, the model's own result. The module holds only the attributes the stage reads, under a
// tree of submodules that mirrors the original, so its state_dict keys are the original names.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include "runtime/graph/plan.h"

namespace libpipe::stage {

// `device` is where the stage will run: Device constants that tracing baked into the graph
// (torch.ones(..., device="cuda:0")) are rewritten to it. Weights stay where they are; placing
// them is the session's job.
torch::jit::Module build_stage_module(const graph::Plan& plan, size_t stage_index,
                                      c10::Device device = c10::Device(c10::kCPU));

}  // namespace libpipe::stage
