// Model: a loaded TorchScript module with its forward graph inlined into one flat graph, the form
// every split works on. This is the TorchScript front-end; the rest of the runtime sees only
// Model's graph, its forward input names, the module call sites its nodes came from, and the
// module that owns the weights, so a second front-end (torch.export programs) can produce a Model
// without touching plan, stage or session.
#pragma once

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace libpipe::graph {

// One call of a submodule in the model's code: `path` is the module's dotted name ("layers.3",
// "transformer.h.0.attn"); `call` counts the calls of that module in graph order (0 for the first),
// so a module called twice has two call sites.
struct CallSite {
  std::string path;
  int call = 0;
};

// A module of the model, for `pipe inspect`: pre-order, with parameters counted over the module
// and all its descendants (shared tensors once).
struct ModuleInfo {
  std::string path;  // "" for the root
  std::string type;  // the Python class name
  int depth = 0;
  uint64_t num_params = 0;
  uint64_t param_bytes = 0;
};

class Model {
 public:
  // Loads a TorchScript archive. Throws Error(NotFound) for a missing file and
  // Error(InvalidFormat) for anything that is not a TorchScript module with a forward method.
  static std::shared_ptr<const Model> load(const std::string& path);

  const std::string& path() const { return path_; }
  // The module that owns the parameters and buffers (eval mode).
  const torch::jit::Module& module() const { return module_; }
  // forward with every method and function call inlined and grad-mode context managers removed
  // (inference never needs them); input 0 is `self`.
  const std::shared_ptr<torch::jit::Graph>& graph() const { return graph_; }
  // Names of forward's arguments after `self`, as written in the model code.
  const std::vector<std::string>& input_names() const { return input_names_; }

  const std::vector<CallSite>& call_sites() const { return call_sites_; }
  // Indices into call_sites() of the calls `node` was inlined from, outermost first; empty for
  // forward's own nodes.
  const std::vector<int>& sites_of(const torch::jit::Node* node) const;

  std::vector<ModuleInfo> modules() const;

 private:
  void inline_calls(torch::jit::Block* block);

  std::string path_;
  torch::jit::Module module_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::vector<std::string> input_names_;
  std::vector<CallSite> call_sites_;
  std::unordered_map<const torch::jit::Node*, std::vector<int>> sites_of_;
  std::unordered_map<std::string, int> calls_per_path_;
};

}  // namespace libpipe::graph
