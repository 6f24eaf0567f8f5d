// Balanced splits for a requested number of stages. Layers are the calls of one container's
// children that share a class, the group covering most of the model winning (transformer.h.* in
// GPT-2, layers.* in Llama, layer1..layer4 in ResNet); a model without module calls has one layer
// per top-level node. The top-level sequence may be cut between layers and between the parts of a
// layer (its submodule calls and the operations between them), never inside a submodule of a
// layer or a module outside the layers, never inside a `with` block, never between the uses of a
// tensor the model writes in place (its state stays in one stage). Policies choose N-1 cuts:
//   uniform  equal numbers of layers per stage, cut at layer starts
//   params   the allowed cut minimising the largest stage's parameter bytes
//   time     the allowed cut minimising the slowest stage, from measured segment times
#pragma once

#include <string>
#include <vector>

#include "runtime/graph/program.h"

namespace libpipe::graph {

// The program's nodes that belong to stages (not pipe::split() markers), as node ids in order.
std::vector<size_t> top_level_sequence(const Program& model);

struct Segmentation {
  std::string container;             // the module whose children are the layers ("" = root)
  std::vector<size_t> layer_starts;  // position of each layer's first node, ascending
  std::vector<size_t> allowed_cuts;  // positions a cut may take, ascending, within (0, size)
};

Segmentation segment(const Program& model, const std::vector<size_t>& sequence);

// Splits costs[0..K) (contiguous segments) into `parts` non-empty contiguous groups minimising the
// largest group sum. Returns the index of the first segment of each group after the first
// (parts-1 ascending values in (0, K)). Throws Error(Split) if parts < 1 or parts > K.
std::vector<size_t> min_max_partition(const std::vector<double>& costs, size_t parts);

// Parameter and buffer bytes first read by each segment [bounds[i], bounds[i+1]) of `sequence`.
std::vector<double> segment_param_bytes(const Program& model, const std::vector<size_t>& sequence,
                                        const std::vector<size_t>& bounds);

}  // namespace libpipe::graph
