// Model: the TorchScript front-end. It loads a TorchScript archive, inlines forward's calls into
// one flat graph (tagging each inlined node with the module call it came from), strips grad-mode
// context managers, and describes the result as a Program for the split logic. It also keeps the
// TorchScript objects behind each node and value, which the TorchScript stage builder needs.
#pragma once

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/graph/program.h"

namespace libpipe::graph {

class Plan;

class Model : public Program {
 public:
  // Loads a TorchScript archive. Throws Error(NotFound) for a missing file and
  // Error(InvalidFormat) for anything that is not a TorchScript module with a forward method.
  static std::shared_ptr<const Model> load(const std::string& path);

  io::ModelFormat format() const override { return io::ModelFormat::TorchScript; }
  std::vector<BufferInfo> buffers() const override;
  bool root_flag(const std::string& name) const override;

  // The module that owns the parameters and buffers (eval mode).
  const torch::jit::Module& module() const { return module_; }
  // forward with every method and function call inlined and grad-mode context managers removed
  // (inference never needs them); input 0 is `self`.
  const std::shared_ptr<torch::jit::Graph>& graph() const { return graph_; }
  // Indices into call_sites() of the calls `node` was inlined from, outermost first; empty for
  // forward's own nodes.
  const std::vector<int>& sites_of(const torch::jit::Node* node) const;

  // The graph node behind Program node `id`, the graph value behind Program value `id`, and the
  // Program id of a top-level graph node (Error(Internal) for a node that is none).
  torch::jit::Node* node(size_t id) const { return node_of_.at(id); }
  torch::jit::Value* value(size_t id) const { return value_of_.at(id); }
  size_t node_id(const torch::jit::Node* node) const;

 private:
  void inline_calls(torch::jit::Block* block);
  void describe();  // fills the Program tables from the inlined graph

  torch::jit::Module module_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::unordered_map<const torch::jit::Node*, std::vector<int>> sites_of_;
  std::unordered_map<std::string, int> calls_per_path_;
  std::vector<torch::jit::Node*> node_of_;
  std::vector<torch::jit::Value*> value_of_;
  std::unordered_map<const torch::jit::Node*, size_t> node_id_;
};

// The TorchScript model behind a plan (for the TorchScript stage builder, which stage.cpp picks by the
// model's format()); Error(Internal) when the plan was made from another front-end's program.
const Model& torchscript_model(const Plan& plan);

// True for top-level nodes that belong to no stage: constants and reads of attributes of self
// (recreated in every stage that uses them).
bool is_floating_node(const torch::jit::Node* node, const torch::jit::Value* self);

// The attribute path of a chain of prim::GetAttr rooted at `self` ({"layers","0","weight"}), or
// an empty vector if `value` is not such a chain.
std::vector<std::string> attribute_path(const torch::jit::Value* value, const torch::jit::Value* self);

// A write in place into an attribute of self: an operator whose schema marks an argument as
// written (add_, index_put_, copy_, out= variants) applied to the attribute or to a view of it
// (select, slice, narrow, view, transpose, split, ... followed through the schemas' alias sets).
struct InPlaceWrite {
  std::vector<std::string> path;          // the attribute written ({"layers","0","attn","k_cache"})
  const torch::jit::Node* top = nullptr;  // the top-level node of `graph` that holds the write
  std::string what;                       // "aten::index_put_ at cache.py:123", for messages
};

// Every write in place into an attribute of self (`graph`'s input 0) in `graph`, its if/loop
// blocks included. A write into a tensor that came from anywhere else (a forward argument, a
// value computed here) is not one. Reads the graph only (no schema is cached in its nodes).
std::vector<InPlaceWrite> in_place_writes(const torch::jit::Graph& graph);

}  // namespace libpipe::graph
