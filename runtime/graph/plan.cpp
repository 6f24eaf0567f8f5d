#include "runtime/graph/plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

#include "runtime/error.h"

namespace libpipe::graph {

namespace {

bool is_prefix(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
}

std::string join(const std::vector<std::string>& path) {
  std::string out;
  for (const auto& p : path) out += (out.empty() ? "" : ".") + p;
  return out;
}

// A tensor the model updates in place (a KV cache) is state, and state must live in one stage:
// each stage holds its own copy of every tensor it reads, so a write in one stage would never
// reach another stage that reads or writes the same tensor. Throws Error(Split) naming the tensor
// and the stages.
void check_state_in_one_stage(const Program& model, const std::vector<StagePlan>& stages,
                              const std::vector<int>& stage_of) {
  const auto& attributes = model.attributes();
  for (const AttributeRead& state : attributes) {
    if (state.writers.empty()) continue;
    std::set<size_t> users;
    for (size_t w : state.writers)
      if (stage_of.at(w) >= 0) users.insert(static_cast<size_t>(stage_of.at(w)));
    // Readers of the tensor itself, or of a module that holds it.
    for (size_t s = 0; s < stages.size(); ++s)
      for (size_t a : stages[s].attributes)
        if (is_prefix(attributes[a].path, state.path) || is_prefix(state.path, attributes[a].path)) users.insert(s);
    if (users.size() < 2) continue;
    std::string list;
    size_t k = 0;
    for (size_t s : users) list += (k++ == 0 ? "" : k == users.size() ? " and " : ", ") + std::to_string(s);
    const std::string name = join(state.path);
    throw Error(Status::Split, "'" + name + "' is updated in place (" + state.written_by + ") and used by stages " +
                                   list +
                                   "; a tensor written in place must belong to one stage (each stage holds its own "
                                   "copy, so the others would never see the writes). Move the split point so that "
                                   "every use of '" +
                                   name +
                                   "' falls in one stage (cut before or after the module "
                                   "that owns it).");
  }
}

}  // namespace

std::shared_ptr<Plan> Plan::from_markers(std::shared_ptr<const Program> model) {
  if (!model->nested_marker().empty())
    throw Error(Status::Split, "pipe::split() at " + model->nested_marker() +
                                   " is inside an if/loop block; only forward's top level can be cut. Move "
                                   "the marker out of the block (before or after it).");
  std::vector<std::vector<size_t>> groups(1);
  std::vector<std::string> markers;
  std::vector<std::string> reasons;
  for (size_t id = 0; id < model->nodes().size(); ++id) {
    const ProgramNode& node = model->nodes()[id];
    if (node.role == NodeRole::SplitMarker) {
      markers.push_back(node.where);
      reasons.push_back("pipe::split() at " + node.where);
      groups.emplace_back();
    } else {
      groups.back().push_back(id);
    }
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!groups[i].empty()) continue;
    std::string between = i == 0                ? "the start of forward and the marker at " + markers[0]
                          : i == markers.size() ? "the marker at " + markers[i - 1] + " and the end of forward"
                                                : "the markers at " + markers[i - 1] + " and " + markers[i];
    throw Error(Status::Split, "stage " + std::to_string(i) + " would be empty: there is no computation between " +
                                   between + ". Remove the redundant pipe::split() call.");
  }
  auto plan = from_groups(std::move(model), std::move(groups));
  plan->describe_origin("pipe::split() markers", std::move(reasons));
  return plan;
}

std::shared_ptr<Plan> Plan::from_cuts(std::shared_ptr<const Program> model, const std::vector<size_t>& sequence,
                                      const std::vector<size_t>& cuts) {
  std::vector<std::vector<size_t>> groups(1);
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

std::shared_ptr<Plan> Plan::from_groups(std::shared_ptr<const Program> model, std::vector<std::vector<size_t>> groups) {
  if (groups.empty()) throw Error(Status::Split, "a plan needs at least one stage");
  auto plan = std::make_shared<Plan>();
  plan->model_ = model;
  const auto& nodes = model->nodes();
  const auto& program_values = model->values();

  std::vector<int> stage_of(nodes.size(), -1);
  for (size_t s = 0; s < groups.size(); ++s) {
    if (groups[s].empty()) throw Error(Status::Split, "stage " + std::to_string(s) + " would be empty");
    for (size_t n : groups[s]) stage_of.at(n) = static_cast<int>(s);
  }

  std::vector<size_t> crossing_id(program_values.size(), SIZE_MAX);
  for (size_t s = 0; s < groups.size(); ++s) {
    StagePlan stage;
    stage.nodes = std::move(groups[s]);
    std::vector<size_t> external;
    // Everything the stage's nodes read from outside the stage: forward inputs and values that
    // earlier stages define; and every attribute they read.
    auto collect = [&](const ProgramNode& node) {
      if (!node.unsupported.empty()) throw Error(Status::Unsupported, node.unsupported);
      for (size_t a : node.attributes)
        if (std::find(stage.attributes.begin(), stage.attributes.end(), a) == stage.attributes.end())
          stage.attributes.push_back(a);
      for (size_t v : node.reads) {
        const ProgramValue& pv = program_values[v];
        if (pv.input_index < 0 && stage_of.at(pv.node) == static_cast<int>(s)) continue;
        if (std::find(external.begin(), external.end(), v) == external.end()) external.push_back(v);
      }
    };
    for (size_t n : stage.nodes) collect(nodes[n]);
    if (s + 1 == groups.size()) collect(model->returns());  // the last stage returns the model's outputs

    for (size_t v : external) {
      if (crossing_id[v] == SIZE_MAX) {
        crossing_id[v] = plan->values_.size();
        const ProgramValue& pv = program_values[v];
        CrossingValue cv;
        cv.value = v;
        cv.name = pv.name;
        if (pv.input_index >= 0) {
          cv.producer = -1;
          cv.input_index = static_cast<size_t>(pv.input_index);
        } else {
          cv.producer = stage_of.at(pv.node);
        }
        plan->values_.push_back(std::move(cv));
      }
      plan->values_[crossing_id[v]].consumers.push_back(static_cast<int>(s));
      stage.inputs.push_back(crossing_id[v]);
    }

    std::set<std::string> seen;
    for (size_t a : stage.attributes)
      for (const TensorEntry& t : model->attributes()[a].tensors) {
        if (!seen.insert(t.name).second) continue;
        (t.is_parameter ? stage.parameters : stage.buffers).push_back(t.name);
        stage.param_bytes += t.bytes;
      }
    plan->stages_.push_back(std::move(stage));
  }
  for (size_t id = 0; id < plan->values_.size(); ++id)
    if (plan->values_[id].producer >= 0) plan->stages_[plan->values_[id].producer].outputs.push_back(id);
  check_state_in_one_stage(*model, plan->stages_, stage_of);
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
