#include "runtime/stage/torchscript/panel_rewrite.h"

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/graph/torchscript/model.h"
#include "runtime/stage/panel_linear.h"

namespace libpipe::stage {

namespace {

void collect(torch::jit::Block* block, std::vector<torch::jit::Node*>& linears,
             std::vector<torch::jit::Node*>& getattrs) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::linear && n->inputs().size() == 3) linears.push_back(n);
    if (n->kind() == torch::jit::prim::GetAttr) getattrs.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect(b, linears, getattrs);
  }
}

// Whether the linear layer's result is what the forward returns, through dtype casts and copies only: the
// model's output head (a decoder's lm_head, whose logits are what the sampler reads).
bool returns_output(const torch::jit::Node* linear) {
  const torch::jit::Value* v = linear->output();
  for (int hops = 0; hops < 8; ++hops) {
    if (v->uses().size() != 1) return false;
    const torch::jit::Node* user = v->uses()[0].user;
    if (user == user->owningGraph()->return_node()) return true;
    const auto kind = user->kind();
    if (kind != torch::jit::aten::to && kind != torch::jit::aten::contiguous && kind != torch::jit::aten::clone &&
        kind != torch::jit::prim::TupleConstruct)
      return false;
    v = user->output();
  }
  return false;
}

c10::IValue attribute(torch::jit::Module stage, const std::vector<std::string>& path, torch::jit::Module* owner) {
  for (size_t i = 0; i + 1 < path.size(); ++i) stage = stage.attr(path[i]).toModule();
  if (owner) *owner = stage;
  return stage.attr(path.back());
}

// `path` read from `self` by a chain of prim::GetAttr at the graph's insertion point.
torch::jit::Value* get_attr_path(torch::jit::Graph& graph, torch::jit::Value* self,
                                 const std::vector<std::string>& path) {
  torch::jit::Value* v = self;
  for (const auto& name : path) v = graph.insertGetAttr(v, name);
  return v;
}

bool grouping_enabled() {
  const char* env = std::getenv("LIBPIPE_GROUPED_LINEAR");
  return !(env && std::strcmp(env, "0") == 0);
}

// Where each kind of product (pipe::panel_linear, _int8, _int4) has its panels, scales, bias and sizes, and the
// grouped operator that takes several of them.
struct ProductKind {
  c10::Symbol single, grouped;
  int scales;  // the input holding the int8 scales, or -1
  int bias, out_features, in_features;
  int group;  // the input holding int4's group size, or -1
};

const std::vector<ProductKind>& product_kinds() {
  static const std::vector<ProductKind> kinds = {
      {c10::Symbol::fromQualString("pipe::panel_linear"), c10::Symbol::fromQualString("pipe::panel_linear_group"), -1,
       2, 3, 4, -1},
      {c10::Symbol::fromQualString("pipe::panel_linear_int8"),
       c10::Symbol::fromQualString("pipe::panel_linear_int8_group"), 2, 3, 4, 5, -1},
      {c10::Symbol::fromQualString("pipe::panel_linear_int4"),
       c10::Symbol::fromQualString("pipe::panel_linear_int4_group"), -1, 2, 3, 4, 5},
  };
  return kinds;
}

