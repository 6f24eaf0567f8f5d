#include "runtime/graph/plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "runtime/error.h"
#include "runtime/graph/split_marker.h"

namespace libpipe::graph {

using torch::jit::Node;
using torch::jit::Value;

namespace {

// "file.py:12" for a node traced or scripted from Python source, or its kind otherwise.
std::string where(const Node* node) {
  if (auto loc = node->sourceRange().file_line_col())
    return std::get<0>(*loc) + ":" + std::to_string(std::get<1>(*loc));
  return std::string("node ") + node->kind().toQualString();
}

bool is_top_level(const Node* node) { return node->owningBlock() == node->owningGraph()->block(); }

void check_no_nested_markers(const torch::jit::Block* block, bool top) {
  for (const Node* node : block->nodes()) {
    if (!top && node->kind() == split_marker_kind())
      throw Error(Status::Split,
                  "pipe::split() at " + where(node) +
                      " is inside an if/loop block; only forward's top level can be cut. Move "
                      "the marker out of the block (before or after it).");
    for (const auto* sub : node->blocks()) check_no_nested_markers(sub, false);
  }
}

// Walks a stage's nodes and records every value they read from outside themselves.
class UseCollector {
 public:
  UseCollector(const Value* self, std::unordered_map<const Node*, int>& stage_of, int stage,
               std::vector<std::vector<std::string>>& attributes,
               std::vector<const Value*>& external)
      : self_(self), stage_of_(stage_of), stage_(stage), attributes_(attributes), external_(external) {}

  void visit(const Node* node) {
    if (node->kind() == torch::jit::prim::GetAttr && !attribute_path(node->output(), self_).empty())
      return;  // an attribute read; recorded where its result is consumed
    for (const Value* v : node->inputs()) use(v, node);
    for (const auto* block : node->blocks()) {
      for (const Node* inner : block->nodes()) visit(inner);
      visit(block->return_node());
    }
  }

  void use(const Value* v, const Node* user) {
    if (v == self_)
      throw Error(Status::Unsupported,
                  "the model passes its own module object to " +
                      std::string(user->kind().toQualString()) + " at " + where(user) +
                      "; only reads of its attributes can be split");
    auto path = attribute_path(v, self_);
    if (!path.empty()) {
      if (std::find(attributes_.begin(), attributes_.end(), path) == attributes_.end())
        attributes_.push_back(std::move(path));
      return;
    }
    const Node* def = v->node();
    if (!is_top_level(def)) return;  // defined inside the same node's blocks
    if (def->kind() == torch::jit::prim::Constant) return;
    if (def->kind() == torch::jit::prim::Param || stage_of_.at(def) != stage_) {
      if (std::find(external_.begin(), external_.end(), v) == external_.end())
        external_.push_back(v);
    }
  }

