#include "runtime/graph/model.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/serialization/import.h>

#include <set>

#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/split_marker.h"
#include "runtime/io/archive_check.h"

namespace libpipe::graph {

using torch::jit::Node;

namespace {

const std::vector<int> kNoSites;

void tag_recursively(Node* node, const std::vector<int>& sites,
                     std::unordered_map<const Node*, std::vector<int>>& out) {
  out[node] = sites;
  for (auto* block : node->blocks())
    for (Node* inner : block->nodes()) tag_recursively(inner, sites, out);
}

// Context managers that only switch autograd on or off. Stages always run under inference mode,
// so their Enter/Exit pairs carry no meaning and are removed; that also lets a split fall
// anywhere in code that uses them (PyTorch's own splitter asserts on them).
bool is_grad_mode_context(const c10::TypePtr& type) {
  auto cls = type->cast<c10::ClassType>();
  if (!cls || !cls->name()) return false;
  static const std::set<std::string> names = {
      "__torch__.torch.autograd.grad_mode.no_grad", "__torch__.torch.autograd.grad_mode.enable_grad",
      "__torch__.torch.autograd.grad_mode.set_grad_enabled",
      "__torch__.torch.autograd.grad_mode.inference_mode"};
  return names.count(cls->name()->qualifiedName()) > 0;
}

void strip_grad_mode(torch::jit::Block* block) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    Node* node = *it++;
    for (auto* sub : node->blocks()) strip_grad_mode(sub);
    if (node->kind() != torch::jit::prim::CreateObject || !is_grad_mode_context(node->output()->type()))
      continue;
    // Every use is the context manager's own bookkeeping: Enter, Exit, SetAttr of its state.
    // A use outside that set means the object escapes into model code; then leave it alone.
    bool only_bookkeeping = true;
    for (const auto& use : node->output()->uses()) {
      auto k = use.user->kind();
      only_bookkeeping &= (k == torch::jit::prim::Enter || k == torch::jit::prim::Exit ||
                           k == torch::jit::prim::SetAttr) &&
                          !(use.user->outputs().size() == 1 && use.user->output()->hasUses());
    }
    if (!only_bookkeeping) continue;
    while (node->output()->hasUses()) {
      Node* user = node->output()->uses().front().user;
      if (*it == user) ++it;  // never leave the iterator on a destroyed node
      user->destroy();
    }
    if (*it == node) ++it;
    node->destroy();
  }
}

}  // namespace

const std::vector<int>& Model::sites_of(const Node* node) const {
  auto it = sites_of_.find(node);
  return it == sites_of_.end() ? kNoSites : it->second;
}

// Inlines calls one level at a time, so each inlined node can be tagged with the module call it
// came from: the callee's path is the chain of attribute reads on `self` that produced the
// object it is called on, which names containers too ("layers.3"), unlike the callstack that
// torch::jit::Inline keeps.
void Model::inline_calls(torch::jit::Block* block) {
  const torch::jit::Value* self = graph_->inputs()[0];
  Node* node = block->nodes().front();
  while (node != block->return_node()) {
    torch::jit::GraphFunction* callee = nullptr;
    if (node->kind() == torch::jit::prim::CallFunction) {
      auto fn = node->input(0)->type()->expect<c10::FunctionType>()->function();
      callee = torch::jit::tryToGraphFunction(*fn);
    } else if (node->kind() == torch::jit::prim::CallMethod) {
      // Interface-typed receivers have no concrete method to inline and stay as calls.
      if (auto cls = node->input(0)->type()->cast<c10::ClassType>())
        callee = torch::jit::tryToGraphFunction(cls->getMethod(node->s(torch::jit::attr::name)));
    }
    if (!callee) {
      for (auto* sub : node->blocks()) inline_calls(sub);
      node = node->next();
      continue;
    }
    std::vector<int> sites = sites_of(node);
    if (node->kind() == torch::jit::prim::CallMethod) {
      const auto path = attribute_path(node->input(0), self);
      if (!path.empty()) {
        std::string dotted;
        for (const auto& p : path) dotted += (dotted.empty() ? "" : ".") + p;
        const int call = calls_per_path_[dotted]++;
        sites.push_back(static_cast<int>(call_sites_.size()));
        call_sites_.push_back({dotted, call});
      }
    } else {
      node->removeInput(0);  // the function constant; the callee takes the remaining inputs
    }
    Node* before = node->prev();
    Node* after = node->next();
    torch::jit::inlineCallTo(node, callee, callee->graph().get());
    sites_of_.erase(node);
    for (Node* n = before->next(); n != after; n = n->next()) tag_recursively(n, sites, sites_of_);
    node = before->next();  // the inlined body may hold further calls
  }
}

std::vector<ModuleInfo> Model::modules() const {
  std::vector<ModuleInfo> out;
  std::function<void(const torch::jit::Module&, const std::string&, int)> visit =
      [&](const torch::jit::Module& m, const std::string& path, int depth) {
        ModuleInfo info;
        info.path = path;
        info.depth = depth;
        info.type = m.type()->name() ? m.type()->name()->name() : "?";
        std::set<const void*> seen;
        for (const auto& p : m.named_parameters())
          if (seen.insert(p.value.unsafeGetTensorImpl()).second) {
            info.num_params += p.value.numel();
            info.param_bytes += p.value.nbytes();
          }
        out.push_back(std::move(info));
        for (const auto& child : m.named_children())
          visit(child.value, path.empty() ? child.name : path + "." + child.name, depth + 1);
      };
  visit(module_, "", 0);
  return out;
}

std::shared_ptr<const Model> Model::load(const std::string& path) {
  io::check_torchscript_archive(path);  // before LibTorch's reader, which trusts the zip
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
  model->inline_calls(model->graph_->block());
  strip_grad_mode(model->graph_->block());
  // Inlining leaves unused attribute reads and constants behind; dropping them keeps the per-stage
  // parameter lists to what is really read.
  torch::jit::EliminateDeadCode(model->graph_);

  const auto& args = forward->function().getSchema().arguments();
  for (size_t i = 1; i < args.size(); ++i) model->input_names_.push_back(args[i].name());
  return model;
}

}  // namespace libpipe::graph