// Products of one input in one block (a layer's q, k and v; gate and up) of one kind, in features and (int4) group
// become one grouped product at the first of them (pipe::panel_linear_group, _int8_group, _int4_group), each output
// as before. Their panels, scales and biases must be attributes (read again there) or no bias.
size_t group_linears(torch::jit::Graph& graph, torch::jit::Value* self) {
  struct Key {
    torch::jit::Block* block;
    torch::jit::Value* input;
    size_t kind;
    int64_t in_features, group;
    bool operator<(const Key& o) const {
      return std::tie(block, input, kind, in_features, group) <
             std::tie(o.block, o.input, o.kind, o.in_features, o.group);
    }
  };
  const std::vector<ProductKind>& kinds = product_kinds();
  std::map<Key, std::vector<torch::jit::Node*>> by_key;
  std::vector<Key> order;
  auto from_self = [&](torch::jit::Value* v) { return !graph::attribute_path(v, self).empty(); };
  std::function<void(torch::jit::Block*)> collect_products = [&](torch::jit::Block* block) {
    for (torch::jit::Node* n : block->nodes()) {
      for (torch::jit::Block* b : n->blocks()) collect_products(b);
      const auto kind =
          std::find_if(kinds.begin(), kinds.end(), [&](const ProductKind& k) { return k.single == n->kind(); });
      if (kind == kinds.end()) continue;
      const bool bias_ok =
          n->input(kind->bias)->type()->kind() == c10::TypeKind::NoneType || from_self(n->input(kind->bias));
      const auto in_features = torch::jit::toIValue(n->input(kind->in_features));
      const auto group =
          kind->group < 0 ? std::optional<c10::IValue>(int64_t{0}) : torch::jit::toIValue(n->input(kind->group));
      if (!bias_ok || !from_self(n->input(1)) || (kind->scales >= 0 && !from_self(n->input(kind->scales))) ||
          !torch::jit::toIValue(n->input(kind->out_features)) || !in_features || !group)
        continue;
      const Key key{block, n->input(0), static_cast<size_t>(kind - kinds.begin()), in_features->toInt(),
                    group->toInt()};
      auto [it, fresh] = by_key.try_emplace(key);
      if (fresh) order.push_back(key);
      it->second.push_back(n);
    }
  };
  collect_products(graph.block());
  size_t grouped = 0;
  for (const Key& key : order) {
    const std::vector<torch::jit::Node*>& group = by_key[key];
    if (group.size() < 2) continue;
    const ProductKind& kind = kinds[key.kind];
    // In block order (collect visits them so), the first is where every input of the group exists: the shared
    // input, and the attributes read again from `self`.
    torch::jit::WithInsertPoint here(group.front());
    auto reread = [&](torch::jit::Value* v) { return get_attr_path(graph, self, graph::attribute_path(v, self)); };
    std::vector<torch::jit::Value*> panels, scales, biases;
    std::vector<int64_t> out_features;
    for (torch::jit::Node* n : group) {
      panels.push_back(reread(n->input(1)));
      if (kind.scales >= 0) scales.push_back(reread(n->input(kind.scales)));
      biases.push_back(n->input(kind.bias)->type()->kind() == c10::TypeKind::NoneType
                           ? graph.insertConstant(c10::IValue())
                           : reread(n->input(kind.bias)));
      out_features.push_back(torch::jit::toIValue(n->input(kind.out_features))->toInt());
    }
    auto list = [&](const c10::TypePtr& type, const std::vector<torch::jit::Value*>& values) {
      return graph.insertNode(graph.createList(type, values))->output();
    };
    std::vector<torch::jit::NamedValue> args = {key.input, list(c10::TensorType::get(), panels)};
    if (kind.scales >= 0) args.emplace_back(list(c10::TensorType::get(), scales));
    args.emplace_back(list(c10::OptionalType::create(c10::TensorType::get()), biases));
    args.emplace_back(out_features);
    args.emplace_back(key.in_features);
    if (kind.group >= 0) args.emplace_back(key.group);
    torch::jit::Value* outs = graph.insert(kind.grouped, args);
    torch::jit::Node* unpack = graph.insertNode(graph.createListUnpack(outs, group.size()));
    for (size_t i = 0; i < group.size(); ++i) {
      unpack->output(i)->setType(group[i]->output()->type());
      group[i]->output()->replaceAllUsesWith(unpack->output(i));
      group[i]->destroy();
    }
    ++grouped;
  }
  if (grouped) torch::jit::EliminateDeadCode(graph.block());
  return grouped;
}

