#include "runtime/stage/exported/exported_stage.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <torch/nativert/ModelRunnerHandle.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "runtime/error.h"
#include "runtime/graph/exported/archive.h"
#include "runtime/libtorch_log.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage_format.h"

namespace libpipe::stage {

namespace {

using graph::exported::ExportedModel;
using graph::exported::Json;
using graph::exported::Pt2Writer;
using graph::exported::RefKind;
using graph::exported::Weight;

Json leaf_spec() { return {{"type", nullptr}, {"context", nullptr}, {"children_spec", Json::array()}}; }

Json tuple_spec(Json children) {
  return {{"type", "builtins.tuple"}, {"context", "null"}, {"children_spec", std::move(children)}};
}

// A treespec as the schema stores it: "[1, <spec>]" (the pytree protocol version first).
std::string treespec_text(const Json& spec) { return "[1, " + spec.dump() + "]"; }

Json device_json(const c10::Device& device) {
  return {{"type", device.is_cpu() ? "cpu" : c10::DeviceTypeName(device.type(), true)},
          {"index", device.has_index() ? Json(device.index()) : Json(nullptr)}};
}

// Points every device the program records (tensor metadata, device arguments of operators such as
// arange or to) at the stage's device: a program exported on one machine runs its stages where the
// session places them.
void place_devices(Json& value, const Json& device) {
  if (value.is_object()) {
    for (auto& [key, inner] : value.items()) {
      if ((key == "device" || key == "as_device") && inner.is_object() && inner.contains("type")) {
        inner = device;
        continue;
      }
      place_devices(inner, device);  // nested values, subgraphs (as_graph) included
    }
  } else if (value.is_array()) {
    for (auto& inner : value) place_devices(inner, device);
  }
}

// The dtype most of the program's floating weights have: what it was exported in.
std::optional<at::ScalarType> weights_dtype(const ExportedModel& model) {
  std::map<at::ScalarType, uint64_t> bytes;
  for (const auto& w : model.weights())
    if (at::isFloatingType(w.meta.dtype)) bytes[w.meta.dtype] += std::max<uint64_t>(w.meta.nbytes, 1);
  std::optional<at::ScalarType> best;
  uint64_t most = 0;
  for (const auto& [dtype, n] : bytes)
    if (n > most) {
      most = n;
      best = dtype;
    }
  return best;
}

void check_dtype(const ExportedModel& model, const StageOptions& options) {
  if (!options.dtype) return;
  const auto have = weights_dtype(model);
  if (!have || *have == *options.dtype) return;
  throw Error(Status::Unsupported,
              "'" + model.path() + "' is a torch.export program in " + c10::toString(*have) +
                  ": an exported program fixes its dtypes when it is exported (every cast and dtype argument is "
                  "written into it), so libpipe cannot run it in " +
                  c10::toString(*options.dtype) + ". Export the model in that dtype instead (model.to(torch." +
                  graph::exported::python_dtype(*options.dtype) +
                  ") before libpipe.export_program), or leave the dtype unset");
}

// The tensor `meta` describes inside the storage record `bytes`: sizes, strides and offset as
// recorded (torch.export.save writes a whole storage per record, slices of it at their offsets).
// The metadata comes from the file: it is checked to stay inside the record, without overflow.
at::Tensor view_of_record(std::string& bytes, const Json& meta, at::ScalarType dtype) {
  std::vector<int64_t> sizes, strides;
  for (const auto& d : meta.value("sizes", Json::array())) sizes.push_back(d.value("as_int", int64_t{0}));
  for (const auto& d : meta.value("strides", Json::array())) strides.push_back(d.value("as_int", int64_t{1}));
  strides.resize(sizes.size(), 1);
  const int64_t offset = meta.value("storage_offset", Json::object()).value("as_int", int64_t{0});
  const int64_t elements = static_cast<int64_t>(bytes.size() / c10::elementSize(dtype));
  auto refuse = [&](const std::string& why) {
    throw Error(Status::InvalidFormat, "a weight record holds " + std::to_string(elements) + " elements but " + why);
  };
  int64_t last = 0;  // the furthest element the view reads, from the offset
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || strides[d] < 0) refuse("its metadata has a negative size or stride");
    empty |= sizes[d] == 0;
    int64_t reach = 0;
    if (sizes[d] > 0 &&
        (__builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) || __builtin_add_overflow(last, reach, &last)))
      refuse("its metadata's sizes and strides overflow");
  }
  int64_t end = 0;  // one past the last element read
  if (!empty && (__builtin_add_overflow(offset, last, &end) || __builtin_add_overflow(end, int64_t{1}, &end)))
    refuse("its metadata's offset overflows");
  if (offset < 0 || (!empty && end > elements))
    refuse("its metadata reaches element " + std::to_string(empty ? offset : end));
  return at::from_blob(bytes.data(), {elements}, at::TensorOptions().dtype(dtype)).as_strided(sizes, strides, offset);
}

