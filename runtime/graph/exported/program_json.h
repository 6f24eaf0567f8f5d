// Reading the JSON of a torch.export program (models/<name>.json in a .pt2 archive, the
// ExportedProgram schema of torch/_export/serde/schema.py, 8.x). Only what the splitter needs is
// interpreted; everything else is copied through untouched, so a stage program keeps the original's
// operators, arguments and metadata byte for byte.
#pragma once

#include <c10/core/ScalarType.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace libpipe::graph::exported {

using Json = nlohmann::json;

enum class RefKind {
  Tensor,     // as_tensor, as_tensors, as_optional_tensor(s)
  Symbol,     // as_sym_int / as_sym_bool / as_sym_float (and their lists) naming a value
  CustomObj,  // as_custom_obj (a TorchBind object)
};

// Calls `f` for every value `argument` (one Argument union: {"as_tensor": {"name": ...}}, ...) names,
// in order. Literals (as_int, as_ints, as_none, as_scalar_type, ...) name nothing; a subgraph
// (as_graph, a higher-order operator's body) is not looked into: its values are its own.
void for_each_ref(const Json& argument, const std::function<void(const std::string&, RefKind)>& f);

// The same walk, letting `f` rename each reference in place.
void rename_refs(Json& argument, const std::function<void(std::string&, RefKind)>& f);

// The values a node reads (its inputs' refs) and defines (its outputs' refs).
void for_each_input_ref(const Json& node, const std::function<void(const std::string&, RefKind)>& f);
void for_each_output_ref(const Json& node, const std::function<void(const std::string&, RefKind)>& f);

// "torch.ops.aten.linear.default" -> {"aten::linear", ""}; "torch.ops.aten.add.Tensor" ->
// {"aten::add", "Tensor"}. Empty name for targets that are not torch.ops operators (Python
// builtins such as "_operator.mul", higher-order operators).
struct OperatorName {
  std::string name;
  std::string overload;
};
OperatorName operator_name(const std::string& target);

// The export schema's dtype codes (ScalarType in schema.py) and LibTorch's.
std::optional<at::ScalarType> scalar_type_of(int64_t code);

// PyTorch's Python name for a dtype ("float32", "bfloat16", "int64"), for messages that say what to write.
std::string python_dtype(at::ScalarType type);

// One dimension of a tensor's recorded shape: a number, or a symbolic size ("s17", or an
// expression of symbols such as "2*s17", kept as text).
struct Dim {
  int64_t size = -1;   // >= 0 for a fixed size
  std::string symbol;  // the symbol when the size is exactly one symbol
  std::string expr;    // the expression text when it is symbolic
};
struct TensorMeta {
  at::ScalarType dtype = at::kFloat;
  std::vector<Dim> sizes;
  uint64_t nbytes = 0;  // numel x element size, 0 when a size is symbolic
};
// Reads a TensorMeta object (tensor_values entries, the weights configs' tensor_meta). Throws
// Error(InvalidFormat) naming `what` for a dtype it does not know.
TensorMeta tensor_meta(const Json& meta, const std::string& what);

// "file.py:12" for the innermost frame of a node's stack_trace metadata (the line of model code it
// came from), else the target's short name ("aten.linear").
std::string where(const Json& node);

}  // namespace libpipe::graph::exported
