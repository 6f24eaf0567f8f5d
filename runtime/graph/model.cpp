#include "runtime/graph/model.h"

#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/serialization/import.h>

#include <fstream>

#include "runtime/error.h"
#include "runtime/graph/split_marker.h"

namespace libpipe::graph {

std::shared_ptr<const Model> Model::load(const std::string& path) {
  {
    std::ifstream probe(path, std::ios::binary);
    if (!probe) throw Error(Status::NotFound, "cannot open model file '" + path + "'");
  }
  register_split_marker();

  auto model = std::make_shared<Model>();
  model->path_ = path;
  try {
    model->module_ = torch::jit::load(path);
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat,
                "'" + path + "' is not a loadable TorchScript archive (save it with "
                "torch.jit.trace(...).save() or torch.jit.script(...).save()): " +
                    e.what_without_backtrace());
  }
  model->module_.eval();

  auto forward = model->module_.find_method("forward");
  if (!forward)
    throw Error(Status::InvalidFormat, "'" + path + "' has no forward method to split");

  model->graph_ = forward->graph()->copy();
  torch::jit::Inline(*model->graph_);
  // Inlining leaves unused attribute reads and constants behind; dropping them keeps the per-stage
  // parameter lists to what is really read.
  torch::jit::EliminateDeadCode(model->graph_);

  const auto& args = forward->function().getSchema().arguments();
  for (size_t i = 1; i < args.size(); ++i) model->input_names_.push_back(args[i].name());
  return model;
}

}  // namespace libpipe::graph