// Writes the weights `ids` of `source` into `writer` and returns the stage's weights and constants
// configs. Each tensor gets a record of its own bytes, contiguous at offset 0: nativert ignores a
// record's storage offset, so a weight that is a slice of a larger tensor (as torch.export.save
// writes them, one record per storage) would load from the storage's first bytes. Data comes from
// `checkpoint` when it holds the tensor (cast to the program's dtype when a dtype was asked for,
// else it must match), otherwise from the source archive. A tensor the program writes in place (a KV
// cache) that the archive holds no data for is allocated as zeros, as a TorchScript skeleton's
// placeholder cache is.
std::pair<Json, Json> write_weights(Pt2Writer& writer, const ExportedModel& source, const std::vector<size_t>& ids,
                                    const std::string& stage, const StageOptions& options, Checkpoint* checkpoint,
                                    bool leave_out, const Json& device, const AliasGroups& tied) {
  Json weights = Json::object(), constants = Json::object();
  const std::string where = " (" + stage + ")";
  // One tensor under several names (a tied head, an aliased parameter) shares its record and its
  // metadata: written once, and looked up in a checkpoint under any of its names (Hugging Face
  // stores a tied head as the embedding only), those the stage still holds and those `tied` adds (a
  // stage shipped to a worker may hold the head alone).
  std::map<std::string, std::string> record_of;  // tensor key -> the record written for it
  size_t next_weight = 0, next_constant = 0;
  for (size_t id : ids) {
    const Weight& w = source.weights().at(id);
    Json config = w.config;
    Json& meta = config["tensor_meta"];
    meta["device"] = device;
    std::vector<int64_t> sizes;
    for (const auto& d : w.meta.sizes) sizes.push_back(d.size);
    Json strides = Json::array();
    for (int64_t st : c10::contiguous_strides(sizes)) strides.push_back({{"as_int", st}});
    meta["strides"] = strides;
    meta["storage_offset"] = {{"as_int", 0}};
    auto& table = w.in_constants ? constants : weights;
    const std::string& key = w.identity;
    if (auto done = record_of.find(key); done != record_of.end()) {
      config["path_name"] = done->second;
      table[w.fqn] = std::move(config);
      continue;
    }
    const std::string name =
        w.in_constants ? "tensor_" + std::to_string(next_constant++) : "weight_" + std::to_string(next_weight++);
    const std::string dir = w.in_constants ? "data/constants/" : "data/weights/";
    record_of[key] = name;
    config["path_name"] = name;

    std::vector<std::string> aliases = source.aliases_of(id);
    if (auto more = tied.find(w.fqn); more != tied.end())
      aliases.insert(aliases.end(), more->second.begin(), more->second.end());
    std::string found;
    if (checkpoint && w.spec_kind != "tensor_constant") found = checkpoint->resolve(w.fqn, aliases);
    at::Tensor t;
    std::string source_bytes;
    if (!found.empty() && leave_out) {
      writer.add(dir + name, nullptr, 0);  // the worker reads it from the checkpoint
      table[w.fqn] = std::move(config);
      continue;
    } else if (!found.empty()) {
      t = checkpoint->load(found);
      if (t.sizes() != c10::IntArrayRef(sizes))
        throw Error(Status::Input, "tensor '" + w.fqn + "'" + where + ": the model expects shape " +
                                       c10::str(c10::IntArrayRef(sizes)) + " but checkpoint tensor '" + found +
                                       "' has shape " + c10::str(t.sizes()));
      if (t.scalar_type() != w.meta.dtype) {
        if (!(options.dtype && at::isFloatingType(t.scalar_type()) && at::isFloatingType(w.meta.dtype)))
          throw Error(Status::Input, "tensor '" + w.fqn + "'" + where + ": the model expects dtype " +
                                         c10::toString(w.meta.dtype) + " but checkpoint tensor '" + found + "' has " +
                                         c10::toString(t.scalar_type()) +
                                         " (ask for a dtype to convert floating weights)");
        t = t.to(w.meta.dtype);
      }
    } else {
      const size_t size = source.archive().has(w.record) ? source.archive().size(w.record) : 0;
      const bool written_in_place = !source.attributes().at(id).writers.empty();
      if (size == 0 && w.meta.nbytes > 0 && written_in_place && leave_out) {
        writer.add(dir + name, nullptr, 0);  // the worker allocates it: a KV cache is not sent as zeros
        table[w.fqn] = std::move(config);
        continue;
      } else if (size == 0 && w.meta.nbytes > 0 && written_in_place) {
        t = at::zeros(sizes, at::TensorOptions().dtype(w.meta.dtype));
      } else if (size == 0 && w.meta.nbytes > 0) {
        throw Error(checkpoint ? Status::NotFound : Status::InvalidArgument,
                    "tensor '" + w.fqn + "'" + where + " has no data in '" + source.path() + "'" +
                        (checkpoint ? " and is not in checkpoint '" + checkpoint->path() +
                                          "' (also tried tied names and with a prefix such as 'model.' added or "
                                          "removed)"
                                    : ": give its weights with a checkpoint (--weights / pipe_stage_options.weights)"));
      } else {
        source_bytes.resize(size);
        if (size) source.archive().read_into(w.record, source_bytes.data(), size);
        try {
          t = view_of_record(source_bytes, w.config.value("tensor_meta", Json::object()), w.meta.dtype);
        } catch (const Error& e) {
          throw Error(e.status(), "tensor '" + w.fqn + "'" + where + " in '" + source.path() + "': " + e.what() +
                                      " (the file is damaged: export it again)");
        }
      }
    }
    t = t.contiguous();
    writer.add(dir + name, t.data_ptr(), t.nbytes());
    table[w.fqn] = std::move(config);
  }
  return {Json{{"config", weights}}, Json{{"config", constants}}};
}

