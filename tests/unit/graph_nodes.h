// For the tests of graph rewrites (runtime/stage): how many nodes of a kind a graph's top block holds.
#pragma once

#include <torch/csrc/jit/ir/ir.h>

#include <cstddef>

namespace libpipe::test {

inline size_t count_nodes(const torch::jit::Graph& g, const char* kind) {
  size_t n = 0;
  for (const auto* node : g.nodes()) n += node->kind() == c10::Symbol::fromQualString(kind);
  return n;
}

}  // namespace libpipe::test
