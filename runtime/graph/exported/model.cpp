#include "runtime/graph/exported/model.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "runtime/error.h"
#include "runtime/graph/exported/inline_regions.h"
#include "runtime/graph/exported/input_check.h"

namespace libpipe::graph::exported {

namespace {

const char* const kSplitMarker = "torch.ops.pipe.split.default";

[[noreturn]] void unsupported(const std::string& path, const std::string& why) {
  throw Error(Status::Unsupported, "'" + path + "': " + why);
}

std::vector<std::string> split_dotted(const std::string& fqn) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (true) {
    const size_t dot = fqn.find('.', begin);
    out.push_back(fqn.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return out;
}

// One entry of a node's nn_module_stack: "L__self__layers.0,layers.0,torch.nn.Sequential".
struct StackEntry {
  std::string path;
  int call = 0;  // "@K" on the key: the K-th call of the same module
  std::string type;
};

// The stack is entries separated by ';', each "key,path,type"; commas inside () or [] (a type
// such as "typing.Dict[str, int]") do not separate.
std::vector<StackEntry> parse_module_stack(const std::string& text) {
  std::vector<StackEntry> out;
  std::vector<std::string> parts;
  std::string current;
  int depth = 0;
  auto finish_entry = [&] {
    parts.push_back(current);
    current.clear();
    if (parts.size() >= 3) {
      StackEntry e;
      const std::string& key = parts[0];
      e.path = parts[1];
      e.type = parts[2];
      const size_t at = key.rfind('@');
      if (at != std::string::npos) e.call = std::atoi(key.c_str() + at + 1);
      const size_t path_at = e.path.rfind('@');
      if (path_at != std::string::npos) e.path.erase(path_at);
      // Nodes export hoists to the top (sym_size of an input) carry a placeholder entry, no module.
      const std::string empty = "_empty_nn_module_stack";
      if (key.compare(0, empty.size(), empty) != 0 && e.path.compare(0, empty.size(), empty) != 0)
        out.push_back(std::move(e));
    }
    parts.clear();
  };
  for (char c : text) {
    if (c == '(' || c == '[') ++depth;
    if (c == ')' || c == ']') --depth;
    if (depth == 0 && c == ',') {
      parts.push_back(current);
      current.clear();
    } else if (depth == 0 && c == ';') {
      finish_entry();
    } else {
      current += c;
    }
  }
  if (!current.empty() || !parts.empty()) finish_entry();
  return out;
}

std::string short_type(const std::string& qualified) {
  const size_t dot = qualified.rfind('.');
  return dot == std::string::npos ? qualified : qualified.substr(dot + 1);
}

// The treespec types a nativert program can return (ModelRunner unflattens only these).
void check_output_spec(const Json& spec, const std::string& path) {
  if (!spec.is_object()) return;
  const Json& type = spec.contains("type") ? spec["type"] : Json();
  if (type.is_string()) {
    const std::string t = type.get<std::string>();
    if (t != "builtins.tuple" && t != "builtins.list" && t != "builtins.dict")
      unsupported(path, "forward returns a " + t +
                            ", which LibTorch's runtime for exported programs cannot return; return a tensor, or a "
                            "tuple, list or dict of tensors (for a Hugging Face model, its .logits), and export again");
  }
  for (const auto& child : spec.value("children_spec", Json::array())) check_output_spec(child, path);
}

// A treespec string as serialized: "[1, {...}]" (protocol version, then the spec).
Json parse_treespec(const std::string& text, const std::string& path, const char* which) {
  try {
    const Json parsed = Json::parse(text);
    if (parsed.is_array() && parsed.size() == 2) return parsed[1];
  } catch (const Json::exception&) {}
  throw Error(Status::InvalidFormat, "'" + path + "': the program's " + std::string(which) + " is not a treespec");
}

bool find_nested_marker(const Json& graph, std::string& found) {
  for (const auto& node : graph.value("nodes", Json::array())) {
    for (const auto& input : node.value("inputs", Json::array())) {
      if (!input.contains("arg") || !input["arg"].is_object() || !input["arg"].contains("as_graph")) continue;
      const Json& sub = input["arg"]["as_graph"];
      if (!sub.contains("graph")) continue;
      for (const auto& inner : sub["graph"].value("nodes", Json::array()))
        if (inner.value("target", std::string()) == kSplitMarker) {
          found = where(inner) + " (inside " + node.value("target", std::string("a subgraph")) + ")";
          return true;
        }
      if (find_nested_marker(sub["graph"], found)) return true;
    }
  }
  return false;
}

// The schema of a torch.ops target, when the operator is registered in this process.
const c10::FunctionSchema* schema_of(const std::string& target) {
  const auto op = operator_name(target);
  if (op.name.empty()) return nullptr;
  const auto handle = c10::Dispatcher::singleton().findSchema(c10::OperatorName(op.name, op.overload));
  return handle ? &handle->schema() : nullptr;
}

const std::unordered_set<c10::Symbol>* alias_sets(const c10::AliasInfo* info) {
  if (!info) return nullptr;
  if (info->beforeSets().empty() && !info->containedTypes().empty()) return &info->containedTypes()[0].beforeSets();
  return &info->beforeSets();
}

}  // namespace

std::vector<std::string> ExportedModel::aliases_of(size_t id) const {
  std::vector<std::string> out;
  const Weight& w = weights_.at(id);
  for (const auto& other : weights_)
    if (other.identity == w.identity && other.fqn != w.fqn) out.push_back(other.fqn);
  return out;
}

namespace {

// The parts of a program that the front-end and the stage builder index without looking (nlohmann's
// const operator[] and an empty object's begin().key() are unchecked): a damaged or hand-written
// program is refused here with a message, never read out of bounds. `what` names the file for it.
void check_structure(const Json& program, const std::string& what) {
  auto refuse = [&](const std::string& why) { throw Error(Status::InvalidFormat, what + " " + why); };
  auto is_object_with = [](const Json& j, const char* key) { return j.is_object() && j.contains(key); };
  if (!is_object_with(program, "graph_module")) refuse("has no graph_module");
  const Json& gm = program["graph_module"];
  if (!is_object_with(gm, "graph") || !gm["graph"].is_object()) refuse("has no graph");
  if (!is_object_with(gm, "signature") || !gm["signature"].is_object()) refuse("has no signature");
  const Json& graph = gm["graph"];
  for (const char* key : {"nodes", "inputs", "outputs"})
    if (!is_object_with(graph, key) || !graph[key].is_array()) refuse(std::string("has no graph ") + key + " list");
  for (const auto& node : graph["nodes"]) {
    if (!node.is_object()) refuse("has a graph node that is not an object: " + node.dump());
    for (const char* key : {"inputs", "outputs"})
      if (node.contains(key) && !node[key].is_array())
        refuse("has a node whose " + std::string(key) + " are not a list: " + node.dump());
    for (const auto& input : node.value("inputs", Json::array()))
      if (!is_object_with(input, "arg") || !input["arg"].is_object())
        refuse("has a node input without an argument: " + node.dump());
  }
  const Json& signature = gm["signature"];
  for (const char* key : {"input_specs", "output_specs"}) {
    if (!signature.contains(key)) continue;
    if (!signature[key].is_array()) refuse(std::string("has ") + key + " that are not a list");
    for (const auto& spec : signature[key])
      if (!spec.is_object() || spec.size() != 1 || !spec.begin().value().is_object())
        refuse("has a signature entry that is not one kind with its fields: " + spec.dump());
  }
  if (gm.contains("module_call_graph") && !gm["module_call_graph"].is_array())
    refuse("has a module_call_graph that is not a list");
}

}  // namespace

const ExportedModel& exported_model(const Plan& plan) {
  const auto* model = dynamic_cast<const ExportedModel*>(&plan.model());
  if (!model)
    throw Error(Status::Internal, "an exported-program stage was asked of a plan made from another format's model");
  return *model;
}

void ExportedModel::check_inputs(const std::vector<c10::IValue>& inputs, const std::string& what) const {
  exported::check_inputs(*this, inputs, what);
}

std::vector<BufferInfo> ExportedModel::buffers() const {
  std::vector<BufferInfo> out;
  for (const auto& w : weights_) {
    if (w.spec_kind != "buffer") continue;
    std::vector<int64_t> sizes;
    for (const auto& d : w.meta.sizes) sizes.push_back(d.size);
    out.push_back({w.fqn, std::move(sizes), w.meta.dtype});
  }
  return out;
}

std::shared_ptr<const ExportedModel> ExportedModel::load(const std::string& path) {
  return from_archive(Pt2Archive::open(path));
}

std::shared_ptr<const ExportedModel> ExportedModel::from_archive(std::shared_ptr<Pt2Archive> archive) {
  auto model = std::make_shared<ExportedModel>();
  const std::string path = archive->name();
  model->path_ = path;
  model->archive_ = std::move(archive);
  const auto& programs = model->archive_->programs();
  if (std::find(programs.begin(), programs.end(), "model") != programs.end()) {
    model->program_name_ = "model";
  } else if (programs.size() == 1) {
    model->program_name_ = programs[0];
  } else if (programs.empty()) {
    throw Error(Status::InvalidFormat, "'" + path +
                                           "' holds no program (a models/<name>.json record at the top of "
                                           "models/); save one with torch.export.save(program, path)");
  } else {
    std::string list;
    for (const auto& p : programs) list += (list.empty() ? "" : ", ") + p;
    throw Error(Status::InvalidFormat, "'" + path + "' holds the programs " + list +
                                           " and none is named 'model'; save the one to run with "
                                           "torch.export.save(program, path)");
  }
  const std::string& name = model->program_name_;
  try {
    model->program_ = Json::parse(model->archive_->read("models/" + name + ".json"));
  } catch (const Json::exception& e) {
    throw Error(Status::InvalidFormat, "'" + path + "': models/" + name + ".json is not valid JSON: " + e.what());
  }
  const Json& program = model->program_;
  const int64_t major = program.value("schema_version", Json::object()).value("major", int64_t{-1});
  if (major != 8)
    throw Error(Status::InvalidFormat, "'" + path + "' was written with torch.export schema " + std::to_string(major) +
                                           "; this libpipe reads schema 8 (PyTorch 2.11): export it with the "
                                           "PyTorch libpipe was built against");
  check_structure(program, "'" + path + "': models/" + name + ".json");
  try {
    // Mode regions (no_grad, a disabled autocast) become plain nodes before anything reads the graph.
    inline_regions(model->program_["graph_module"]["graph"], path);
    model->describe();
  } catch (const Json::exception& e) {  // a field of another JSON type than the schema's
    throw Error(Status::InvalidFormat, "'" + path + "': models/" + name +
                                           ".json is not a torch.export program as written by "
                                           "torch.export.save: " +
                                           e.what());
  }
  return model;
}

void ExportedModel::describe() {
  const Json& gm = program_["graph_module"];
  const Json& graph = gm["graph"];
  const Json& signature = gm["signature"];
  const Json& tensor_values = graph.value("tensor_values", Json::object());

  // The archive's weights and constants configs: tensor name -> record and metadata.
  auto read_config = [&](const std::string& record) {
    if (!archive_->has(record)) return Json::object();
    try {
      return Json::parse(archive_->read(record)).value("config", Json::object());
    } catch (const Json::exception& e) {
      throw Error(Status::InvalidFormat, "'" + path_ + "': " + record + " is not valid JSON: " + e.what());
    }
  };
  const Json weights_config = read_config("data/weights/" + program_name_ + "_weights_config.json");
  const Json constants_config = read_config("data/constants/" + program_name_ + "_constants_config.json");

  // Inputs: placeholders of weights, then the caller's tensors.
  std::unordered_map<std::string, size_t> weight_of;  // placeholder -> attribute id
  std::unordered_map<std::string, size_t> value_of;   // tensor name -> value id
  for (const auto& spec : signature.value("input_specs", Json::array())) {
    const std::string kind = spec.begin().key();
    const Json& body = spec.begin().value();
    if (kind == "user_input") {
      const Json& arg = body.value("arg", Json::object());
      if (!arg.contains("as_tensor"))
        unsupported(path_, "forward takes an argument that is not a tensor (" + arg.dump() +
                               "); LibTorch's runtime for exported programs takes tensors only: pass it as a "
                               "tensor, or make it a constant of the model");
      const std::string input = arg["as_tensor"].value("name", std::string());
      value_of[input] = values_.size();
      values_.push_back({input, static_cast<int>(input_names_.size()), 0});
      input_names_.push_back(input);
      if (!tensor_values.contains(input))
        throw Error(Status::InvalidFormat, "'" + path_ + "': input '" + input + "' has no tensor_values entry");
      input_metas_.push_back(tensor_meta(tensor_values[input], "input '" + input + "'"));
    } else if (kind == "parameter" || kind == "buffer" || kind == "tensor_constant") {
      Weight w;
      w.spec = spec;
      w.spec_kind = kind;
      w.placeholder = body.value("arg", Json::object()).value("name", std::string());
      w.fqn = body.value(kind == "parameter" ? "parameter_name"
                         : kind == "buffer"  ? "buffer_name"
                                             : "tensor_constant_name",
                         std::string());
      if (weights_config.contains(w.fqn)) {
        w.config = weights_config[w.fqn];
      } else if (constants_config.contains(w.fqn)) {
        w.config = constants_config[w.fqn];
        w.in_constants = true;
      } else {
        throw Error(Status::InvalidFormat,
                    "'" + path_ + "': " + kind + " '" + w.fqn + "' is in neither the weights nor the constants config");
      }
      w.meta = tensor_meta(w.config.value("tensor_meta", Json::object()), kind + " '" + w.fqn + "'");
      const Json& tm = w.config.value("tensor_meta", Json::object());
      w.record = (w.in_constants ? "data/constants/" : "data/weights/") + w.config.value("path_name", std::string());
      w.identity = w.record + "@" + tm.value("storage_offset", Json::object()).dump() +
                   tm.value("sizes", Json::array()).dump() + tm.value("strides", Json::array()).dump();
      weight_of[w.placeholder] = weights_.size();
      AttributeRead read;
      read.path = split_dotted(w.fqn);
      read.tensor_bytes = w.meta.nbytes;
      if (kind != "tensor_constant") read.tensors.push_back({w.fqn, w.meta.nbytes, kind == "parameter"});
      attributes_.push_back(std::move(read));
      if (parameter_without_data_.empty() && kind == "parameter" && w.meta.nbytes > 0 &&
          (!archive_->has(w.record) || archive_->size(w.record) == 0))
        parameter_without_data_ = w.fqn;
      weights_.push_back(std::move(w));
    } else {
      unsupported(path_, "the program has an input of kind " + kind +
                             " (a TorchBind object, an effect token or a non-tensor constant argument), which "
                             "libpipe cannot hand to a stage; export a model whose inputs are tensors, parameters "
                             "and buffers");
    }
  }
  for (const auto& spec : signature.value("output_specs", Json::array())) {
    const std::string kind = spec.begin().key();
    if (kind == "user_output") continue;
    const Json& body = spec.begin().value();
    if (kind == "buffer_mutation")
      unsupported(path_, "the program writes buffer '" + body.value("buffer_name", std::string()) +
                             "' through a mutation output (it was functionalized, e.g. by run_decompositions()), "
                             "which LibTorch's runtime for exported programs drops silently; export the model "
                             "without run_decompositions() (libpipe.export_program does), so the write stays in "
                             "place");
    if (kind == "user_input_mutation")
      unsupported(path_, "forward writes its input '" + body.value("user_input_name", std::string()) +
                             "' in place; libpipe hands stages inputs it may not write: compute a new tensor "
                             "instead");
    unsupported(path_, "the program has an output of kind " + kind + ", which an inference program does not have");
  }
  const Json& calls = gm.value("module_call_graph", Json::array());
  if (calls.empty() || calls[0].value("fqn", std::string("?")) != "" || !calls[0].contains("signature") ||
      calls[0]["signature"].is_null())
    throw Error(Status::InvalidFormat, "'" + path_ + "': the program's module_call_graph has no root signature");
  check_output_spec(parse_treespec(calls[0]["signature"].value("out_spec", std::string()), path_, "out_spec"), path_);
  for (const auto& out : graph.value("outputs", Json::array()))
    if (!out.contains("as_tensor"))
      unsupported(path_, "forward returns a value that is not a tensor (" + out.dump() +
                             "); return tensors only (wrap numbers in tensors)");

  const Json constraints = program_.value("range_constraints", Json::object());
  for (const auto& [symbol, range] : constraints.items()) {
    const Json& lo = range.contains("min_val") ? range["min_val"] : Json();
    const Json& hi = range.contains("max_val") ? range["max_val"] : Json();
    ranges_[symbol] = {lo.is_number_integer() ? lo.get<int64_t>() : 0, hi.is_number_integer() ? hi.get<int64_t>() : -1};
  }

  // The module tree: every module the program records, in its order; types from the nodes' stacks.
  std::map<std::string, std::string> type_of;
  const Json& nodes = graph.value("nodes", Json::array());
  std::vector<std::vector<StackEntry>> stacks;
  for (const auto& node : nodes) {
    const Json& metadata =
        node.contains("metadata") && node["metadata"].is_object() ? node["metadata"] : Json::object();
    stacks.push_back(parse_module_stack(metadata.value("nn_module_stack", std::string())));
    for (const auto& e : stacks.back()) type_of.emplace(e.path, e.type);
  }
  for (const auto& call : calls) {
    ModuleInfo info;
    info.path = call.value("fqn", std::string());
    info.depth = info.path.empty() ? 0 : static_cast<int>(std::count(info.path.begin(), info.path.end(), '.')) + 1;
    auto it = type_of.find(info.path);
    info.class_name = it == type_of.end() ? "?" : it->second;
    info.type = short_type(info.class_name);
    std::set<std::string> counted;  // a tensor under several names counts once
    for (const auto& w : weights_)
      if (w.spec_kind == "parameter" &&
          (info.path.empty() || w.fqn.compare(0, info.path.size() + 1, info.path + ".") == 0) &&
          counted.insert(w.identity).second) {
        uint64_t numel = 1;
        for (const auto& d : w.meta.sizes) numel *= static_cast<uint64_t>(std::max<int64_t>(d.size, 0));
        info.num_params += numel;
        info.param_bytes += w.meta.nbytes;
      }
    modules_.push_back(std::move(info));
  }

  // The nodes. A symbol's dependencies: the tensors and weights it is computed from, and the
  // symbol-only nodes that compute it (graph order).
  struct SymbolDeps {
    std::set<size_t> values, attributes, nodes;
  };
  std::unordered_map<std::string, SymbolDeps> symbol;
  std::map<std::pair<std::string, int>, int> site_index;
  std::unordered_map<std::string, std::pair<size_t, size_t>> producer;  // tensor -> (json node, output)
  std::vector<int> program_node_of(nodes.size(), -1);

  // What reading `name` costs the node `pn`: a value, a weight, or a symbol's own dependencies.
  auto reader = [&](ProgramNode& pn, std::set<size_t>& needed) {
    return [&symbol, &weight_of, &value_of, &pn, &needed](const std::string& name, RefKind kind) {
      auto add_attribute = [&](size_t a) {
        if (std::find(pn.attributes.begin(), pn.attributes.end(), a) == pn.attributes.end()) pn.attributes.push_back(a);
      };
      auto add_value = [&](size_t v) {
        if (std::find(pn.reads.begin(), pn.reads.end(), v) == pn.reads.end()) pn.reads.push_back(v);
      };
      if (kind == RefKind::Symbol) {
        auto it = symbol.find(name);
        if (it != symbol.end()) {
          for (size_t v : it->second.values) add_value(v);
          for (size_t a : it->second.attributes) add_attribute(a);
          needed.insert(it->second.nodes.begin(), it->second.nodes.end());
          return;
        }
      }
      if (auto w = weight_of.find(name); w != weight_of.end()) return add_attribute(w->second);
      if (auto v = value_of.find(name); v != value_of.end()) return add_value(v->second);
    };
  };

  for (size_t i = 0; i < nodes.size(); ++i) {
    const Json& node = nodes[i];
    const std::string target = node.value("target", std::string());
    bool all_symbols = true, any_output = false;
    for_each_output_ref(node, [&](const std::string&, RefKind kind) {
      any_output = true;
      all_symbols &= kind == RefKind::Symbol;
    });
    if (target != kSplitMarker && any_output && all_symbols) {
      // Computes sizes only: recreated wherever a symbol it defines is read.
      ProgramNode scratch;
      std::set<size_t> needed;
      for_each_input_ref(node, reader(scratch, needed));
      SymbolDeps deps;
      deps.values.insert(scratch.reads.begin(), scratch.reads.end());
      deps.attributes.insert(scratch.attributes.begin(), scratch.attributes.end());
      deps.nodes = std::move(needed);
      deps.nodes.insert(i);
      for_each_output_ref(node, [&](const std::string& name, RefKind) { symbol[name] = deps; });
      continue;
    }
    ProgramNode pn;
    pn.where = where(node);
    std::set<size_t> needed;
    if (target == kSplitMarker) {
      pn.role = NodeRole::SplitMarker;
    } else {
      for_each_input_ref(node, reader(pn, needed));
      for_each_input_ref(node, [&](const std::string& name, RefKind kind) {
        if (kind == RefKind::CustomObj && pn.unsupported.empty())
          pn.unsupported = "node " + target + " at " + pn.where + " uses the TorchBind object '" + name +
                           "', which libpipe cannot place in a stage";
      });
    }
    for (const auto& e : stacks[i]) {
      if (e.path.empty()) continue;  // the root module
      auto [it, inserted] = site_index.emplace(std::make_pair(e.path, e.call), static_cast<int>(call_sites_.size()));
      if (inserted) call_sites_.push_back({e.path, e.call});
      pn.sites.push_back(it->second);
    }
    const size_t id = nodes_.size();
    size_t position = 0;
    for (const auto& output : node.value("outputs", Json::array())) {
      for_each_ref(output, [&](const std::string& name, RefKind kind) {
        if (kind == RefKind::CustomObj) return;
        value_of[name] = values_.size();
        values_.push_back({name, -1, id});
        producer[name] = {i, position};
      });
      ++position;
    }
    program_node_of[i] = static_cast<int>(id);
    json_node_.push_back(i);
    symbol_nodes_.emplace_back(needed.begin(), needed.end());
    nodes_.push_back(std::move(pn));
  }
  {
    std::set<size_t> needed;
    auto use = reader(returns_, needed);
    for (const auto& out : graph.value("outputs", Json::array())) for_each_ref(out, use);
    symbol_nodes_.emplace_back(needed.begin(), needed.end());
    returns_.where = "the return of forward";
  }
  find_nested_marker(graph, nested_marker_);

  // Writes in place into a weight, directly or through a view of it (the schema's alias sets say
  // which result views which argument): such a weight is state, kept in one stage by the plan.
  auto viewed_weight = [&](std::string name) -> int {
    for (int hops = 0; hops < 256; ++hops) {
      if (auto w = weight_of.find(name); w != weight_of.end()) return static_cast<int>(w->second);
      auto p = producer.find(name);
      if (p == producer.end()) return -1;
      const Json& node = nodes[p->second.first];
      const auto* schema = schema_of(node.value("target", std::string()));
      if (!schema || p->second.second >= schema->returns().size()) return -1;
      const auto* result = alias_sets(schema->returns()[p->second.second].alias_info());
      if (!result || result->empty()) return -1;
      std::string from;
      for (const auto& argument : schema->arguments()) {
        const auto* sets = alias_sets(argument.alias_info());
        if (!sets) continue;
        bool shares = false;
        for (const auto& s : *sets) shares |= result->count(s) > 0;
        if (!shares) continue;
        for (const auto& input : node.value("inputs", Json::array()))
          if (input.value("name", std::string()) == argument.name())
            for_each_ref(input.value("arg", Json::object()), [&](const std::string& n, RefKind k) {
              if (k == RefKind::Tensor && from.empty()) from = n;
            });
      }
      if (from.empty()) return -1;
      name = from;
    }
    return -1;
  };
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (program_node_of[i] < 0) continue;
    const Json& node = nodes[i];
    const auto* schema = schema_of(node.value("target", std::string()));
    if (!schema) continue;
    for (const auto& argument : schema->arguments()) {
      if (!argument.alias_info() || !argument.alias_info()->isWrite()) continue;
      for (const auto& input : node.value("inputs", Json::array())) {
        if (input.value("name", std::string()) != argument.name()) continue;
        for_each_ref(input.value("arg", Json::object()), [&](const std::string& n, RefKind k) {
          if (k != RefKind::Tensor) return;
          const int w = viewed_weight(n);
          if (w < 0) return;
          AttributeRead& a = attributes_[static_cast<size_t>(w)];
          const size_t writer = static_cast<size_t>(program_node_of[i]);
          if (std::find(a.writers.begin(), a.writers.end(), writer) == a.writers.end()) a.writers.push_back(writer);
          if (a.written_by.empty()) a.written_by = schema->name() + " at " + where(node);
        });
      }
    }
  }
}

}  // namespace libpipe::graph::exported