// The linear layers of `graph` whose result is what the program returns, through dtype casts and copies only (each
// value on the way read once): the output head, as returns_output decides for TorchScript stages
// (torchscript/panel_rewrite.cpp), so that both formats store it alike. By the linear's output name.
std::set<std::string> output_heads(const Json& graph) {
  std::map<std::string, int> reads;
  std::map<std::string, const Json*> reader;
  std::set<std::string> returned;
  for (const Json& node : graph["nodes"])
    graph::exported::for_each_input_ref(node, [&](const std::string& name, RefKind) {
      ++reads[name];
      reader[name] = &node;
    });
  for (const Json& out : graph["outputs"])
    graph::exported::for_each_ref(out, [&](const std::string& name, RefKind) {
      ++reads[name];
      returned.insert(name);
    });
  auto passes_on = [](const Json& node) {
    const std::string op = graph::exported::operator_name(node.value("target", std::string())).name;
    return op == "aten::_to_copy" || op == "aten::to" || op == "aten::clone" || op == "aten::contiguous" ||
           op == "aten::alias";
  };
  std::set<std::string> heads;
  for (const Json& node : graph["nodes"]) {
    if (node.value("target", std::string()) != "torch.ops.aten.linear.default") continue;
    std::vector<std::string> outs;
    graph::exported::for_each_output_ref(node, [&](const std::string& name, RefKind) { outs.push_back(name); });
    if (outs.size() != 1) continue;
    std::string v = outs[0];
    for (int hops = 0; hops < 8; ++hops) {
      if (reads[v] != 1) break;
      if (returned.count(v)) {
        heads.insert(outs[0]);
        break;
      }
      const Json& user = *reader.at(v);
      std::vector<std::string> next;
      graph::exported::for_each_output_ref(user, [&](const std::string& name, RefKind) { next.push_back(name); });
      if (!passes_on(user) || next.size() != 1) break;
      v = next[0];
    }
  }
  return heads;
}

