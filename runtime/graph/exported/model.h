// ExportedModel: the torch.export front-end. It reads a .pt2 archive (torch.export.save) and
// describes its program as a Program for the split logic, from the program's JSON alone: the graph's
// nodes in order are the top-level sequence, each node's nn_module_stack gives its module calls,
// placeholders of parameters, buffers and tensor constants are the attributes, and
// `pipe.split.default` nodes are markers. Nothing is run and no weight is read at load.
//
// Symbolic sizes (SymInt, SymBool, SymFloat values: `sym_size`, arithmetic on sizes) cannot cross
// between stage programs (nativert takes tensors only), so the nodes that compute nothing but
// symbols are recomputed in every stage that needs one: they belong to no stage, and whoever reads
// a symbol reads the tensors it is computed from.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/graph/exported/archive.h"
#include "runtime/graph/exported/program_json.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/program.h"

namespace libpipe::graph::exported {

// A parameter, buffer or tensor constant of the program: a placeholder of its graph.
struct Weight {
  std::string placeholder;    // the graph's name for it ("p_layers_0_weight")
  std::string fqn;            // its name in the model ("layers.0.weight")
  std::string spec_kind;      // "parameter", "buffer" or "tensor_constant"
  Json spec;                  // its input_specs entry, as written
  Json config;                // its entry in the weights or constants config (path_name, tensor_meta, ...)
  bool in_constants = false;  // the entry is in the constants config (data/constants/) rather than weights
  std::string record;         // its data's record in the archive ("data/weights/weight_3")
  TensorMeta meta;
  // Equal for the names of one tensor (a tied head, an aliased parameter): the same record, at the
  // same place in it, with the same shape.
  std::string identity;
};

class ExportedModel : public Program {
 public:
  // Loads `path`: Error(NotFound) for a missing file, Error(InvalidFormat) for a file that is not a
  // readable torch.export archive (or whose program names the archive does not hold), and
  // Error(Unsupported) naming what libpipe cannot run: inputs that are not tensors, outputs of
  // types other than tensors in tuples, lists and dicts (a Hugging Face ModelOutput), and programs
  // that write buffers or inputs through mutation outputs (a decomposed program).
  static std::shared_ptr<const ExportedModel> load(const std::string& path);
  // The same from an archive already open (a stage program a worker process received).
  static std::shared_ptr<const ExportedModel> from_archive(std::shared_ptr<Pt2Archive> archive);

  io::ModelFormat format() const override { return io::ModelFormat::Exported; }
  // nativert validates nothing a call gives it: input_check.h checks against the program's record.
  void check_inputs(const std::vector<c10::IValue>& inputs, const std::string& what) const override;
  std::vector<BufferInfo> buffers() const override;

  const Pt2Archive& archive() const { return *archive_; }
  // The program, as parsed (graph_module, range_constraints, schema_version, ...).
  const Json& program() const { return program_; }
  const Json& graph() const { return program_["graph_module"]["graph"]; }
  const std::vector<Weight>& weights() const { return weights_; }
  // The other names of weight `id`'s tensor (tied or aliased names), for checkpoint lookups.
  std::vector<std::string> aliases_of(size_t id) const;
  // The graph's node (an index into graph()["nodes"]) behind Program node `id`.
  size_t json_node(size_t id) const { return json_node_.at(id); }
  // Nodes that compute only symbols and that Program node `id` (or, for id == nodes().size(), the
  // return) needs, in graph order: a stage holding the node recreates them.
  const std::vector<size_t>& symbol_nodes(size_t id) const { return symbol_nodes_.at(id); }
  // The program's user inputs, as recorded: dtype and sizes (symbols named), for checking a call.
  const std::vector<TensorMeta>& input_metas() const { return input_metas_; }
  // Each symbol's range from range_constraints: [min, max] (max -1: unbounded).
  const std::unordered_map<std::string, std::pair<int64_t, int64_t>>& symbol_ranges() const { return ranges_; }

 private:
  void describe();

  std::shared_ptr<Pt2Archive> archive_;
  std::string program_name_;
  Json program_;
  std::vector<Weight> weights_;
  std::vector<size_t> json_node_;
  std::vector<std::vector<size_t>> symbol_nodes_;  // one per node, then the return's
  std::vector<TensorMeta> input_metas_;
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> ranges_;
};

// The exported program behind a plan (for the exported-program stage builder, which stage.cpp picks by the
// model's format()); Error(Internal) when the plan was made from another front-end's program.
const ExportedModel& exported_model(const Plan& plan);

}  // namespace libpipe::graph::exported