 private:
  const Value* self_;
  std::unordered_map<const Node*, int>& stage_of_;
  int stage_;
  std::vector<std::vector<std::string>>& attributes_;
  std::vector<const Value*>& external_;
};

std::string join(const std::vector<std::string>& path) {
  std::string out;
  for (const auto& p : path) out += (out.empty() ? "" : ".") + p;
  return out;
}

// Adds the parameter and buffer names (and bytes) that an attribute path refers to.
void account_attribute(const torch::jit::Module& root, const std::vector<std::string>& path,
                       StagePlan& stage, std::set<std::string>& seen) {
  c10::intrusive_ptr<c10::ivalue::Object> obj = root._ivalue();
  for (size_t i = 0; i + 1 < path.size(); ++i) obj = obj->getAttr(path[i]).toObject();
  const auto& type = obj->type();
  const size_t slot = type->getAttributeSlot(path.back());
  const c10::IValue value = obj->getSlot(slot);
  auto add = [&](const std::string& name, const at::Tensor& t, bool is_param) {
    if (!seen.insert(name).second) return;
    (is_param ? stage.parameters : stage.buffers).push_back(name);
    stage.param_bytes += t.defined() ? t.nbytes() : 0;
  };
  if (value.isTensor() && (type->is_parameter(slot) || type->is_buffer(slot))) {
    add(join(path), value.toTensor(), type->is_parameter(slot));
  } else if (value.isModule()) {
    torch::jit::Module sub(value.toObject());
    const std::string prefix = join(path) + ".";
    for (const auto& p : sub.named_parameters()) add(prefix + p.name, p.value, true);
    for (const auto& b : sub.named_buffers()) add(prefix + b.name, b.value, false);
  }
}

}  // namespace

bool is_floating_node(const Node* node, const Value* self) {
  if (node->kind() == torch::jit::prim::Constant) return true;
  return node->kind() == torch::jit::prim::GetAttr && !attribute_path(node->output(), self).empty();
}

std::vector<std::string> attribute_path(const Value* value, const Value* self) {
  std::vector<std::string> path;
  while (value->node()->kind() == torch::jit::prim::GetAttr) {
    path.push_back(value->node()->s(torch::jit::attr::name));
    value = value->node()->input(0);
  }
  if (value != self) return {};
  std::reverse(path.begin(), path.end());
  return path;
}

std::shared_ptr<Plan> Plan::from_markers(std::shared_ptr<const Model> model) {
  const auto& graph = model->graph();
  check_no_nested_markers(graph->block(), true);
  const Value* self = graph->inputs()[0];

  std::vector<std::vector<Node*>> groups(1);
  std::vector<const Node*> markers;
  std::vector<std::string> reasons;
  for (Node* node : graph->nodes()) {
    if (node->kind() == split_marker_kind()) {
      markers.push_back(node);
      reasons.push_back("pipe::split() at " + where(node));
      groups.emplace_back();
    } else if (!is_floating_node(node, self)) {
      groups.back().push_back(node);
    }
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!groups[i].empty()) continue;
    std::string between = i == 0 ? "the start of forward and the marker at " + where(markers[0])
                          : i == markers.size()
                              ? "the marker at " + where(markers[i - 1]) + " and the end of forward"
                              : "the markers at " + where(markers[i - 1]) + " and " + where(markers[i]);
    throw Error(Status::Split, "stage " + std::to_string(i) + " would be empty: there is no computation between " +
                                   between + ". Remove the redundant pipe::split() call.");
  }
  auto plan = from_groups(std::move(model), std::move(groups));
  plan->describe_origin("pipe::split() markers", std::move(reasons));
  return plan;
}

std::shared_ptr<Plan> Plan::from_cuts(std::shared_ptr<const Model> model, const std::vector<Node*>& sequence,
                                     const std::vector<size_t>& cuts) {
  std::vector<std::vector<Node*>> groups(1);
  size_t next = 0;
  for (size_t p = 0; p < sequence.size(); ++p) {
    if (next < cuts.size() && cuts[next] == p) {
      groups.emplace_back();
      ++next;
    }
    groups.back().push_back(sequence[p]);
  }
  return from_groups(std::move(model), std::move(groups));
}

void Plan::describe_origin(std::string method, std::vector<std::string> boundary_reasons) {
  method_ = std::move(method);
  boundary_reasons_ = std::move(boundary_reasons);
}

void Plan::set_estimates(const std::vector<double>& ms) {
  for (size_t s = 0; s < stages_.size() && s < ms.size(); ++s) stages_[s].estimated_ms = ms[s];
}

double Plan::balance() const {
  double sum = 0, max = 0;
  for (const auto& st : stages_) {
    if (st.estimated_ms < 0) return -1;
    sum += st.estimated_ms;
    max = std::max(max, st.estimated_ms);
  }
  return max > 0 ? sum / (static_cast<double>(stages_.size()) * max) : -1;
}