// How a CPU stage stores the weight of each linear layer pack_linear_layers rewrites, by the weight's placeholder: a
// float32, bfloat16 or float16 2-d parameter nothing writes. With quantized weights, those only linear layers read
// (as the weight) become codes; a weight read otherwise (a tied embedding) keeps its dtype, as in TorchScript
// stages; the output head's (output_heads: a weight any layer giving the output multiplies by) is stored as `head`
// says. Not there: layers left as aten.linear.
std::map<std::string, WeightQuantization> linear_storage(const Json& program, const ExportedModel& source,
                                                         const std::vector<size_t>& weight_ids,
                                                         WeightQuantization quantize, WeightQuantization head) {
  std::map<std::string, const Weight*> by_placeholder;
  for (size_t id : weight_ids)
    if (source.attributes().at(id).writers.empty())
      by_placeholder[source.weights()[id].placeholder] = &source.weights()[id];
  const Json& graph = program["graph_module"]["graph"];
  std::map<std::string, bool> linear_only;
  for (const Json& node : graph["nodes"]) {
    const bool linear = node.value("target", std::string()) == "torch.ops.aten.linear.default";
    for (const auto& input : node.value("inputs", Json::array())) {
      const bool as_weight = linear && input.value("name", std::string()) == "weight";
      graph::exported::for_each_ref(input.value("arg", Json::object()), [&](const std::string& name, RefKind) {
        auto [it, fresh] = linear_only.try_emplace(name, as_weight);
        if (!fresh) it->second = it->second && as_weight;
      });
    }
  }
  const std::set<std::string> heads = output_heads(graph);
  std::set<std::string> head_weights;
  for (const Json& node : graph["nodes"]) {
    if (node.value("target", std::string()) != "torch.ops.aten.linear.default" || !node.contains("inputs")) continue;
    bool is_head = false;
    graph::exported::for_each_output_ref(node, [&](const std::string& name, RefKind) { is_head |= heads.count(name); });
    if (!is_head) continue;
    for (const auto& input : node["inputs"])
      if (input.value("name", std::string()) == "weight" && input["arg"].contains("as_tensor"))
        head_weights.insert(input["arg"]["as_tensor"].value("name", std::string()));
  }
  std::map<std::string, WeightQuantization> out;
  for (const Json& node : graph["nodes"]) {
    if (node.value("target", std::string()) != "torch.ops.aten.linear.default" || !node.contains("inputs")) continue;
    for (const auto& input : node["inputs"]) {
      if (input.value("name", std::string()) != "weight" || !input["arg"].contains("as_tensor")) continue;
      auto w = by_placeholder.find(input["arg"]["as_tensor"].value("name", std::string()));
      if (w == by_placeholder.end() || w->second->spec_kind != "parameter" ||
          (w->second->meta.dtype != at::kFloat && w->second->meta.dtype != at::kBFloat16 &&
           w->second->meta.dtype != at::kHalf) ||
          w->second->meta.sizes.size() != 2)
        break;
      const WeightQuantization as =
          quantize != WeightQuantization::None && head_weights.count(w->first) ? head : quantize;
      out[w->first] = linear_only[w->first] ? as : WeightQuantization::None;
    }
  }
  return out;
}

// On a CPU stage, each aten.linear of a float32, bfloat16 or float16 parameter calls
// pipe::linear_packed_on_demand (same arguments), which multiplies by the weight's panels, as TorchScript
// stages' linear layers do (panel_linear.h); the stage packs on its first run. With int8 weights, a parameter
// only linear layers read calls pipe::linear_int8_on_demand (int4: pipe::linear_int4_on_demand, in the stage's
// PanelWeights::int4_group), which quantizes it on first use. The output head's weight (output_heads) is stored as
// `head` says instead (head_quantization in stage.h). Returns the number of layers rewritten.
size_t pack_linear_layers(Json& program, const ExportedModel& source, const std::vector<size_t>& weight_ids,
                          WeightQuantization quantize, WeightQuantization head) {
  if (!register_linear_packed_on_demand()) return 0;
  const std::map<std::string, WeightQuantization> storage = linear_storage(program, source, weight_ids, quantize, head);
  size_t rewritten = 0;
  for (Json& node : program["graph_module"]["graph"]["nodes"]) {
    if (node.value("target", std::string()) != "torch.ops.aten.linear.default" || !node.contains("inputs")) continue;
    for (const auto& input : node["inputs"]) {
      if (input.value("name", std::string()) != "weight" || !input["arg"].contains("as_tensor")) continue;
      auto w = storage.find(input["arg"]["as_tensor"].value("name", std::string()));
      if (w == storage.end()) break;
      node["target"] = w->second == WeightQuantization::None   ? "torch.ops.pipe.linear_packed_on_demand.default"
                       : w->second == WeightQuantization::Int8 ? "torch.ops.pipe.linear_int8_on_demand.default"
                                                               : "torch.ops.pipe.linear_int4_on_demand.default";
      ++rewritten;
    }
  }
  return rewritten;
}