// The weights of `stage`'s linear layers that panel_linear_weights packs, by tensor (a tied weight is one), with the
// layers that multiply by it and what else reads it. `packable` says which tensors can be packed (can_pack for a
// stage about to be rewritten; shape and dtype alone for one whose weights are still to be loaded).
struct Weight {
  at::Tensor tensor;
  std::vector<torch::jit::Node*> linears;
  std::vector<torch::jit::Node*> embeddings;
  bool other_reads = false;  // read by anything but those: the original must stay
  at::Tensor panels;
  at::Tensor scales;  // int8 panels: each output feature's scale; undefined otherwise
  bool int4 = false;  // int4 panels (their scales inside)
  bool head = false;  // the model's output head (returns_output) multiplies by it
};
struct LinearWeights {
  std::map<const c10::TensorImpl*, Weight> weights;
  std::vector<const c10::TensorImpl*> order;  // first use first: packing order does not depend on pointers
  std::vector<torch::jit::Node*> getattrs;
};

LinearWeights linear_weights(torch::jit::Module& stage, torch::jit::Graph& graph,
                             const std::function<bool(const at::Tensor&)>& packable) {
  LinearWeights out;
  const torch::jit::Value* self = graph.inputs()[0];
  std::set<std::vector<std::string>> written;
  for (const auto& w : graph::in_place_writes(graph)) written.insert(w.path);

  std::vector<torch::jit::Node*> linears;
  collect(graph.block(), linears, out.getattrs);
  auto& weights = out.weights;
  for (torch::jit::Node* node : linears) {
    const std::vector<std::string> path = graph::attribute_path(node->input(1), self);
    if (path.empty() || written.count(path)) continue;  // computed, or changing: not a constant weight
    const c10::IValue value = attribute(stage, path, nullptr);
    if (!value.isTensor() || !packable(value.toTensor())) continue;
    auto [it, fresh] = weights.try_emplace(value.toTensor().unsafeGetTensorImpl());
    if (fresh) {
      it->second.tensor = value.toTensor();
      out.order.push_back(it->first);
    }
    it->second.linears.push_back(node);
    it->second.head |= returns_output(node);
  }
  if (weights.empty()) return out;
  // Every other read of those tensors: an embedding lookup can read the panels; anything else keeps the original.
  for (torch::jit::Node* get : out.getattrs) {
    if (!get->output()->type()->isSubtypeOf(*c10::TensorType::get())) continue;
    const std::vector<std::string> path = graph::attribute_path(get->output(), self);
    if (path.empty()) continue;
    const c10::IValue value = attribute(stage, path, nullptr);
    if (!value.isTensor()) continue;
    auto it = weights.find(value.toTensor().unsafeGetTensorImpl());
    if (it == weights.end()) continue;
    for (const torch::jit::Use& use : get->output()->uses()) {
      const bool as_weight = use.offset == (use.user->kind() == torch::jit::aten::linear ? 1u : 0u);
      if (use.user->kind() == torch::jit::aten::linear && as_weight &&
          std::find(it->second.linears.begin(), it->second.linears.end(), use.user) != it->second.linears.end())
        continue;
      if (use.user->kind() == torch::jit::aten::embedding && as_weight) {
        it->second.embeddings.push_back(use.user);
        continue;
      }
      it->second.other_reads = true;
    }
  }
  return out;
}

// An embedding table quantize_embeddings stores as int8: a 2-d floating tensor that nothing writes and that only
// aten::embedding reads, as its weight. A table tied to a linear layer of the stage (a head sharing the embedding's
// weight), or read any other way, is not one: its other reader needs the original (or, for a tied head,
// panel_linear_weights' panels).
struct EmbeddingTable {
  at::Tensor tensor;
  std::set<std::vector<std::string>> paths;  // every name the forward reads it by
  std::vector<torch::jit::Node*> lookups;
  bool other_reads = false;
};

