#include "runtime/stage/panel_linear.h"

#include <ATen/Parallel.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/cpu/huge_pages.h"
#include "runtime/cpu/panel_gemm.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/log.h"
#include "runtime/stage/spare_cores.h"

namespace libpipe::stage {

namespace {

using cpu::WeightType;

// At most this many units (2048 output features) per piece of a product shared with borrowed cores:
// a helper leaves between two pieces when the stage it borrowed from wants its core back, and a
// piece of the 576 x 49152 head of this size is 0.1-0.4 ms of memory traffic.
constexpr int64_t kMaxUnitsPerPiece = 128;
// Below this many weight bytes per piece, OpenMP's hand-over costs more than the piece.
constexpr int64_t kMinBytesPerPiece = 32 << 10;

std::optional<WeightType> weight_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return WeightType::kFloat32;
    case at::kBFloat16: return WeightType::kBFloat16;
    case at::kHalf: return WeightType::kFloat16;
    default: return std::nullopt;
  }
}

bool packable(const at::Tensor& w) {
  return w.defined() && w.device().is_cpu() && w.dim() == 2 && w.numel() > 0 && weight_type(w.scalar_type()) &&
         w.size(0) <= std::numeric_limits<int32_t>::max() && w.size(1) <= std::numeric_limits<int32_t>::max();
}

// Refuses what aten::linear would refuse (with its words where users know them), and panels of another shape.
WeightType check_product(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, int64_t in_features) {
  const auto type = weight_type(panels.scalar_type());
  if (!type || panels.dim() != 1 || !panels.is_contiguous() ||
      panels.numel() != cpu::panel_elements(*type, out_features, in_features))
    throw Error(Status::InvalidArgument, "pipe::panel_linear: the panels do not hold a " +
                                             std::to_string(out_features) + " x " + std::to_string(in_features) +
                                             " weight (make them with to_panels)");
  if (!input.device().is_cpu())
    throw Error(Status::InvalidArgument,
                "pipe::panel_linear: the input is on " + input.device().str() + ", the stage's weights are on the CPU");
  if (input.scalar_type() != panels.scalar_type())
    throw Error(Status::InvalidArgument, std::string("pipe::panel_linear: the input is ") +
                                             c10::toString(input.scalar_type()) + ", the layer's weights are " +
                                             c10::toString(panels.scalar_type()) +
                                             " (mat1 and mat2 must have the same dtype)");
  if (input.dim() < 1 || input.size(-1) != in_features)
    throw Error(Status::InvalidArgument,
                "pipe::panel_linear: mat1 and mat2 shapes cannot be multiplied: the input's last "
                "dimension is " +
                    (input.dim() ? std::to_string(input.size(-1)) : std::string("missing")) + ", the layer takes " +
                    std::to_string(in_features) + " features");
  const at::Tensor* b = bias && bias->defined() ? &*bias : nullptr;
  if (b && (b->scalar_type() != panels.scalar_type() || b->numel() != out_features || !b->device().is_cpu()))
    throw Error(Status::InvalidArgument, "pipe::panel_linear: the bias must be " + std::to_string(out_features) + " " +
                                             c10::toString(panels.scalar_type()) + " values on the CPU");
  return *type;
}

at::Tensor linear_op(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                     int64_t out_features, int64_t in_features) {
  const WeightType type = check_product(input, panels, bias, out_features, in_features);
  const at::Tensor* b = bias && bias->defined() ? &*bias : nullptr;
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  const at::Tensor bias_values = b ? b->contiguous() : at::Tensor();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  at::Tensor out = at::empty({x.size(0), out_features}, input.options());
  if (x.size(0) > 0) {
    cpu::PanelProduct p;
    p.type = type;
    p.x = x.data_ptr();
    p.ldx = in_features;
    p.panels = panels.data_ptr();
    p.bias = b ? bias_values.data_ptr() : nullptr;
    p.out = out.data_ptr();
    p.ldo = out_features;
    p.m = x.size(0);
    p.n = out_features;
    p.k = in_features;
    const int64_t unit_bytes = cpu::kUnitWidth * in_features * static_cast<int64_t>(panels.element_size());
    SpareCores::for_ranges(cpu::panel_units(out_features), kMinBytesPerPiece / std::max<int64_t>(unit_bytes, 1),
                           kMaxUnitsPerPiece, [&](int64_t begin, int64_t end) { cpu::panel_product(p, begin, end); });
  }
  return out.view(sizes);
}

