// Plan: the model cut into stages. A stage is a contiguous run of the program's top-level nodes.
// The plan records, for every value that crosses a cut, which stage defines it and which later
// stages read it, and for every stage the attributes (parameters, buffers, other attributes) it
// reads. Constants and attribute reads are not assigned to any stage: each stage that needs one
// recreates it, so a weight read by several stages is replicated to each. Plans work on a
// Program, so every front-end splits by the same rules.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/graph/program.h"

namespace torch::jit {
struct Node;
}

namespace libpipe::graph {

class Model;

// A value handed between stages (or from the caller to a stage).
struct CrossingValue {
  size_t value = 0;            // the program's value id
  std::string name;            // forward argument name, or the value's debug name
  int producer = -1;           // defining stage; -1 for a forward argument
  size_t input_index = 0;      // forward argument index (after self) when producer == -1
  std::vector<int> consumers;  // stages that read it, ascending
  int last_consumer() const { return consumers.empty() ? producer : consumers.back(); }
};

struct StagePlan {
  std::vector<size_t> nodes;            // program node ids, in order
  std::vector<size_t> inputs;           // CrossingValue ids: the stage's forward arguments
  std::vector<size_t> outputs;          // CrossingValue ids it defines for later stages
  std::vector<size_t> attributes;       // program attribute ids read
  std::vector<std::string> parameters;  // original dotted names
  std::vector<std::string> buffers;
  uint64_t param_bytes = 0;
  double estimated_ms = -1;  // measured on example inputs; -1 when none were given
};

class Plan {
 public:
  // Cuts at the pipe::split() markers of forward's top level. Throws Error(Split) for a marker
  // inside a block or a stage left without computation.
  static std::shared_ptr<Plan> from_markers(std::shared_ptr<const Program> model);

  // Builds a plan from groups of program node ids (in order, covering every node that is not a
  // split marker). Throws Error(Split) for an empty group.
  static std::shared_ptr<Plan> from_groups(std::shared_ptr<const Program> model,
                                           std::vector<std::vector<size_t>> groups);
  // The same from groups of a TorchScript model's graph nodes (defined with that front-end, in
  // runtime/graph/torchscript/model.cpp).
  static std::shared_ptr<Plan> from_groups(std::shared_ptr<const Model> model,
                                           std::vector<std::vector<torch::jit::Node*>> groups);

  // Cuts `sequence` (top_level_sequence()) before each of `cuts` (ascending positions).
  static std::shared_ptr<Plan> from_cuts(std::shared_ptr<const Program> model, const std::vector<size_t>& sequence,
                                         const std::vector<size_t>& cuts);

  // How the cuts were chosen ("pipe::split() markers", "split points", "policy time"), and why
  // each boundary is where it is (one entry per boundary, stage i | stage i+1).
  void describe_origin(std::string method, std::vector<std::string> boundary_reasons);
  // Per-stage times measured on example inputs.
  void set_estimates(const std::vector<double>& ms);
  // Σt / (N · max t) over the estimated stage times; -1 without estimates.
  double balance() const;

  const Program& model() const { return *model_; }
  const std::shared_ptr<const Program>& shared_model() const { return model_; }
  size_t num_stages() const { return stages_.size(); }
  const StagePlan& stage(size_t i) const { return stages_.at(i); }
  const std::vector<CrossingValue>& values() const { return values_; }

  // {"num_stages": N, "stages": [{"index", "parameters", "buffers", "param_bytes", "num_nodes",
  //   "inputs": [{"name", "from"}], "outputs": [{"name", "to"}]}]}
  std::string describe_json() const;

 private:
  std::shared_ptr<const Program> model_;
  std::vector<StagePlan> stages_;
  std::vector<CrossingValue> values_;
  std::string method_ = "pipe::split() markers";
  std::vector<std::string> boundary_reasons_;
};

}  // namespace libpipe::graph
