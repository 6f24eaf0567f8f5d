#include "runtime/graph/torchscript/model.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/csrc/jit/serialization/import.h>

#include <algorithm>
#include <map>
#include <set>
#include <unordered_set>

#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/torchscript/split_marker.h"
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
      "__torch__.torch.autograd.grad_mode.set_grad_enabled", "__torch__.torch.autograd.grad_mode.inference_mode"};
  return names.count(cls->name()->qualifiedName()) > 0;
}

void strip_grad_mode(torch::jit::Block* block) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    Node* node = *it++;
    for (auto* sub : node->blocks()) strip_grad_mode(sub);
    if (node->kind() != torch::jit::prim::CreateObject || !is_grad_mode_context(node->output()->type())) continue;
    // Every use is the context manager's own bookkeeping: Enter, Exit, SetAttr of its state.
    // A use outside that set means the object escapes into model code; then leave it alone.
    bool only_bookkeeping = true;
    for (const auto& use : node->output()->uses()) {
      auto k = use.user->kind();
      only_bookkeeping &=
          (k == torch::jit::prim::Enter || k == torch::jit::prim::Exit || k == torch::jit::prim::SetAttr) &&
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

namespace {

// The class of a module, equal for every instance of one Python class: tracing gives every
// instance its own class (__torch__.x.___torch_mangle_7.Block), so the mangling is dropped.
std::string class_name(const torch::jit::Module& m) {
  std::string name = m.type()->name() ? m.type()->name()->qualifiedName() : "?";
  const std::string marker = "___torch_mangle_";
  for (size_t at = name.find(marker); at != std::string::npos; at = name.find(marker)) {
    const size_t end = name.find('.', at);
    name.erase(at, end == std::string::npos ? std::string::npos : end - at + 1);
  }
  return name;
}

std::vector<ModuleInfo> describe_modules(const torch::jit::Module& root) {
  std::vector<ModuleInfo> out;
  std::function<void(const torch::jit::Module&, const std::string&, int)> visit =
      [&](const torch::jit::Module& m, const std::string& path, int depth) {
        ModuleInfo info;
        info.path = path;
        info.depth = depth;
        info.type = m.type()->name() ? m.type()->name()->name() : "?";
        info.class_name = class_name(m);
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
  visit(root, "", 0);
  return out;
}

// "file.py:12" for a node traced or scripted from Python source, or its kind otherwise.
std::string where(const Node* node) {
  if (auto loc = node->sourceRange().file_line_col())
    return std::get<0>(*loc) + ":" + std::to_string(std::get<1>(*loc));
  return std::string("node ") + node->kind().toQualString();
}

std::string join(const std::vector<std::string>& path) {
  std::string out;
  for (const auto& p : path) out += (out.empty() ? "" : ".") + p;
  return out;
}

// What an attribute path of the model stands for: its bytes when it is a tensor, and the
// parameters and buffers it covers (itself, or all of a submodule's).
AttributeRead read_attribute(const torch::jit::Module& root, std::vector<std::string> path) {
  AttributeRead read;
  c10::intrusive_ptr<c10::ivalue::Object> obj = root._ivalue();
  for (size_t i = 0; i + 1 < path.size(); ++i) obj = obj->getAttr(path[i]).toObject();
  const auto& type = obj->type();
  const size_t slot = type->getAttributeSlot(path.back());
  const c10::IValue value = obj->getSlot(slot);
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    read.tensor_bytes = t.defined() ? t.nbytes() : 0;
    if (type->is_parameter(slot) || type->is_buffer(slot))
      read.tensors.push_back({join(path), read.tensor_bytes, type->is_parameter(slot)});
  } else if (value.isModule()) {
    torch::jit::Module sub(value.toObject());
    const std::string prefix = join(path) + ".";
    for (const auto& p : sub.named_parameters())
      read.tensors.push_back({prefix + p.name, p.value.defined() ? p.value.nbytes() : 0, true});
    for (const auto& b : sub.named_buffers())
      read.tensors.push_back({prefix + b.name, b.value.defined() ? b.value.nbytes() : 0, false});
  }
  read.path = std::move(path);
  return read;
}

// The schema `n` calls, or nullptr for prim nodes and unknown operators. Node::maybeSchema would
// cache it in the node, a write to the model's graph, which sessions on several threads share.
const c10::FunctionSchema* schema_of(const Node* n) {
  if (n->kind().is_prim()) return nullptr;
  for (const auto& op : torch::jit::getAllOperatorsFor(n->kind()))
    if (n->matches(op->schema())) return &op->schema();
  return nullptr;
}

// The alias sets an argument or result belongs to; for a list (split's Tensor(a)[]) its elements'.
const std::unordered_set<c10::Symbol>* alias_sets(const c10::AliasInfo* info) {
  if (!info) return nullptr;
  if (info->beforeSets().empty() && !info->containedTypes().empty()) return &info->containedTypes()[0].beforeSets();
  return &info->beforeSets();
}

// The attribute of self that `v` is, or is a view of (a result in an alias set of one of its
// producer's arguments), or an empty path when it is neither.
std::vector<std::string> viewed_attribute(const torch::jit::Value* v, const torch::jit::Value* self) {
  for (int hops = 0; hops < 256; ++hops) {
    auto path = attribute_path(v, self);
    if (!path.empty()) return path;
    const Node* producer = v->node();
    if (producer->kind() == torch::jit::prim::ListUnpack) {  // one part of split/chunk/unbind
      v = producer->input(0);
      continue;
    }
    const auto* schema = schema_of(producer);
    if (!schema) return {};
    const size_t out =
        std::find(producer->outputs().begin(), producer->outputs().end(), v) - producer->outputs().begin();
    if (out >= schema->returns().size()) return {};
    const auto* result = alias_sets(schema->returns()[out].alias_info());
    if (!result || result->empty()) return {};
    const torch::jit::Value* from = nullptr;
    for (size_t i = 0; i < schema->arguments().size() && i < producer->inputs().size() && !from; ++i)
      if (const auto* arg = alias_sets(schema->arguments()[i].alias_info()))
        for (const auto& set : *arg)
          if (result->count(set)) from = producer->input(i);
    if (!from) return {};
    v = from;
  }
  return {};
}

void find_writes(const torch::jit::Block* block, const Node* top, const torch::jit::Value* self,
                 std::vector<InPlaceWrite>& out) {
  for (const Node* n : block->nodes()) {
    const Node* outer = top ? top : n;
    if (const auto* schema = schema_of(n)) {
      for (size_t i = 0; i < schema->arguments().size() && i < n->inputs().size(); ++i) {
        const auto* info = schema->arguments()[i].alias_info();
        if (!info || !info->isWrite()) continue;
        auto path = viewed_attribute(n->input(i), self);
        if (!path.empty())
          out.push_back({std::move(path), outer, std::string(n->kind().toQualString()) + " at " + where(n)});
      }
    }
    for (const auto* sub : n->blocks()) find_writes(sub, outer, self, out);
  }
}

void find_nested_marker(const torch::jit::Block* block, bool top, std::string& found) {
  for (const Node* node : block->nodes()) {
    if (!top && found.empty() && node->kind() == split_marker_kind()) found = where(node);
    for (const auto* sub : node->blocks()) find_nested_marker(sub, false, found);
  }
}

}  // namespace

size_t Model::node_id(const Node* node) const {
  auto it = node_id_.find(node);
  if (it == node_id_.end())
    throw Error(Status::Internal,
                std::string("node ") + node->kind().toQualString() + " is not one of the model's top-level nodes");
  return it->second;
}

void Model::describe() {
  const torch::jit::Value* self = graph_->inputs()[0];
  std::unordered_map<const torch::jit::Value*, size_t> value_id;
  for (size_t i = 1; i < graph_->inputs().size(); ++i) {
    value_id[graph_->inputs()[i]] = values_.size();
    values_.push_back({input_names_.at(i - 1), static_cast<int>(i - 1), 0});
    value_of_.push_back(graph_->inputs()[i]);
  }
  std::map<std::vector<std::string>, size_t> attribute_id;

  // Records what `node` (a top-level node, or the return) reads from outside itself.
  auto collect = [&](ProgramNode& pn, const Node* node) {
    auto use = [&](const torch::jit::Value* v, const Node* user) {
      if (v == self) {
        if (pn.unsupported.empty())
          pn.unsupported = "the model passes its own module object to " + std::string(user->kind().toQualString()) +
                           " at " + where(user) + "; only reads of its attributes can be split";
        return;
      }
      auto path = attribute_path(v, self);
      if (!path.empty()) {
        auto [it, inserted] = attribute_id.emplace(path, attributes_.size());
        if (inserted) attributes_.push_back(read_attribute(module_, path));
        if (std::find(pn.attributes.begin(), pn.attributes.end(), it->second) == pn.attributes.end())
          pn.attributes.push_back(it->second);
        return;
      }
      auto it = value_id.find(v);  // forward inputs and earlier top-level nodes' outputs
      if (it != value_id.end() && std::find(pn.reads.begin(), pn.reads.end(), it->second) == pn.reads.end())
        pn.reads.push_back(it->second);
    };
    std::function<void(const Node*)> visit = [&](const Node* n) {
      if (n->kind() == torch::jit::prim::GetAttr && !attribute_path(n->output(), self).empty())
        return;  // an attribute read; recorded where its result is consumed
      for (const torch::jit::Value* v : n->inputs()) use(v, n);
      for (const auto* block : n->blocks()) {
        for (const Node* inner : block->nodes()) visit(inner);
        visit(block->return_node());
      }
    };
    if (node == graph_->return_node()) {
      for (const torch::jit::Value* v : graph_->outputs()) use(v, node);
    } else {
      visit(node);
    }
  };

  find_nested_marker(graph_->block(), true, nested_marker_);
  for (Node* n : graph_->nodes()) {
    if (is_floating_node(n, self)) continue;
    ProgramNode pn;
    if (n->kind() == split_marker_kind()) pn.role = NodeRole::SplitMarker;
    if (n->kind() == torch::jit::prim::Enter) {
      pn.role = NodeRole::ContextEnter;
      pn.context = n->input(0)->type()->str();
    }
    if (n->kind() == torch::jit::prim::Exit) pn.role = NodeRole::ContextExit;
    pn.sites = sites_of(n);
    pn.where = where(n);
    collect(pn, n);
    const size_t id = nodes_.size();
    for (torch::jit::Value* out : n->outputs()) {
      value_id[out] = values_.size();
      values_.push_back({out->debugName(), -1, id});
      value_of_.push_back(out);
    }
    node_id_[n] = id;
    node_of_.push_back(n);
    nodes_.push_back(std::move(pn));
  }
  collect(returns_, graph_->return_node());
  returns_.where = "the return of forward";

  for (const InPlaceWrite& w : in_place_writes(*graph_)) {
    auto [it, inserted] = attribute_id.emplace(w.path, attributes_.size());
    if (inserted) attributes_.push_back(read_attribute(module_, w.path));
    AttributeRead& a = attributes_[it->second];
    const size_t writer = node_id(w.top);
    if (std::find(a.writers.begin(), a.writers.end(), writer) == a.writers.end()) a.writers.push_back(writer);
    if (a.written_by.empty()) a.written_by = w.what;
  }
}

std::vector<InPlaceWrite> in_place_writes(const torch::jit::Graph& graph) {
  std::vector<InPlaceWrite> out;
  find_writes(graph.block(), nullptr, graph.inputs()[0], out);
  return out;
}

const Model& torchscript_model(const Plan& plan) {
  const auto* model = dynamic_cast<const Model*>(&plan.model());
  if (!model) throw Error(Status::Internal, "a TorchScript stage was asked of a plan made from another format's model");
  return *model;
}

bool is_floating_node(const Node* node, const torch::jit::Value* self) {
  if (node->kind() == torch::jit::prim::Constant) return true;
  return node->kind() == torch::jit::prim::GetAttr && !attribute_path(node->output(), self).empty();
}

std::vector<std::string> attribute_path(const torch::jit::Value* value, const torch::jit::Value* self) {
  std::vector<std::string> path;
  while (value->node()->kind() == torch::jit::prim::GetAttr) {
    path.push_back(value->node()->s(torch::jit::attr::name));
    value = value->node()->input(0);
  }
  if (value != self) return {};
  std::reverse(path.begin(), path.end());
  return path;
}

std::shared_ptr<Plan> Plan::from_groups(std::shared_ptr<const Model> model,
                                        std::vector<std::vector<torch::jit::Node*>> groups) {
  std::vector<std::vector<size_t>> ids;
  for (const auto& group : groups) {
    ids.emplace_back();
    for (const Node* n : group) ids.back().push_back(model->node_id(n));
  }
  return from_groups(std::shared_ptr<const Program>(std::move(model)), std::move(ids));
}

std::vector<BufferInfo> Model::buffers() const {
  std::vector<BufferInfo> out;
  for (const auto& item : module_.named_buffers(/*recurse=*/true))
    out.push_back({item.name, item.value.sizes().vec(), item.value.scalar_type()});
  return out;
}

bool Model::root_flag(const std::string& name) const {
  return module_.hasattr(name) && module_.attr(name).isBool() && module_.attr(name).toBool();
}

std::shared_ptr<const Model> Model::load(const std::string& path) {
  if (io::check_model_archive(path) != io::ModelFormat::TorchScript)  // before LibTorch's reader, which trusts the zip
    throw Error(Status::InvalidFormat, "'" + path + "' is a torch.export program, not a TorchScript archive");
  register_split_marker();

  auto model = std::make_shared<Model>();
  model->path_ = path;
  try {
    // Onto the CPU whatever device the model was saved from: each stage's tensors go to that
    // stage's device only when the session builds it (and a model saved on a GPU loads on a
    // machine, or in a process, without one).
    model->module_ = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat, "'" + path +
                                           "' is not a loadable TorchScript archive (save it with "
                                           "torch.jit.trace(...).save() or torch.jit.script(...).save()): " +
                                           e.what_without_backtrace());
  }
  model->module_.eval();

  auto forward = model->module_.find_method("forward");
  if (!forward) throw Error(Status::InvalidFormat, "'" + path + "' has no forward method to split");

  model->graph_ = forward->graph()->copy();
  model->inline_calls(model->graph_->block());
  strip_grad_mode(model->graph_->block());
  // Inlining leaves unused attribute reads and constants behind; dropping them keeps the per-stage
  // parameter lists to what is really read.
  torch::jit::EliminateDeadCode(model->graph_);

  const auto& args = forward->function().getSchema().arguments();
  for (size_t i = 1; i < args.size(); ++i) model->input_names_.push_back(args[i].name());
  model->modules_ = describe_modules(model->module_);
  for (const auto& p : model->module_.named_parameters())
    if (p.value.is_meta()) {
      model->parameter_without_data_ = p.name;
      break;
    }
  model->describe();
  return model;
}

}  // namespace libpipe::graph