// Several products of one input (a layer's q, k and v; gate and up) as one: one hand-over to the lent cores and
// one wait for them instead of one per product. Each output unit is computed as by linear_op alone, so the
// outputs have the same bits.
std::vector<at::Tensor> linear_group_op(const at::Tensor& input, const std::vector<at::Tensor>& panels,
                                        const std::vector<std::optional<at::Tensor>>& biases,
                                        const std::vector<int64_t>& out_features, int64_t in_features) {
  if (panels.empty() || panels.size() != biases.size() || panels.size() != out_features.size())
    throw Error(Status::InvalidArgument, "pipe::panel_linear_group: " + std::to_string(panels.size()) + " panels, " +
                                             std::to_string(biases.size()) + " biases and " +
                                             std::to_string(out_features.size()) + " output sizes: give one of each");
  std::vector<WeightType> types;
  for (size_t i = 0; i < panels.size(); ++i)
    types.push_back(check_product(input, panels[i], biases[i], out_features[i], in_features));
  const at::Tensor x = input.reshape({-1, in_features}).contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  std::vector<at::Tensor> outs;
  std::vector<cpu::PanelProduct> products;
  std::vector<at::Tensor> bias_values;
  std::vector<int64_t> first_unit;  // of each product, in the units of all
  int64_t units = 0;
  for (size_t i = 0; i < panels.size(); ++i) {
    outs.push_back(at::empty({x.size(0), out_features[i]}, input.options()));
    const at::Tensor* b = biases[i] && biases[i]->defined() ? &*biases[i] : nullptr;
    bias_values.push_back(b ? b->contiguous() : at::Tensor());
    cpu::PanelProduct p;
    p.type = types[i];
    p.x = x.data_ptr();
    p.ldx = in_features;
    p.panels = panels[i].data_ptr();
    p.bias = b ? bias_values.back().data_ptr() : nullptr;
    p.out = outs.back().data_ptr();
    p.ldo = out_features[i];
    p.m = x.size(0);
    p.n = out_features[i];
    p.k = in_features;
    products.push_back(p);
    first_unit.push_back(units);
    units += cpu::panel_units(out_features[i]);
  }
  if (x.size(0) > 0) {
    const int64_t unit_bytes = cpu::kUnitWidth * in_features * static_cast<int64_t>(panels[0].element_size());
    SpareCores::for_ranges(units, kMinBytesPerPiece / std::max<int64_t>(unit_bytes, 1), kMaxUnitsPerPiece,
                           [&](int64_t begin, int64_t end) {
                             for (size_t i = 0; i < products.size(); ++i) {
                               const int64_t lo = std::max(begin, first_unit[i]);
                               const int64_t hi = std::min(end, first_unit[i] + cpu::panel_units(products[i].n));
                               if (lo < hi) cpu::panel_product(products[i], lo - first_unit[i], hi - first_unit[i]);
                             }
                           });
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    sizes.back() = out_features[i];
    outs[i] = outs[i].view(sizes);
  }
  return outs;
}

