// A tensor with the name it travels under: a safetensors entry, a model input, or a flattened
// model output ("output", "output.0", "output.logits").
#pragma once

#include <ATen/Tensor.h>

#include <string>

namespace libpipe {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

}  // namespace libpipe