std::map<const c10::TensorImpl*, EmbeddingTable> embedding_tables(torch::jit::Module& stage, torch::jit::Graph& graph) {
  const torch::jit::Value* self = graph.inputs()[0];
  std::set<std::vector<std::string>> written;
  for (const auto& w : graph::in_place_writes(graph)) written.insert(w.path);
  std::vector<torch::jit::Node*> linears, getattrs;
  collect(graph.block(), linears, getattrs);
  std::map<const c10::TensorImpl*, EmbeddingTable> tables;
  for (torch::jit::Node* get : getattrs) {
    if (!get->output()->type()->isSubtypeOf(*c10::TensorType::get())) continue;
    const std::vector<std::string> path = graph::attribute_path(get->output(), self);
    if (path.empty()) continue;
    const c10::IValue value = attribute(stage, path, nullptr);
    if (!value.isTensor()) continue;
    EmbeddingTable& t = tables[value.toTensor().unsafeGetTensorImpl()];
    t.tensor = value.toTensor();
    t.paths.insert(path);
    if (written.count(path)) t.other_reads = true;
    for (const torch::jit::Use& use : get->output()->uses()) {
      if (use.user->kind() == torch::jit::aten::embedding && use.offset == 0) t.lookups.push_back(use.user);
      else t.other_reads = true;
    }
  }
  for (auto it = tables.begin(); it != tables.end();) {
    const at::Tensor& t = it->second.tensor;
    const bool table = !it->second.other_reads && !it->second.lookups.empty() && t.dim() == 2 && t.numel() > 0 &&
                       at::isFloatingType(t.scalar_type());
    it = table ? std::next(it) : tables.erase(it);
  }
  return tables;
}

// How `w` is stored: the weights only linear layers read become codes (a tied embedding, or a weight read
// otherwise, keeps its dtype); the output head as `head` says.
WeightQuantization storage(const Weight& w, WeightQuantization quantize, WeightQuantization head) {
  const WeightQuantization as = w.head && quantize != WeightQuantization::None ? head : quantize;
  return !w.other_reads && w.embeddings.empty() ? as : WeightQuantization::None;
}

}  // namespace