at::Tensor embedding_op(const at::Tensor& panels, const at::Tensor& indices, int64_t num_embeddings,
                        int64_t embedding_dim) {
  const auto type = weight_type(panels.scalar_type());
  if (!type || panels.dim() != 1 || !panels.is_contiguous() ||
      panels.numel() != cpu::panel_elements(*type, num_embeddings, embedding_dim))
    throw Error(Status::InvalidArgument, "pipe::panel_embedding: the panels do not hold a " +
                                             std::to_string(num_embeddings) + " x " + std::to_string(embedding_dim) +
                                             " weight");
  if (indices.scalar_type() != at::kLong && indices.scalar_type() != at::kInt)
    throw Error(Status::InvalidArgument, std::string("pipe::panel_embedding: indices must be int64 or int32, not ") +
                                             c10::toString(indices.scalar_type()));
  const at::Tensor ids = indices.to(at::kLong).contiguous();
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(embedding_dim);
  at::Tensor out = at::empty(sizes, panels.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  char* o = static_cast<char*>(out.data_ptr());
  const size_t row_bytes = static_cast<size_t>(embedding_dim) * panels.element_size();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (id[i] < 0 || id[i] >= num_embeddings)
      throw Error(Status::InvalidArgument,
                  "pipe::panel_embedding: index out of range in self: " + std::to_string(id[i]) + " is not in 0 .. " +
                      std::to_string(num_embeddings - 1));
    cpu::unpack_row(*type, panels.data_ptr(), num_embeddings, embedding_dim, id[i], o + i * row_bytes);
  }
  return out;
}

