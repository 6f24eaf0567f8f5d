// The reference the session tests compare against: the whole TorchScript model run eagerly by LibTorch.
#pragma once

#include <c10/core/InferenceMode.h>

#include <vector>

#include "runtime/graph/torchscript/model.h"

namespace libpipe::test {

inline at::Tensor eager(const graph::Model& model, const std::vector<c10::IValue>& inputs) {
  // No autograd: the reference needs none, and threads building grad accumulators for the same
  // parameters at once race inside LibTorch in ways ThreadSanitizer cannot see through.
  c10::InferenceMode inference;
  return const_cast<torch::jit::Module&>(model.module()).forward(inputs).toTensor();
}

}  // namespace libpipe::test