size_t panel_linear_weights(torch::jit::Module& stage, WeightQuantization quantize, int64_t group,
                            std::optional<WeightQuantization> head_option) {
  if (group == 0) group = kDefaultInt4Group;
  StageOptions options;
  options.quantize = quantize;
  options.quantize_head = head_option;
  const WeightQuantization head = head_quantization(options);
  if (!panel_linear_available()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  const torch::jit::Value* self = graph->inputs()[0];
  LinearWeights found = linear_weights(stage, *graph, [](const at::Tensor& t) { return can_pack(t); });
  auto& weights = found.weights;
  const auto& order = found.order;
  const auto& getattrs = found.getattrs;
  if (weights.empty()) return 0;

  register_panel_ops();
  // Paths that read each weight, so that an original nothing else reads can go as soon as its panels exist:
  // converted one by one, a load never holds every weight twice (runtime/stage/checkpoint.cpp drops a checkpoint
  // view's pages with it).
  std::map<const c10::TensorImpl*, std::set<std::vector<std::string>>> paths;
  for (torch::jit::Node* get : getattrs) {
    if (!get->output()->type()->isSubtypeOf(*c10::TensorType::get())) continue;
    const std::vector<std::string> path = graph::attribute_path(get->output(), self);
    if (path.empty()) continue;
    const c10::IValue value = attribute(stage, path, nullptr);
    if (value.isTensor() && weights.count(value.toTensor().unsafeGetTensorImpl()))
      paths[value.toTensor().unsafeGetTensorImpl()].insert(path);
  }
  std::vector<at::Tensor> tensors;
  for (const auto* impl : order) tensors.push_back(weights.at(impl).tensor);
  // int8 / int4: the weights only linear layers read become codes and scales (a tied embedding, or a weight read
  // otherwise, keeps its dtype; the output head is stored as `head` says). The
  // arena is sized from the codes' shape alone, and each weight is quantized just before it is packed: a load never
  // holds more than one weight's codes beside the panels.
  std::vector<bool> to_int8(order.size(), false), to_int4(order.size(), false);
  std::vector<size_t> sizes;
  for (size_t i = 0; i < order.size(); ++i) {
    const WeightQuantization as = storage(weights.at(order[i]), quantize, head);
    to_int8[i] = as == WeightQuantization::Int8;
    to_int4[i] = as == WeightQuantization::Int4;
    const at::Tensor codes = at::empty(tensors[i].sizes(), at::TensorOptions().dtype(at::kChar).device(at::kMeta));
    sizes.push_back(to_int4[i]   ? PanelArena::int4_bytes(tensors[i].size(0), tensors[i].size(1), group)
                    : to_int8[i] ? PanelArena::bytes_of(codes)
                                 : PanelArena::bytes_of(tensors[i]));
  }
  PanelArena arena(sizes);
  std::vector<int64_t> shapes;
  for (size_t i = 0; i < order.size(); ++i) {
    Weight& w = weights.at(order[i]);
    if (to_int8[i]) {
      Int8Weight q = quantize_int8(tensors[i]);
      w.panels = arena.pack(i, q.codes);
      w.scales = std::move(q.scales);
    } else if (to_int4[i]) {
      w.panels = arena.pack_int4(i, quantize_int4(tensors[i], group), tensors[i].size(1));
      w.int4 = true;
    } else {
      w.panels = arena.pack(i, tensors[i]);
    }
    shapes.push_back(w.tensor.size(0));
    shapes.push_back(w.tensor.size(1));
    tensors[i] = at::Tensor();
    if (w.other_reads) continue;
    for (const auto& path : paths[order[i]]) {
      torch::jit::Module owner;
      attribute(stage, path, &owner);
      owner._ivalue()->setAttr(path.back(), at::empty({0}, w.tensor.options()));
    }
    w.tensor = at::Tensor();
  }

  size_t rewritten = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    Weight& w = weights.at(order[i]);
    const int64_t n = shapes[2 * i], k = shapes[2 * i + 1];
    // The panels as a buffer beside the weight, in the module that holds it.
    auto buffer_of = [&](torch::jit::Node* user, size_t weight_input, const std::string& suffix,
                         const at::Tensor& tensor) {
      torch::jit::Value* weight = user->input(weight_input);
      torch::jit::Module owner;
      const std::vector<std::string> path = graph::attribute_path(weight, self);
      attribute(stage, path, &owner);
      const std::string name = path.back() + suffix;
      if (!owner.hasattr(name)) owner.register_buffer(name, tensor);
      return graph->insertGetAttr(weight->node()->input(0), name);
    };
    auto panels_of = [&](torch::jit::Node* user, size_t weight_input) {
      return buffer_of(user, weight_input, "_panels", w.panels);
    };
    for (torch::jit::Node* node : w.linears) {
      torch::jit::WithInsertPoint here(node);
      torch::jit::Value* panels = panels_of(node, 1);
      torch::jit::Value* out =
          w.int4 ? graph->insert(c10::Symbol::fromQualString("pipe::panel_linear_int4"),
                                 {node->input(0), panels, node->input(2), n, k, group})
          : w.scales.defined()
              ? graph->insert(c10::Symbol::fromQualString("pipe::panel_linear_int8"),
                              {node->input(0), panels, buffer_of(node, 1, "_scales", w.scales), node->input(2), n, k})
              : graph->insert(c10::Symbol::fromQualString("pipe::panel_linear"),
                              {node->input(0), panels, node->input(2), n, k});
      node->output()->replaceAllUsesWith(out);
      node->destroy();
      ++rewritten;
    }
    if (w.other_reads) continue;
    for (torch::jit::Node* node : w.embeddings) {
      torch::jit::WithInsertPoint here(node);
      torch::jit::Value* panels = panels_of(node, 0);
      torch::jit::Value* out =
          graph->insert(c10::Symbol::fromQualString("pipe::panel_embedding"), {panels, node->input(1), n, k});
      node->output()->replaceAllUsesWith(out);
      node->destroy();
    }
  }
  if (grouping_enabled()) group_linears(*graph, graph->inputs()[0]);
  // The originals (and, for int8, each weight's quantization temporaries) were freed one by one, several
  // megabytes each: glibc keeps such blocks in its heap for reuse, which a stage that is done loading never
  // does. Hand them back to the system.
  malloc_trim(0);
  return rewritten;
}

