// Program: a loaded model as the split logic sees it, whatever format it came in. Each front-end
// (TorchScript: runtime/graph/torchscript; torch.export programs: runtime/graph/exported) reads its file and
// fills these tables once; the plan, the split points by module path and the balancing policies
// work on them alone, so every front-end gets the same rules and the same messages.
//
// The model's forward is a sequence of top-level nodes. Constants and reads of the model's own
// attributes are not nodes here: each stage that needs one recreates it. A node reads values
// (forward inputs or other nodes' outputs) and attributes (parameters, buffers, submodules), and
// remembers the module calls it was inlined from.
//
// The rest of libpipe asks a Program, never its concrete type, what differs between formats: the
// format's name, the checks a call's inputs need, and the model's buffers (the decoder contract's
// caches). Building stages is the other per-format concern; it lives in runtime/stage, which picks
// a builder by format().
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/io/archive_check.h"

namespace libpipe::graph {

// One call of a submodule in the model's code: `path` is the module's dotted name ("layers.3",
// "transformer.h.0.attn"); `call` counts the calls of that module in graph order (0 for the first),
// so a module called twice has two call sites.
struct CallSite {
  std::string path;
  int call = 0;
};

// A module of the model, for `pipe inspect` and the layer search: pre-order, with parameters
// counted over the module and all its descendants (shared tensors once).
struct ModuleInfo {
  std::string path;        // "" for the root
  std::string type;        // the Python class name
  std::string class_name;  // the qualified class, equal for every instance of one Python class
  int depth = 0;
  uint64_t num_params = 0;
  uint64_t param_bytes = 0;
};

enum class NodeRole {
  Compute,       // runs in a stage
  SplitMarker,   // pipe::split(): a stage boundary, runs nowhere
  ContextEnter,  // the start of a `with` block that changes how the code inside runs (autocast)
  ContextExit,   // its end; no cut may fall between the two
};

struct ProgramNode {
  NodeRole role = NodeRole::Compute;
  std::vector<int> sites;          // indices into call_sites() it was inlined from, outermost first
  std::string where;               // "file.py:12", or the operation's name: for messages
  std::string context;             // ContextEnter: the context manager's type, for messages
  std::vector<size_t> reads;       // value ids it reads that it does not define (its blocks included)
  std::vector<size_t> attributes;  // attribute ids it reads (its blocks included), first read first
  std::string unsupported;         // non-empty: why a stage cannot hold this node (said when one must)
};

// A value that may cross a stage boundary: a forward input, or an output of a node.
struct ProgramValue {
  std::string name;      // forward argument name, or the value's name in the model code
  int input_index = -1;  // forward argument index (after self); -1 for a node's output
  size_t node = 0;       // the defining node when input_index < 0
};

// A parameter or buffer, under its original dotted name.
struct TensorEntry {
  std::string name;
  uint64_t bytes = 0;
  bool is_parameter = false;
};

// A read of one of the model's attributes: a parameter, a buffer, a plain tensor or a submodule.
struct AttributeRead {
  std::vector<std::string> path;     // {"layers", "0", "weight"}
  uint64_t tensor_bytes = 0;         // the attribute's own bytes when it is a tensor of any kind, else 0
  std::vector<TensorEntry> tensors;  // the parameters and buffers it stands for (all of a submodule's)
  // Nodes that update the tensor in place (directly or through a view of it), and the first such
  // write for messages ("aten::index_put_ at cache.py:123"). Such a tensor is state: the plan
  // keeps it, its writers and its readers in one stage.
  std::vector<size_t> writers;
  std::string written_by;
};

// A buffer of the model (any module's), as the decoder contract reads it.
struct BufferInfo {
  std::string name;  // dotted, as in a state_dict
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};

class Program {
 public:
  virtual ~Program() = default;

  // The format the model was read in (its values are the C ABI's PIPE_MODEL_* codes).
  virtual io::ModelFormat format() const = 0;
  // Checks a call's inputs, or one micro-batch's, before any stage runs them, for formats whose
  // stages check nothing themselves (an exported program). Throws Error(Input) naming the input and
  // what the model takes; `what` says what is checked ("micro-batch 2 of 4"; empty for a whole call).
  virtual void check_inputs(const std::vector<c10::IValue>& inputs, const std::string& what) const {
    (void)inputs;
    (void)what;
  }
  // Every buffer of the model, recursively, with its shape and dtype (no data is read).
  virtual std::vector<BufferInfo> buffers() const = 0;
  // The root module's bool attribute `name` (the decoder contract's optional `skips_padding`); false
  // where it has none, or the format keeps no such attributes.
  virtual bool root_flag(const std::string& name) const {
    (void)name;
    return false;
  }

  const std::string& path() const { return path_; }
  // Names of forward's arguments, as written in the model code.
  const std::vector<std::string>& input_names() const { return input_names_; }
  const std::vector<ModuleInfo>& modules() const { return modules_; }
  const std::vector<CallSite>& call_sites() const { return call_sites_; }
  const std::vector<ProgramNode>& nodes() const { return nodes_; }
  const std::vector<ProgramValue>& values() const { return values_; }
  const std::vector<AttributeRead>& attributes() const { return attributes_; }
  // What forward returns reads these, like a node that comes last.
  const ProgramNode& returns() const { return returns_; }
  // Where a split marker sits inside an if/loop block ("" when none does): only forward's top
  // level can be cut, which a plan by markers must say.
  const std::string& nested_marker() const { return nested_marker_; }
  // A parameter that holds no data (a skeleton's weights come from a checkpoint), or "" when every
  // parameter has data: timing stages needs real weights.
  const std::string& parameter_without_data() const { return parameter_without_data_; }

 protected:
  std::string path_;
  std::vector<std::string> input_names_;
  std::vector<ModuleInfo> modules_;
  std::vector<CallSite> call_sites_;
  std::vector<ProgramNode> nodes_;
  std::vector<ProgramValue> values_;
  std::vector<AttributeRead> attributes_;
  ProgramNode returns_;
  std::string nested_marker_;
  std::string parameter_without_data_;
};

}  // namespace libpipe::graph
