// Model: a loaded TorchScript module with its forward graph inlined into one flat graph, the form
// every split works on. This is the TorchScript front-end; the rest of the runtime sees only
// Model's graph, its forward input names and the module that owns the weights, so a second
// front-end (torch.export programs) can produce a Model without touching plan, stage or session.
#pragma once

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <memory>
#include <string>
#include <vector>

namespace libpipe::graph {

class Model {
 public:
  // Loads a TorchScript archive. Throws Error(NotFound) for a missing file and
  // Error(InvalidFormat) for anything that is not a TorchScript module with a forward method.
  static std::shared_ptr<const Model> load(const std::string& path);

  const std::string& path() const { return path_; }
  // The module that owns the parameters and buffers (eval mode).
  const torch::jit::Module& module() const { return module_; }
  // forward with every method call inlined; input 0 is `self`.
  const std::shared_ptr<torch::jit::Graph>& graph() const { return graph_; }
  // Names of forward's arguments after `self`, as written in the model code.
  const std::vector<std::string>& input_names() const { return input_names_; }

 private:
  std::string path_;
  torch::jit::Module module_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::vector<std::string> input_names_;
};

}  // namespace libpipe::graph