size_t quantize_embeddings(torch::jit::Module& stage) {
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  const torch::jit::Value* self = graph->inputs()[0];
  std::map<const c10::TensorImpl*, EmbeddingTable> tables = embedding_tables(stage, *graph);
  if (tables.empty()) return 0;
  register_panel_ops();
  for (auto& [impl, t] : tables) {
    const at::ScalarType dtype = t.tensor.scalar_type();
    Int8Weight q = quantize_int8(t.tensor);
    for (torch::jit::Node* node : t.lookups) {
      torch::jit::WithInsertPoint here(node);
      // The codes and scales as buffers beside the table, in the module that holds it.
      torch::jit::Value* weight = node->input(0);
      const std::vector<std::string> path = graph::attribute_path(weight, self);
      torch::jit::Module owner;
      attribute(stage, path, &owner);
      auto buffer = [&](const std::string& suffix, const at::Tensor& tensor) {
        const std::string name = path.back() + suffix;
        if (!owner.hasattr(name)) owner.register_buffer(name, tensor);
        return graph->insertGetAttr(weight->node()->input(0), name);
      };
      torch::jit::Value* out =
          graph->insert(c10::Symbol::fromQualString("pipe::embedding_int8"),
                        {buffer("_codes", q.codes), buffer("_scales", q.scales), node->input(1), c10::IValue(dtype)});
      node->output()->replaceAllUsesWith(out);
      node->destroy();
    }
    // Nothing reads the original any more: the stage keeps only the codes (checkpoint.cpp drops a checkpoint view's
    // pages with it).
    for (const auto& path : t.paths) {
      torch::jit::Module owner;
      attribute(stage, path, &owner);
      owner._ivalue()->setAttr(path.back(), at::empty({0}, t.tensor.options()));
    }
    t.tensor = at::Tensor();
  }
  malloc_trim(0);
  return tables.size();
}

uint64_t stored_bytes(torch::jit::Module& stage, const StageOptions& options) {
  // Each tensor as load_stage_weights leaves it: floating ones cast to the stage's dtype.
  const auto dtype_of = [&](const at::Tensor& t) {
    return options.dtype && at::isFloatingType(t.scalar_type()) ? *options.dtype : t.scalar_type();
  };
  std::map<const c10::TensorImpl*, Weight> weights;
  auto forward = stage.find_method("forward");
  if (forward && panel_linear_available())
    // can_pack but for the device: the weights may still be on the meta device, to be loaded from a checkpoint.
    weights = linear_weights(stage, *forward->graph(), [&](const at::Tensor& t) {
                return can_pack(at::empty(t.sizes(), at::TensorOptions().dtype(dtype_of(t)).device(at::kMeta)),
                                /*any_device=*/true);
              }).weights;
  std::map<const c10::TensorImpl*, EmbeddingTable> tables;
  if (forward && options.quantize_embedding == WeightQuantization::Int8)
    tables = embedding_tables(stage, *forward->graph());
  const WeightQuantization head = head_quantization(options);
  const int64_t group = options.quantize_group ? options.quantize_group : kDefaultInt4Group;
  uint64_t total = 0;
  std::set<const c10::TensorImpl*> seen;  // a tensor under several names (tied) is stored once
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    const uint64_t plain = static_cast<uint64_t>(t.numel()) * c10::elementSize(dtype_of(t));
    if (tables.count(t.unsafeGetTensorImpl())) {  // int8 codes and a float32 scale per row
      total += static_cast<uint64_t>(t.numel()) + static_cast<uint64_t>(t.size(0)) * sizeof(float);
      return;
    }
    auto it = weights.find(t.unsafeGetTensorImpl());
    if (it == weights.end()) {
      total += plain;
      return;
    }
    total += stored_panel_bytes(t.size(0), t.size(1), dtype_of(t), storage(it->second, options.quantize, head), group);
    if (it->second.other_reads) total += plain;  // the original stays beside its panels
  };
  for (const auto& p : stage.named_parameters()) add(p.value);
  for (const auto& b : stage.named_buffers()) add(b.value);
  return total;
}

}  // namespace libpipe::stage