std::shared_ptr<Plan> Plan::from_groups(std::shared_ptr<const Model> model,
                                        std::vector<std::vector<Node*>> groups) {
  if (groups.empty()) throw Error(Status::Split, "a plan needs at least one stage");
  auto plan = std::make_shared<Plan>();
  plan->model_ = model;
  const auto& graph = model->graph();
  const Value* self = graph->inputs()[0];

  std::unordered_map<const Node*, int> stage_of;
  for (size_t s = 0; s < groups.size(); ++s) {
    if (groups[s].empty())
      throw Error(Status::Split, "stage " + std::to_string(s) + " would be empty");
    for (const Node* n : groups[s]) stage_of[n] = static_cast<int>(s);
  }

  std::unordered_map<const Value*, size_t> value_id;
  for (size_t s = 0; s < groups.size(); ++s) {
    StagePlan stage;
    stage.nodes = std::move(groups[s]);
    std::vector<const Value*> external;
    UseCollector collect(self, stage_of, static_cast<int>(s), stage.attributes, external);
    for (const Node* n : stage.nodes) collect.visit(n);
    if (s + 1 == groups.size())  // the last stage returns the model's outputs
      for (const Value* v : graph->outputs()) collect.use(v, graph->return_node());

    for (const Value* v : external) {
      auto [it, inserted] = value_id.emplace(v, plan->values_.size());
      if (inserted) {
        CrossingValue cv;
        cv.value = const_cast<Value*>(v);
        if (v->node()->kind() == torch::jit::prim::Param) {
          cv.producer = -1;
          cv.input_index = v->offset() - 1;
          cv.name = model->input_names().at(cv.input_index);
        } else {
          cv.producer = stage_of.at(v->node());
          cv.name = v->debugName();
        }
        plan->values_.push_back(std::move(cv));
      }
      plan->values_[it->second].consumers.push_back(static_cast<int>(s));
      stage.inputs.push_back(it->second);
    }

    std::set<std::string> seen;
    for (const auto& path : stage.attributes) account_attribute(model->module(), path, stage, seen);
    plan->stages_.push_back(std::move(stage));
  }
  for (size_t id = 0; id < plan->values_.size(); ++id)
    if (plan->values_[id].producer >= 0) plan->stages_[plan->values_[id].producer].outputs.push_back(id);
  return plan;
}

std::string Plan::describe_json() const {
  using Json = nlohmann::ordered_json;
  Json stages = Json::array();
  for (size_t s = 0; s < stages_.size(); ++s) {
    const StagePlan& st = stages_[s];
    Json inputs = Json::array();
    for (size_t id : st.inputs) {
      const CrossingValue& cv = values_[id];
      inputs.push_back({{"name", cv.name}, {"from", cv.producer < 0 ? Json("input") : Json(cv.producer)}});
    }
    Json outputs = Json::array();
    for (size_t id : st.outputs) outputs.push_back({{"name", values_[id].name}, {"to", values_[id].consumers}});
    if (s + 1 == stages_.size()) outputs.push_back({{"name", "output"}, {"to", "caller"}});
    stages.push_back({{"index", s},
                      {"parameters", st.parameters},
                      {"buffers", st.buffers},
                      {"param_bytes", st.param_bytes},
                      {"estimated_ms", st.estimated_ms < 0 ? Json(nullptr) : Json(st.estimated_ms)},
                      {"num_nodes", st.nodes.size()},
                      {"inputs", std::move(inputs)},
                      {"outputs", std::move(outputs)}});
  }
  Json boundaries = Json::array();
  for (size_t b = 0; b < boundary_reasons_.size(); ++b)
    boundaries.push_back({{"between", {b, b + 1}}, {"reason", boundary_reasons_[b]}});
  const double bal = balance();
  Json out = {{"num_stages", stages_.size()},
              {"method", method_},
              {"balance", bal < 0 ? Json(nullptr) : Json(bal)},
              {"boundaries", std::move(boundaries)},
              {"stages", std::move(stages)}};
  return out.dump();
}

}  // namespace libpipe::graph