void write_archive(Pt2Writer& writer, Json program, const ExportedModel& source, const std::vector<size_t>& weight_ids,
                   const std::string& stage, const c10::Device& device, const StageOptions& options,
                   Checkpoint* checkpoint, bool leave_out, const AliasGroups& tied, bool cpu_rewrites) {
  const Json where = device_json(device);
  place_devices(program["graph_module"]["graph"], where);
  auto [weights, constants] =
      write_weights(writer, source, weight_ids, stage, options, checkpoint, leave_out, where, tied);
  if (cpu_rewrites && device.is_cpu())
    pack_linear_layers(program, source, weight_ids, options.quantize, head_quantization(options));
  writer.add("models/model.json", program.dump());
  writer.add("data/weights/model_weights_config.json", weights.dump());
  writer.add("data/constants/model_constants_config.json", constants.dump());
  // torch.export.load reads every program's example inputs; an empty record stands for none.
  writer.add("data/sample_inputs/model.pt", nullptr, 0);
}

// The program of stage `index`: its nodes, its crossing values as inputs and outputs, its weights.
Json stage_program(const ExportedModel& model, const graph::Plan& plan, size_t index, std::vector<size_t>& weight_ids) {
  const graph::StagePlan& sp = plan.stage(index);
  const bool last = index + 1 == plan.num_stages();
  const Json& graph = model.graph();
  const Json& nodes = graph["nodes"];

  std::set<size_t> keep;  // json node indices
  for (size_t id : sp.nodes) {
    keep.insert(model.json_node(id));
    const auto& symbols = model.symbol_nodes(id);
    keep.insert(symbols.begin(), symbols.end());
  }
  if (last) {
    const auto& symbols = model.symbol_nodes(model.nodes().size());
    keep.insert(symbols.begin(), symbols.end());
  }

  Json stage_nodes = Json::array();
  std::set<std::string> tensors, symbols;
  auto note = [&](const std::string& name, RefKind kind) {
    if (kind == RefKind::Symbol) symbols.insert(name);
    else tensors.insert(name);
  };
  for (size_t i : keep) {
    stage_nodes.push_back(nodes[i]);
    graph::exported::for_each_input_ref(nodes[i], note);
    graph::exported::for_each_output_ref(nodes[i], note);
  }

  // Inputs: the weights first (in the program's order), then the crossing values.
  weight_ids = sp.attributes;
  std::sort(weight_ids.begin(), weight_ids.end());
  Json inputs = Json::array(), input_specs = Json::array(), arg_names = Json::array(), leaves = Json::array();
  for (size_t id : weight_ids) {
    const Weight& w = model.weights()[id];
    inputs.push_back({{"as_tensor", {{"name", w.placeholder}}}});
    input_specs.push_back(w.spec);
    tensors.insert(w.placeholder);
  }
  for (size_t cv : sp.inputs) {
    const std::string& name = plan.values()[cv].name;
    inputs.push_back({{"as_tensor", {{"name", name}}}});
    input_specs.push_back({{"user_input", {{"arg", {{"as_tensor", {{"name", name}}}}}}}});
    arg_names.push_back(name);
    leaves.push_back(leaf_spec());
    tensors.insert(name);
  }

  Json outputs = Json::array(), output_specs = Json::array();
  std::string out_spec;
  const Json& calls = model.program()["graph_module"]["module_call_graph"];
  if (last) {
    outputs = graph["outputs"];
    for (const auto& out : outputs) {
      graph::exported::for_each_ref(out, note);
      output_specs.push_back({{"user_output", {{"arg", out}}}});
    }
    out_spec = calls[0]["signature"].value("out_spec", std::string());
  } else {
    Json out_leaves = Json::array();
    for (size_t cv : sp.outputs) {
      const std::string& name = plan.values()[cv].name;
      const Json arg = {{"as_tensor", {{"name", name}}}};
      outputs.push_back(arg);
      output_specs.push_back({{"user_output", {{"arg", arg}}}});
      out_leaves.push_back(leaf_spec());
      tensors.insert(name);
    }
    out_spec = treespec_text(tuple_spec(std::move(out_leaves)));
  }
  // Sizes cannot be handed between programs (nativert takes tensor inputs only): a symbol a stage
  // reads must be one it computes. The front-end makes every symbol-only node recomputable; a
  // symbol some other operator defines cannot cross.
  for (size_t cv : sp.inputs)
    for (const auto& s : symbols)
      if (plan.values()[cv].name == s)
        throw Error(Status::Unsupported, "the symbolic size '" + s + "' would cross into stage " +
                                             std::to_string(index) +
                                             ", and stages of an exported program can only hand over tensors; move "
                                             "the split point so that its producer and its readers share a stage");

  Json program = model.program();
  Json& gm = program["graph_module"];
  Json& g = gm["graph"];
  g["nodes"] = std::move(stage_nodes);
  g["inputs"] = std::move(inputs);
  g["outputs"] = std::move(outputs);
  if (!last) g["is_single_tensor_return"] = false;
  auto filter = [](const Json& table, const std::set<std::string>& names) {
    Json out = Json::object();
    for (const auto& [name, value] : table.items())
      if (names.count(name)) out[name] = value;
    return out;
  };
  g["tensor_values"] = filter(graph.value("tensor_values", Json::object()), tensors);
  for (const char* table : {"sym_int_values", "sym_bool_values", "sym_float_values"})
    if (graph.contains(table)) g[table] = filter(graph[table], symbols);
  g["custom_obj_values"] = Json::object();
  gm["signature"]["input_specs"] = std::move(input_specs);
  gm["signature"]["output_specs"] = std::move(output_specs);
  Json signature = calls[0]["signature"];
  signature["in_spec"] =
      treespec_text(tuple_spec({tuple_spec(std::move(leaves)),
                                {{"type", "builtins.dict"}, {"context", "[]"}, {"children_spec", Json::array()}}}));
  signature["out_spec"] = out_spec;
  signature["forward_arg_names"] = std::move(arg_names);
  signature["inputs"] = Json::array();
  signature["outputs"] = Json::array();
  // The modules the stage's nodes were called in, and those owning its weights, keep their entries
  // (signature-less, as export records all but the root's): its module tree, for pipe inspect and
  // split points on a saved stage.
  std::set<std::string> used;
  auto add_with_parents = [&](std::string path) {
    while (!path.empty() && used.insert(path).second) {
      const size_t dot = path.rfind('.');
      path = dot == std::string::npos ? "" : path.substr(0, dot);
    }
  };
  for (size_t id : sp.nodes)
    for (int site : model.nodes()[id].sites) add_with_parents(model.call_sites()[site].path);
  for (size_t id : weight_ids) {
    const std::string& fqn = model.weights()[id].fqn;
    const size_t dot = fqn.rfind('.');
    if (dot != std::string::npos) add_with_parents(fqn.substr(0, dot));
  }
  Json stage_calls = Json::array({{{"fqn", ""}, {"signature", std::move(signature)}}});
  for (const auto& call : calls)
    if (used.count(call.value("fqn", std::string()))) stage_calls.push_back(call);
  gm["module_call_graph"] = std::move(stage_calls);
  program["guards_code"] = Json::array();
  return program;
}

