// Micro-batches: one call's arguments cut into micro-batches, and the per-micro-batch results
// put back together, as each input's and output's spec says. Cuts follow torch.tensor_split
// (sizes differ by at most one) and are views of the caller's tensors, never copies.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/named_tensor.h"

namespace libpipe::chunk {

struct InputSpec {
  enum class Kind { Default, Split, Replicate };
  Kind kind = Kind::Default;  // Default: split tensors of rank >= 1 along 0, replicate the rest
  int64_t dim = 0;            // for Split; negative counts from the end
};

struct OutputSpec {
  enum class Kind { Concat, Sum, Equal };
  Kind kind = Kind::Concat;  // Equal: every micro-batch must give the same value; it is returned once
  int64_t dim = 0;           // for Concat; negative counts from the end
};

// Cuts `inputs` (named `names`, for messages) into at most `requested` micro-batches, input i as
// specs[i] says (missing specs are Default). Every split input must have the same size along its
// split dimension (the batch); a batch smaller than `requested` gives one micro-batch per sample
// and logs a warning. Throws Error(Input) naming the input whose size disagrees or whose spec
// does not fit it, Error(InvalidArgument) for requested < 1.
std::vector<std::vector<c10::IValue>> split_inputs(const std::vector<c10::IValue>& inputs,
                                                   const std::vector<std::string>& names, int64_t requested,
                                                   const std::vector<InputSpec>& specs = {});

// Names the tensors of one result: "output" for a tensor, "output.<i>" for tuple/list items,
// "output.<key>" for dict entries, nesting with '.'. Throws Error(Unsupported) for other leaves.
std::vector<NamedTensor> flatten_output(const c10::IValue& value);

// Flattens each micro-batch's result and combines output i as specs[i] says (missing specs are
// Concat along 0). Throws Error(Execution) if micro-batches disagree on the outputs' names, a
// 0-d output would need concatenating, or an Equal output differs between micro-batches.
std::vector<NamedTensor> merge_outputs(const std::vector<c10::IValue>& results,
                                       const std::vector<OutputSpec>& specs = {});

}  // namespace libpipe::chunk
