// Micro-batches: one call's arguments cut along dimension 0, and the per-micro-batch results
// concatenated back. Cuts follow torch.tensor_split (sizes differ by at most one) and are views
// of the caller's tensors, never copies.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/named_tensor.h"

namespace libpipe::chunk {

// Cuts `inputs` (named `names`, for messages) into at most `requested` micro-batches. Tensors of
// rank >= 1 are split along dimension 0 and must agree on its size; other values (and 0-d
// tensors) are given to every micro-batch. A batch smaller than `requested` gives one
// micro-batch per sample and logs a warning. Throws Error(Input) if batch sizes disagree.
std::vector<std::vector<c10::IValue>> split_inputs(const std::vector<c10::IValue>& inputs,
                                                   const std::vector<std::string>& names,
                                                   int64_t requested);

// Names the tensors of one result: "output" for a tensor, "output.<i>" for tuple/list items,
// "output.<key>" for dict entries, nesting with '.'. Throws Error(Unsupported) for other leaves.
std::vector<NamedTensor> flatten_output(const c10::IValue& value);

// Flattens each micro-batch's result and concatenates every output along dimension 0.
// Throws Error(Execution) if micro-batches disagree on the outputs' names or a 0-d output would
// need concatenating.
std::vector<NamedTensor> merge_outputs(const std::vector<c10::IValue>& results);

}  // namespace libpipe::chunk