// An anonymous in-memory file, for a reader that takes paths only. The archive is written straight
// into it: no second copy of the stage's weights in this process's own memory.
class MemoryFile {
 public:
  MemoryFile() {
    fd_ = memfd_create("libpipe-stage", MFD_CLOEXEC);
    if (fd_ < 0) throw Error(Status::Io, std::string("cannot make an in-memory file for a stage: ") + strerror(errno));
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  bool append(const void* data, size_t size) {
    size_t done = 0;
    while (done < size && error_ == 0) {
      const ssize_t n = ::write(fd_, static_cast<const char*>(data) + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) error_ = n < 0 ? errno : EIO;
      else done += static_cast<size_t>(n);
    }
    return error_ == 0;
  }
  // Throws the write's own error, which the zip writer only saw as a short write.
  void check() const {
    if (error_ == 0) return;
    throw Error(error_ == ENOSPC || error_ == ENOMEM ? Status::OutOfMemory : Status::Io,
                std::string("cannot write a stage into memory: ") + strerror(error_));
  }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
  int error_ = 0;
};

class ExportedStage : public Stage {
 public:
  ExportedStage(const MemoryFile& file, const std::string& what, const c10::Device& device, bool cpu_rewrites,
                int64_t int4_group) {
    if (cpu_rewrites && device.is_cpu()) {
      packed_ = std::make_unique<PanelWeights>();
      if (int4_group) packed_->int4_group = int4_group;
    }
    log::capture_libtorch_log();
    // nativert prints every program's signature to stdout while c10's log level is above 2 (a
    // debugging aid behind the wrong flag), and libpipe raises that level process-wide to quiet
    // c10d (comm/rendezvous.cpp): it is lowered while a program loads.
    log::LibTorchLogLevelAtMost quiet_loader(2);
    try {
      runner_ = std::make_unique<torch::nativert::ModelRunnerHandle>(file.path(), "model");
    } catch (const c10::OutOfMemoryError& e) {
      throw Error(Status::OutOfMemory, what + ": out of memory while loading it: " + e.what_without_backtrace());
    } catch (const c10::Error& e) {
      throw Error(Status::InvalidFormat,
                  what + ": LibTorch's runtime for exported programs refused it: " + e.what_without_backtrace());
    } catch (const std::bad_alloc&) {
      throw Error(Status::OutOfMemory, what + ": out of memory while loading it");
    } catch (const std::exception& e) {
      throw Error(Status::InvalidFormat, what + ": LibTorch's runtime for exported programs refused it: " + e.what());
    }
  }
  c10::IValue forward(std::vector<c10::IValue> inputs) override {
    if (!packed_) return runner_->run(inputs, {});
    PanelWeights::Use use(*packed_);
    return runner_->run(inputs, {});
  }

