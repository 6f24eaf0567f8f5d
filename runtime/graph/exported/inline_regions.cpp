#include "runtime/graph/exported/inline_regions.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <map>
#include <optional>
#include <set>
#include <utility>

#include "runtime/error.h"

namespace libpipe::graph::exported {

namespace {

const std::string kHigherOrder = "torch.ops.higher_order.";
// What nativert's HigherOrderKernel runs.
const std::set<std::string> kRunnable = {"cond", "while_loop", "run_const_graph"};
// The tables of a serialized Graph that describe its values, by name.
const char* const kValueTables[] = {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values",
                                    "custom_obj_values"};

// The single name an argument refers to, "" when it is a literal or names several.
std::string single_ref(const Json& argument) {
  std::string name;
  int refs = 0;
  for_each_ref(argument, [&](const std::string& n, RefKind) {
    name = n;
    ++refs;
  });
  return refs == 1 ? name : "";
}

// Where a region came from: its call's line of model code, else (a call torch.export recorded without a
// stack trace) its first node's.
std::string region_where(const Json& node) {
  const std::string at = where(node);
  if (at.find(".py:") != std::string::npos) return at;
  for (const auto& input : node.value("inputs", Json::array())) {
    const Json& arg = input.value("arg", Json::object());
    if (!arg.contains("as_graph") || !arg["as_graph"].is_object()) continue;
    for (const auto& inner : arg["as_graph"].value("graph", Json::object()).value("nodes", Json::array()))
      if (inner.is_object()) return where(inner);
  }
  return at;
}

struct Region {
  size_t graph_input = 0;  // the index of the subgraph among the node's inputs; its operands follow
  bool inline_it = false;
  // An autocast region that is on: the dispatch key of its device's autocast kernels (AutocastCPU for
  // "cpu"), whose operators get their inputs cast as autocast casts them.
  std::optional<c10::DispatchKey> autocast;
};

// What to do with a node whose target is a higher-order operator; throws for one nativert cannot run.
Region classify(const Json& node, const std::string& op, const std::string& path, bool inside_autocast) {
  Region r;
  const Json& inputs = node.at("inputs");
  for (; r.graph_input < inputs.size(); ++r.graph_input)
    if (inputs[r.graph_input].at("arg").contains("as_graph")) break;
  const std::string at = region_where(node);
  if (op == "wrap_with_set_grad_enabled") {
    r.inline_it = true;
  } else if (op == "wrap_with_autocast") {
    // (device_type, dtype, enabled, cache_enabled, subgraph, operands...)
    const bool enabled = inputs.size() > 2 && inputs[2].at("arg").value("as_bool", true);
    if (enabled) {
      const std::string device = inputs.empty() ? "" : inputs[0].at("arg").value("as_string", std::string());
      if (device == "cpu") r.autocast = c10::DispatchKey::AutocastCPU;
      else if (device == "cuda") r.autocast = c10::DispatchKey::AutocastCUDA;
      else
        throw Error(Status::Unsupported, "'" + path + "': the program has an autocast region for device type '" +
                                             device + "' (" + at +
                                             "), which libpipe cannot apply (it applies cpu's and cuda's); export "
                                             "the model in the dtype it should run in, without torch.autocast");
    } else if (inside_autocast) {
      // Its operators would have to be kept from the casts of the region around it, which are made explicit
      // after it is inlined.
      throw Error(Status::Unsupported, "'" + path + "': the program turns autocast off (" + at +
                                           ") inside an autocast region that is on, which libpipe cannot apply; "
                                           "export the model in the dtypes it should run in, without torch.autocast");
    }
    r.inline_it = true;
  } else if (!kRunnable.count(op)) {
    throw Error(Status::Unsupported, "'" + path + "': the program calls the higher-order operator " + op + " (" + at +
                                         "), which LibTorch's runtime for exported programs cannot run (it runs " +
                                         "cond, while_loop and run_const_graph); export the model without it");
  }
  if (r.inline_it && r.graph_input >= inputs.size())
    throw Error(Status::InvalidFormat, "'" + path + "': the " + op + " region at " + at + " has no subgraph");
  return r;
}

class Inliner {
 public:
  Inliner(Json& graph, std::string path, bool inside_autocast)
      : graph_(graph), path_(std::move(path)), inside_autocast_(inside_autocast) {
    for (const char* table : kValueTables)
      if (graph_.contains(table) && graph_[table].is_object())
        for (const auto& [name, value] : graph_[table].items()) taken_.insert(name);
    for (const auto& input : graph_.value("inputs", Json::array()))
      for_each_ref(input, [&](const std::string& n, RefKind) { taken_.insert(n); });
    for (const auto& node : graph_.value("nodes", Json::array()))
      for_each_output_ref(node, [&](const std::string& n, RefKind) { taken_.insert(n); });
  }