void register_ops() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({"pipe::panel_linear", ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::panel_linear(Tensor input, Tensor panels, Tensor? bias, int out_features, "
                          "int in_features) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_op);
    lib.def(torch::schema("pipe::panel_embedding(Tensor panels, Tensor indices, int num_embeddings, "
                          "int embedding_dim) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &embedding_op);
    lib.def(torch::schema("pipe::panel_linear_group(Tensor input, Tensor[] panels, Tensor?[] biases, "
                          "int[] out_features, int in_features) -> Tensor[]",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &linear_group_op);
    return true;
  }();
  (void)once;
}

// Panels of several weights in one buffer on huge pages, each a tensor that keeps the buffer alive.
class PanelArena {
 public:
  // Room for the panels of `weights`, each at a 4 KiB boundary.
  explicit PanelArena(const std::vector<at::Tensor>& weights) {
    size_t total = 0;
    for (const auto& w : weights) {
      offsets_.push_back(total);
      total += (bytes_of(w) + 4095) / 4096 * 4096;
    }
    buffer_ = std::make_shared<cpu::HugePageBuffer>(total);
  }
  // The panels of weights[i], packed (on the intra-op threads of the calling thread).
  at::Tensor pack(size_t i, const at::Tensor& weight) {
    const WeightType type = *weight_type(weight.scalar_type());
    const int64_t n = weight.size(0), k = weight.size(1);
    void* data = static_cast<char*>(buffer_->data()) + offsets_[i];
    const at::Tensor w = weight.contiguous();
    at::parallel_for(0, (n + cpu::kPanelWidth - 1) / cpu::kPanelWidth, 1,
                     [&](int64_t begin, int64_t end) { cpu::pack_panels(type, w.data_ptr(), n, k, data, begin, end); });
    std::shared_ptr<cpu::HugePageBuffer> keep = buffer_;
    return at::from_blob(
        data, {cpu::panel_elements(type, n, k)}, [keep](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(weight.scalar_type()).device(at::kCPU));
  }

 private:
  static size_t bytes_of(const at::Tensor& w) {
    return static_cast<size_t>(cpu::panel_elements(*weight_type(w.scalar_type()), w.size(0), w.size(1))) *
           w.element_size();
  }
  std::vector<size_t> offsets_;
  std::shared_ptr<cpu::HugePageBuffer> buffer_;
};

void collect(torch::jit::Block* block, std::vector<torch::jit::Node*>& linears,
             std::vector<torch::jit::Node*>& getattrs) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::linear && n->inputs().size() == 3) linears.push_back(n);
    if (n->kind() == torch::jit::prim::GetAttr) getattrs.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect(b, linears, getattrs);
  }
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

// Products of one input in one block (a layer's q, k and v; gate and up) become one pipe::panel_linear_group at the
// first of them, each output as before. Their panels and biases must be attributes (read again there) or no bias.
size_t group_linears(torch::jit::Graph& graph, torch::jit::Value* self) {
  const auto kind = c10::Symbol::fromQualString("pipe::panel_linear");
  std::map<std::pair<torch::jit::Block*, torch::jit::Value*>, std::vector<torch::jit::Node*>> by_input;
  std::vector<std::pair<torch::jit::Block*, torch::jit::Value*>> order;
  std::function<void(torch::jit::Block*)> collect_products = [&](torch::jit::Block* block) {
    for (torch::jit::Node* n : block->nodes()) {
      for (torch::jit::Block* b : n->blocks()) collect_products(b);
      if (n->kind() != kind) continue;
      const bool bias_ok =
          n->input(2)->type()->kind() == c10::TypeKind::NoneType || !graph::attribute_path(n->input(2), self).empty();
      if (!bias_ok || graph::attribute_path(n->input(1), self).empty() || !torch::jit::toIValue(n->input(3)) ||
          !torch::jit::toIValue(n->input(4)))
        continue;
      auto key = std::make_pair(block, n->input(0));
      auto [it, fresh] = by_input.try_emplace(key);
      if (fresh) order.push_back(key);
      it->second.push_back(n);
    }
  };
  collect_products(graph.block());
  size_t grouped = 0;
  for (const auto& key : order) {
    std::vector<torch::jit::Node*>& nodes = by_input[key];
    const int64_t in_features = torch::jit::toIValue(nodes[0]->input(4))->toInt();
    std::vector<torch::jit::Node*> group;
    for (torch::jit::Node* n : nodes)
      if (torch::jit::toIValue(n->input(4))->toInt() == in_features) group.push_back(n);
    if (group.size() < 2) continue;
    // In block order (collect visits them so), the first is where every input of the group exists: the shared
    // input, and the attributes read again from `self`.
    torch::jit::WithInsertPoint here(group.front());
    std::vector<torch::jit::Value*> panels, biases;
    std::vector<int64_t> out_features;
    for (torch::jit::Node* n : group) {
      panels.push_back(get_attr_path(graph, self, graph::attribute_path(n->input(1), self)));
      biases.push_back(n->input(2)->type()->kind() == c10::TypeKind::NoneType
                           ? graph.insertConstant(c10::IValue())
                           : get_attr_path(graph, self, graph::attribute_path(n->input(2), self)));
      out_features.push_back(torch::jit::toIValue(n->input(3))->toInt());
    }
    torch::jit::Value* panel_list = graph.insertNode(graph.createList(c10::TensorType::get(), panels))->output();
    torch::jit::Value* bias_list =
        graph.insertNode(graph.createList(c10::OptionalType::create(c10::TensorType::get()), biases))->output();
    torch::jit::Value* outs = graph.insert(c10::Symbol::fromQualString("pipe::panel_linear_group"),
                                           {key.second, panel_list, bias_list, out_features, in_features});
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

thread_local PanelWeights* current_weights = nullptr;

at::Tensor linear_packed_on_demand(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  if (!current_weights) return at::linear(input, weight, bias);
  const at::Tensor& panels = current_weights->panels(weight);
  if (!panels.defined() || input.scalar_type() != weight.scalar_type()) return at::linear(input, weight, bias);
  return linear_op(input, panels, bias, weight.size(0), weight.size(1));
}

}  // namespace

bool panel_linear_available() {
  if (!cpu::cpu_has_panel_kernels()) return false;
  const char* env = std::getenv("LIBPIPE_PACKED_LINEAR");
  return !(env && std::strcmp(env, "0") == 0);
}

at::Tensor to_panels(const at::Tensor& weight) { return to_panels(std::vector<at::Tensor>{weight})[0]; }

std::vector<at::Tensor> to_panels(const std::vector<at::Tensor>& weights) {
  std::vector<at::Tensor> packable_ones;
  for (const auto& w : weights)
    if (packable(w)) packable_ones.push_back(w);
  std::vector<at::Tensor> out(weights.size());
  if (packable_ones.empty()) return out;
  PanelArena arena(packable_ones);
  for (size_t i = 0, j = 0; i < weights.size(); ++i)
    if (packable(weights[i])) {
      out[i] = arena.pack(j, weights[i]);
      ++j;
    }
  return out;
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t in_features) {
  return linear_op(input, panels, bias, out_features, in_features);
}

at::Tensor panel_embedding(const at::Tensor& panels, const at::Tensor& indices, int64_t num_embeddings,
                           int64_t embedding_dim) {
  return embedding_op(panels, indices, num_embeddings, embedding_dim);
}

size_t panel_linear_weights(torch::jit::Module& stage) {
  if (!panel_linear_available()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  const torch::jit::Value* self = graph->inputs()[0];
  std::set<std::vector<std::string>> written;
  for (const auto& w : graph::in_place_writes(*graph)) written.insert(w.path);

  std::vector<torch::jit::Node*> linears, getattrs;
  collect(graph->block(), linears, getattrs);

  // The weights to pack, by tensor (a tied weight is one), with the layers that multiply by it.
  struct Weight {
    at::Tensor tensor;
    std::vector<torch::jit::Node*> linears;
    std::vector<torch::jit::Node*> embeddings;
    bool other_reads = false;  // read by anything but those: the original must stay
    at::Tensor panels;
  };
  std::map<const c10::TensorImpl*, Weight> weights;
  std::vector<const c10::TensorImpl*> order;  // first use first: packing order does not depend on pointers
  for (torch::jit::Node* node : linears) {
    const std::vector<std::string> path = graph::attribute_path(node->input(1), self);
    if (path.empty() || written.count(path)) continue;  // computed, or changing: not a constant weight
    const c10::IValue value = attribute(stage, path, nullptr);
    if (!value.isTensor() || !packable(value.toTensor())) continue;
    auto [it, fresh] = weights.try_emplace(value.toTensor().unsafeGetTensorImpl());
    if (fresh) {
      it->second.tensor = value.toTensor();
      order.push_back(it->first);
    }
    it->second.linears.push_back(node);
  }
  if (weights.empty()) return 0;
  // Every other read of those tensors: an embedding lookup can read the panels; anything else keeps the original.
  std::set<const torch::jit::Node*> rewritable(linears.begin(), linears.end());
  for (torch::jit::Node* get : getattrs) {
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

  register_ops();
  // Paths that read each weight, so that an original nothing else reads can go as soon as its panels exist:
  // converted one by one, a load never holds every weight twice (runtime/stage/weights.cpp drops a checkpoint
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
  PanelArena arena(tensors);
  std::vector<int64_t> shapes;
  for (size_t i = 0; i < order.size(); ++i) {
    Weight& w = weights.at(order[i]);
    w.panels = arena.pack(i, tensors[i]);
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
    auto panels_of = [&](torch::jit::Node* user, size_t weight_input) {
      torch::jit::Value* weight = user->input(weight_input);
      torch::jit::Module owner;
      const std::vector<std::string> path = graph::attribute_path(weight, self);
      attribute(stage, path, &owner);
      const std::string name = path.back() + "_panels";
      if (!owner.hasattr(name)) owner.register_buffer(name, w.panels);
      return graph->insertGetAttr(weight->node()->input(0), name);
    };
    for (torch::jit::Node* node : w.linears) {
      torch::jit::WithInsertPoint here(node);
      torch::jit::Value* panels = panels_of(node, 1);
      torch::jit::Value* out = graph->insert(c10::Symbol::fromQualString("pipe::panel_linear"),
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
  return rewritten;
}

PanelWeights::Use::Use(PanelWeights& weights) : previous_(current_weights) { current_weights = &weights; }
PanelWeights::Use::~Use() { current_weights = previous_; }

const at::Tensor& PanelWeights::panels(const at::Tensor& weight) {
  auto [it, fresh] = panels_.try_emplace(weight.data_ptr());
  if (fresh) it->second = to_panels(weight);
  return it->second;
}

bool register_linear_packed_on_demand() {
  static const bool available = [] {
    if (!panel_linear_available()) return false;
    register_ops();
    if (!c10::Dispatcher::singleton().findSchema({"pipe::linear_packed_on_demand", ""}).has_value()) {
      static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
      lib.def(torch::schema("pipe::linear_packed_on_demand(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
                            c10::AliasAnalysisKind::FROM_SCHEMA),
              &linear_packed_on_demand);
    }
    return true;
  }();
  return available;
}

}  // namespace libpipe::stage