 private:
  // Held through a pointer: the handle's own move operations cannot be instantiated outside LibTorch.
  std::unique_ptr<torch::nativert::ModelRunnerHandle> runner_;
  std::unique_ptr<PanelWeights> packed_;  // its linear layers' weights as panels, made on first use
};

// Writes an archive with `write` into a memory file and loads the stage from it.
template <typename Write>
std::unique_ptr<Stage> in_memory(const std::string& what, const c10::Device& device, bool cpu_rewrites,
                                 int64_t int4_group, Write&& write) {
  MemoryFile file;
  try {
    Pt2Writer writer([&file](const void* data, size_t size) { return file.append(data, size); });
    write(writer);
    writer.finish();
  } catch (const Error&) {
    file.check();  // the reason the writer stopped, if the memory file failed it
    throw;
  }
  return std::make_unique<ExportedStage>(file, what, device, cpu_rewrites, int4_group);
}

}  // namespace

std::string exported_stage_archive(const ExportedModel& model, const graph::Plan& plan, size_t index,
                                   const c10::Device& device, const StageOptions& options, Checkpoint* checkpoint,
                                   bool leave_out) {
  check_dtype(model, options);
  std::vector<size_t> weight_ids;
  Json program = stage_program(model, plan, index, weight_ids);
  Pt2Writer writer;
  write_archive(writer, std::move(program), model, weight_ids, "stage " + std::to_string(index), device, options,
                checkpoint, leave_out, {}, 0);
  return writer.finish();
}

std::unique_ptr<Stage> build_exported_stage(const ExportedModel& model, const graph::Plan& plan, size_t index,
                                            const BuildOptions& build) {
  check_dtype(model, *build.options);
  std::vector<size_t> weight_ids;
  Json program = stage_program(model, plan, index, weight_ids);
  const std::string what = "stage " + std::to_string(index);
  return in_memory(what, build.device, build.cpu_rewrites, build.options->quantize_group, [&](Pt2Writer& writer) {
    write_archive(writer, std::move(program), model, weight_ids, what, build.device, *build.options, build.checkpoint,
                  false, {}, build.cpu_rewrites);
  });
}