  void run() {
    if (!graph_.contains("nodes")) return;
    Json nodes = Json::array();
    for (auto& node : graph_["nodes"]) {
      const std::string target = node.value("target", std::string());
      if (target.compare(0, kHigherOrder.size(), kHigherOrder) != 0) {
        nodes.push_back(std::move(node));
        continue;
      }
      const Region region = classify(node, target.substr(kHigherOrder.size()), path_, inside_autocast_);
      // Regions nested in this one's subgraphs first (a disabled autocast inside a no_grad method).
      for (auto& input : node["inputs"])
        if (input.at("arg").contains("as_graph") && input["arg"]["as_graph"].value("graph", Json()).is_object())
          Inliner(input["arg"]["as_graph"]["graph"], path_, inside_autocast_ || region.autocast.has_value()).run();
      if (region.inline_it) inline_region(node, region, nodes);
      else nodes.push_back(std::move(node));
    }
    graph_["nodes"] = std::move(nodes);
  }

 private:
  std::string fresh(const std::string& base) {
    std::string name = base;
    for (int i = 1; taken_.count(name); ++i) name = base + "_" + std::to_string(i);
    taken_.insert(name);
    return name;
  }

  // Appends the region's subgraph to `nodes`, its inputs read as the call's operands and its results
  // written as the call's outputs.
  void inline_region(Json& call, const Region& region, Json& nodes) {
    const std::string what =
        "'" + path_ + "': the " + call.value("target", std::string()) + " region at " + region_where(call);
    Json sub = std::move(call["inputs"][region.graph_input]["arg"]["as_graph"]["graph"]);
    const Json& inputs = call["inputs"];
    const Json& params = sub.value("inputs", Json::array());
    if (inputs.size() - region.graph_input - 1 != params.size())
      throw Error(Status::InvalidFormat, what + " passes " + std::to_string(inputs.size() - region.graph_input - 1) +
                                             " operands to a subgraph of " + std::to_string(params.size()) + " inputs");
    std::map<std::string, std::string> renamed;  // inner name -> outer name
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string inner = single_ref(params[i]);
      const std::string outer = single_ref(inputs[region.graph_input + 1 + i].at("arg"));
      if (inner.empty() || outer.empty())
        throw Error(Status::Unsupported, what + " passes operand " + std::to_string(i) +
                                             " as a constant, which libpipe cannot inline; export under "
                                             "torch.no_grad()");
      renamed[inner] = outer;
    }
    // The region's results take the call's output names, so that later nodes and the graph's outputs read
    // them unchanged. A result that is an input of the region, or one returned twice, gets an alias node.
    const Json& results = sub.value("outputs", Json::array());
    const Json& outputs = call.value("outputs", Json::array());
    if (results.size() != outputs.size())
      throw Error(Status::InvalidFormat, what + " has " + std::to_string(outputs.size()) +
                                             " outputs but its subgraph returns " + std::to_string(results.size()));
    std::set<std::string> defined_inside;
    for (const auto& node : sub.value("nodes", Json::array()))
      for_each_output_ref(node, [&](const std::string& n, RefKind) { defined_inside.insert(n); });
    std::vector<std::pair<std::string, std::string>> aliases;  // (outer output, inner result)
    for (size_t i = 0; i < results.size(); ++i) {
      const std::string inner = single_ref(results[i]);
      const std::string outer = single_ref(outputs[i]);
      if (inner.empty() || outer.empty())
        throw Error(Status::Unsupported, what + " returns something other than single values (result " +
                                             std::to_string(i) + "); export under torch.no_grad()");
      if (defined_inside.count(inner) && !renamed.count(inner)) renamed[inner] = outer;
      else aliases.emplace_back(outer, inner);
    }
    // Every other value of the region gets a name of its own in this graph.
    for (const auto& name : defined_inside)
      if (!renamed.count(name)) renamed[name] = fresh(name);
    auto rename = [&](std::string& name, RefKind) {
      if (auto it = renamed.find(name); it != renamed.end()) name = it->second;
    };
    Json inlined = Json::array();
    for (auto& node : sub["nodes"]) {
      for (auto& input : node["inputs"])
        if (input.contains("arg")) rename_refs(input["arg"], rename);
      for (auto& output : node["outputs"]) rename_refs(output, rename);
      inlined.push_back(std::move(node));
    }
    // The region's values join this graph's tables; the call's outputs keep the entries they have.
    for (const char* table : kValueTables) {
      if (!sub.contains(table) || !sub[table].is_object()) continue;
      if (!graph_.contains(table)) graph_[table] = Json::object();
      for (auto& [name, value] : sub[table].items()) {
        const auto it = renamed.find(name);
        if (it == renamed.end() || !defined_inside.count(name) || graph_[table].contains(it->second)) continue;
        graph_[table][it->second] = std::move(value);
      }
    }
    // Casts are shared within the region only, and never across a write in place (an operator named with a
    // trailing underscore, copy_ or index_put_ into a cache), which would leave a cast of the old value.
    std::map<std::pair<std::string, int64_t>, std::string> casts;
    for (auto& node : inlined) {
      if (region.autocast) cast_as_autocast(node, *region.autocast, casts, nodes);
      const std::string name = operator_name(node.value("target", std::string())).name;
      if (!name.empty() && name.back() == '_') casts.clear();
      nodes.push_back(std::move(node));
    }
    for (const auto& [outer, inner] : aliases) {
      const auto it = renamed.find(inner);
      const std::string source = it == renamed.end() ? inner : it->second;
      if (!graph_.value("tensor_values", Json::object()).contains(source))
        throw Error(Status::Unsupported, what + " returns the value " + inner +
                                             ", which is not a tensor made inside it; export under torch.no_grad()");
      Json input = {{"name", "self"}, {"arg", {{"as_tensor", {{"name", source}}}}}, {"kind", 1}};  // positional
      nodes.push_back({{"target", "torch.ops.aten.alias.default"},
                       {"inputs", Json::array({input})},
                       {"outputs", Json::array({Json{{"as_tensor", {{"name", outer}}}}})},
                       {"metadata", call.value("metadata", Json::object())}});
    }
  }

