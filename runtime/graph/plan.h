// Plan: the model cut into stages. A stage is a contiguous run of top-level nodes of the inlined
// forward graph. The plan records, for every value that crosses a cut, which stage defines it and
// which later stages read it, and for every stage the attribute paths (parameters, buffers, other
// attributes) it reads. Constants and attribute reads are not assigned to any stage: each stage
// that needs one recreates it, so a weight read by several stages is replicated to each.
#pragma once

#include <torch/csrc/jit/ir/ir.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/graph/model.h"

namespace libpipe::graph {

// A value handed between stages (or from the caller to a stage).
struct CrossingValue {
  torch::jit::Value* value = nullptr;  // in the model graph
  std::string name;                    // forward argument name, or the value's debug name
  int producer = -1;                   // defining stage; -1 for a forward argument
  size_t input_index = 0;              // forward argument index (after self) when producer == -1
  std::vector<int> consumers;          // stages that read it, ascending
  int last_consumer() const { return consumers.empty() ? producer : consumers.back(); }
};

struct StagePlan {
  std::vector<torch::jit::Node*> nodes;          // top-level nodes, in graph order
  std::vector<size_t> inputs;                    // CrossingValue ids: the stage's forward arguments
  std::vector<size_t> outputs;                   // CrossingValue ids it defines for later stages
  std::vector<std::vector<std::string>> attributes;  // attribute paths read, e.g. {"lin1","weight"}
  std::vector<std::string> parameters;           // original dotted names
  std::vector<std::string> buffers;
  uint64_t param_bytes = 0;
  double estimated_ms = -1;  // measured on example inputs; -1 when none were given
};

class Plan {
 public:
  // Cuts at the pipe::split() markers of forward's top level. Throws Error(Split) for a marker
  // inside a block or a stage left without computation.
  static std::shared_ptr<Plan> from_markers(std::shared_ptr<const Model> model);

  // Builds a plan from groups of top-level nodes (in graph order, covering every top-level node
  // that is not a constant or attribute read). Throws Error(Split) for an empty group.
  static std::shared_ptr<Plan> from_groups(std::shared_ptr<const Model> model,
                                           std::vector<std::vector<torch::jit::Node*>> groups);

  // Cuts `sequence` (top_level_sequence()) before each of `cuts` (ascending positions).
  static std::shared_ptr<Plan> from_cuts(std::shared_ptr<const Model> model,
                                         const std::vector<torch::jit::Node*>& sequence,
                                         const std::vector<size_t>& cuts);

  // How the cuts were chosen ("pipe::split() markers", "split points", "policy time"), and why
  // each boundary is where it is (one entry per boundary, stage i | stage i+1).
  void describe_origin(std::string method, std::vector<std::string> boundary_reasons);
  // Per-stage times measured on example inputs.
  void set_estimates(const std::vector<double>& ms);
  // Σt / (N · max t) over the estimated stage times; -1 without estimates.
  double balance() const;

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& model_ptr() const { return model_; }
  size_t num_stages() const { return stages_.size(); }
  const StagePlan& stage(size_t i) const { return stages_.at(i); }
  const std::vector<CrossingValue>& values() const { return values_; }

  // {"num_stages": N, "stages": [{"index", "parameters", "buffers", "param_bytes", "num_nodes",
  //   "inputs": [{"name", "from"}], "outputs": [{"name", "to"}]}]}
  std::string describe_json() const;

 private:
  std::shared_ptr<const Model> model_;
  std::vector<StagePlan> stages_;
  std::vector<CrossingValue> values_;
  std::string method_ = "pipe::split() markers";
  std::vector<std::string> boundary_reasons_;
};

// True for top-level nodes that belong to no stage: constants and reads of attributes of self
// (recreated in every stage that uses them).
bool is_floating_node(const torch::jit::Node* node, const torch::jit::Value* self);

// The attribute path of a chain of prim::GetAttr rooted at `self` ({"layers","0","weight"}), or
// an empty vector if `value` is not such a chain.
std::vector<std::string> attribute_path(const torch::jit::Value* value, const torch::jit::Value* self);

}  // namespace libpipe::graph