std::unique_ptr<Stage> receive_exported_stage(const ExportedModel& received, const BuildOptions& build,
                                              const AliasGroups& tied, const std::string& what) {
  std::vector<size_t> all(received.weights().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return in_memory(what, build.device, build.cpu_rewrites, build.options->quantize_group, [&](Pt2Writer& writer) {
    write_archive(writer, received.program(), received, all, received.path(), build.device, *build.options,
                  build.checkpoint, false, tied, build.cpu_rewrites);
  });
}

AliasGroups exported_stage_aliases(const ExportedModel& model, const graph::Plan& plan, size_t index) {
  AliasGroups out;
  for (size_t id : plan.stage(index).attributes) {
    auto names = model.aliases_of(id);
    if (!names.empty()) out[model.weights().at(id).fqn] = std::move(names);
  }
  return out;
}

namespace {

// An int8 embedding is a rewrite of a TorchScript graph (quantize_embeddings): nativert runs an exported program
// as the archive has it, and its aten::embedding would have no table left to read.
void refuse_embedding_quantization(const StageOptions& options) {
  if (options.quantize_embedding != WeightQuantization::None)
    throw Error(Status::Unsupported,
                "int8 embeddings are for TorchScript stages, not exported (.pt2) ones; leave quantize_embedding "
                "PIPE_QUANTIZE_EMBEDDING_NONE (pipe --quantize-embedding none)");
}

// Quantized weights are the CPU panels' (pack_linear_layers).
void refuse_quantization(const BuildOptions& build) {
  refuse_embedding_quantization(*build.options);
  if (build.options->quantize != WeightQuantization::None &&
      (!build.cpu_rewrites || !build.device.is_cpu() || !register_linear_packed_on_demand()))
    throw Error(Status::Unsupported, "quantized weights are for CPU stages on a CPU with AVX-512 (this stage runs on " +
                                         build.device.str() + "); leave the weights unquantized");
}

class ExportedStages final : public StageFormat {
 public:
  std::unique_ptr<Stage> build(const graph::Plan& plan, size_t index, const BuildOptions& build) const override {
    refuse_quantization(build);
    return build_exported_stage(graph::exported::exported_model(plan), plan, index, build);
  }
  void save(const graph::Plan& plan, size_t index, const StageOptions& options, Checkpoint* checkpoint,
            const std::string& path) const override {
    const std::string bytes = exported_stage_archive(graph::exported::exported_model(plan), plan, index,
                                                     c10::Device(c10::kCPU), options, checkpoint);
    FILE* f = std::fopen(path.c_str(), "wb");
    const bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (f && std::fclose(f) != 0) throw Error(Status::Io, "cannot write '" + path + "'");
    if (!ok) throw Error(Status::Io, "cannot write '" + path + "'");
  }
  ShippedStage ship(const graph::Plan& plan, size_t index, const c10::Device& device, const StageOptions& options,
                    Checkpoint* checkpoint) const override {
    const ExportedModel& model = graph::exported::exported_model(plan);
    return {exported_stage_archive(model, plan, index, device, options, checkpoint, /*leave_out=*/true),
            exported_stage_aliases(model, plan, index)};
  }
  std::unique_ptr<Stage> receive(ShippedStage shipped, size_t /*index*/, const BuildOptions& build,
                                 const std::string& what) const override {
    refuse_quantization(build);
    const AliasGroups tied = std::move(shipped.aliases);
    auto received =
        ExportedModel::from_archive(graph::exported::Pt2Archive::from_bytes(std::move(shipped.bytes), what));
    return receive_exported_stage(*received, build, tied, what);
  }
  uint64_t stored_bytes(const graph::Plan& plan, size_t index, const StageOptions& options) const override {
    refuse_embedding_quantization(options);
    const ExportedModel& model = graph::exported::exported_model(plan);
    check_dtype(model, options);
    std::vector<size_t> weight_ids;
    const Json program = stage_program(model, plan, index, weight_ids);
    // nativert holds every weight as the program has it (one tensor under several names once); the panels
    // pack_linear_layers' layers make on their first run come on top.
    uint64_t total = 0;
    std::set<std::string> seen;
    for (size_t id : weight_ids) {
      const Weight& w = model.weights()[id];
      if (seen.insert(w.identity.empty() ? w.placeholder : w.identity).second) total += w.meta.nbytes;
    }
    if (!panel_linear_available()) return total;
    const WeightQuantization head = head_quantization(options);
    std::set<std::string> packed;
    for (const auto& [placeholder, as] : linear_storage(program, model, weight_ids, options.quantize, head)) {
      for (size_t id : weight_ids) {
        const Weight& w = model.weights()[id];
        if (w.placeholder != placeholder || !packed.insert(w.identity.empty() ? w.placeholder : w.identity).second)
          continue;
        const int64_t n = w.meta.sizes[0].size, k = w.meta.sizes[1].size;
        if (n > 0 && k > 0) total += stored_panel_bytes(n, k, w.meta.dtype, as, options.quantize_group);
      }
    }
    return total;
  }
};

}  // namespace

const StageFormat& exported_stages() {
  static const ExportedStages stages;
  return stages;
}

}  // namespace libpipe::stage