  // Autocast, applied where the region runs without it: an operator that has a kernel for `key` (autocast's
  // lists for that device: lower precision, float32, promote) computes in the dtype its result was recorded in
  // when the program was exported under autocast, so each floating input of another dtype (float64 excepted,
  // as autocast leaves it) is cast to that dtype first, by a node inserted before it. Operators autocast leaves
  // alone run as recorded. LibTorch's own dispatcher says which operators autocast handles, so the lists are
  // PyTorch's, not a copy.
  void cast_as_autocast(Json& node, c10::DispatchKey key, std::map<std::pair<std::string, int64_t>, std::string>& casts,
                        Json& nodes) {
    const OperatorName op = operator_name(node.value("target", std::string()));
    if (op.name.empty()) return;
    const auto handle = c10::Dispatcher::singleton().findOp({op.name, op.overload});
    if (!handle || !handle->hasKernelForDispatchKey(key)) return;
    Json& tensors = graph_["tensor_values"];
    std::optional<int64_t> dtype;  // the first result's, when it is a tensor
    for_each_output_ref(node, [&](const std::string& name, RefKind kind) {
      if (dtype || kind != RefKind::Tensor || !tensors.contains(name)) return;
      dtype = tensors[name].value("dtype", int64_t{-1});
    });
    if (!dtype) return;
    const auto target = scalar_type_of(*dtype);
    if (!target || !at::isFloatingType(*target)) return;
    for (auto& input : node["inputs"]) {
      if (!input.contains("arg")) continue;
      rename_refs(input["arg"], [&](std::string& name, RefKind kind) {
        if (kind != RefKind::Tensor || !tensors.contains(name)) return;
        const auto from = scalar_type_of(tensors[name].value("dtype", int64_t{-1}));
        if (!from || !at::isFloatingType(*from) || *from == at::kDouble || *from == *target) return;
        const auto key_of_cast = std::make_pair(name, *dtype);
        auto it = casts.find(key_of_cast);
        if (it == casts.end()) {
          const std::string cast = fresh(name + "_autocast");
          Json meta = tensors[name];
          meta["dtype"] = *dtype;
          tensors[cast] = std::move(meta);
          Json self = {{"name", "self"}, {"arg", {{"as_tensor", {{"name", name}}}}}, {"kind", 1}};
          Json to = {{"name", "dtype"}, {"arg", {{"as_scalar_type", *dtype}}}, {"kind", 1}};
          nodes.push_back({{"target", "torch.ops.aten.to.dtype"},
                           {"inputs", Json::array({self, to})},
                           {"outputs", Json::array({Json{{"as_tensor", {{"name", cast}}}}})},
                           {"metadata", node.value("metadata", Json::object())}});
          it = casts.emplace(key_of_cast, cast).first;
        }
        name = it->second;
      });
    }
  }

  Json& graph_;
  std::string path_;
  const bool inside_autocast_;   // this graph is the body of an autocast region that is on
  std::set<std::string> taken_;  // every value name of this graph, the inlined ones included
};

}  // namespace

void inline_regions(Json& graph, const std::string& path) {
  if (!graph.is_object()) return;
  Inliner(graph, path, /*inside_autocast=*/false).run();
}

}  // namespace libpipe::graph::exported
