#include "runtime/graph/exported/program_json.h"

#include <c10/core/ScalarType.h>

#include "runtime/error.h"

namespace libpipe::graph::exported {

namespace {

// Visits every name `argument` refers to, as `Json&` (renamable) or `const Json&`: one walk for reading and
// renaming, so that both know the same kinds of reference.
template <typename J, typename F>
void visit_refs(J& argument, F& f) {
  if (!argument.is_object()) return;
  auto tensor = [&](J& t) {
    if (t.is_object() && t.contains("name") && t["name"].is_string()) f(t["name"], RefKind::Tensor);
  };
  auto optional_tensor = [&](J& o) {
    if (o.is_object() && o.contains("as_tensor")) tensor(o["as_tensor"]);
  };
  auto symbol = [&](J& s) {
    if (s.is_object() && s.contains("as_name") && s["as_name"].is_string()) f(s["as_name"], RefKind::Symbol);
  };
  for (auto&& [kind, payload] : argument.items()) {
    if (kind == "as_tensor") {
      tensor(payload);
    } else if (kind == "as_tensors") {
      for (auto& t : payload) tensor(t);
    } else if (kind == "as_optional_tensor") {
      optional_tensor(payload);
    } else if (kind == "as_optional_tensors") {
      for (auto& o : payload) optional_tensor(o);
    } else if (kind == "as_sym_int" || kind == "as_sym_bool" || kind == "as_sym_float") {
      symbol(payload);
    } else if (kind == "as_sym_ints" || kind == "as_sym_bools" || kind == "as_sym_floats") {
      for (auto& s : payload) symbol(s);
    } else if (kind == "as_custom_obj") {
      if (payload.is_object() && payload.contains("name") && payload["name"].is_string())
        f(payload["name"], RefKind::CustomObj);
    } else if (kind == "as_string_to_argument") {
      if (payload.is_object())
        for (auto&& [key, inner] : payload.items()) visit_refs(inner, f);
    }
  }
}

}  // namespace

void for_each_ref(const Json& argument, const std::function<void(const std::string&, RefKind)>& f) {
  auto read = [&](const Json& name, RefKind kind) { f(name.get<std::string>(), kind); };
  visit_refs(argument, read);
}

void rename_refs(Json& argument, const std::function<void(std::string&, RefKind)>& f) {
  auto rename = [&](Json& name, RefKind kind) {
    std::string text = name.get<std::string>();
    f(text, kind);
    name = text;
  };
  visit_refs(argument, rename);
}

void for_each_input_ref(const Json& node, const std::function<void(const std::string&, RefKind)>& f) {
  for (const auto& input : node.value("inputs", Json::array()))
    if (input.contains("arg")) for_each_ref(input["arg"], f);
}

void for_each_output_ref(const Json& node, const std::function<void(const std::string&, RefKind)>& f) {
  for (const auto& output : node.value("outputs", Json::array())) for_each_ref(output, f);
}

OperatorName operator_name(const std::string& target) {
  const std::string prefix = "torch.ops.";
  if (target.compare(0, prefix.size(), prefix) != 0) return {};
  const std::string rest = target.substr(prefix.size());  // "aten.add.Tensor"
  const size_t first = rest.find('.');
  if (first == std::string::npos) return {};
  const size_t second = rest.find('.', first + 1);
  OperatorName out;
  out.name =
      rest.substr(0, first) + "::" + rest.substr(first + 1, second == std::string::npos ? second : second - first - 1);
  out.overload = second == std::string::npos ? "" : rest.substr(second + 1);
  if (out.overload == "default") out.overload.clear();
  return out;
}

namespace {

struct DtypeCode {
  int64_t code;
  at::ScalarType type;
};
constexpr DtypeCode kDtypes[] = {
    {1, at::kByte},
    {2, at::kChar},
    {3, at::kShort},
    {4, at::kInt},
    {5, at::kLong},
    {6, at::kHalf},
    {7, at::kFloat},
    {8, at::kDouble},
    {9, at::kComplexHalf},
    {10, at::kComplexFloat},
    {11, at::kComplexDouble},
    {12, at::kBool},
    {13, at::kBFloat16},
    {28, at::kUInt16},
    {29, at::kFloat8_e4m3fn},
    {30, at::kFloat8_e5m2},
    {31, at::kFloat8_e4m3fnuz},
    {32, at::kFloat8_e5m2fnuz},
};

}  // namespace

std::optional<at::ScalarType> scalar_type_of(int64_t code) {
  for (const auto& d : kDtypes)
    if (d.code == code) return d.type;
  return std::nullopt;
}

std::string python_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
  }
}

TensorMeta tensor_meta(const Json& meta, const std::string& what) {
  TensorMeta out;
  const int64_t code = meta.value("dtype", int64_t{0});
  const auto type = scalar_type_of(code);
  if (!type)
    throw Error(Status::InvalidFormat, what + " has dtype code " + std::to_string(code) +
                                           ", which this libpipe does not know (a newer torch.export schema?)");
  out.dtype = *type;
  uint64_t numel = 1;
  bool fixed = true;
  for (const auto& s : meta.value("sizes", Json::array())) {
    Dim d;
    if (s.contains("as_int")) {
      d.size = s["as_int"].get<int64_t>();
      numel *= static_cast<uint64_t>(std::max<int64_t>(d.size, 0));
    } else if (s.contains("as_expr")) {
      fixed = false;
      d.expr = s["as_expr"].value("expr_str", std::string());
      // A plain symbol is written "Symbol('s17', positive=True, integer=True)".
      const std::string head = "Symbol('";
      if (d.expr.compare(0, head.size(), head) == 0) {
        const size_t end = d.expr.find('\'', head.size());
        const std::string tail = end == std::string::npos ? "" : d.expr.substr(end + 1);
        if (end != std::string::npos && tail.find("Symbol(") == std::string::npos &&
            tail.find_first_of("+-*/") == std::string::npos)
          d.symbol = d.expr.substr(head.size(), end - head.size());
      }
    }
    out.sizes.push_back(std::move(d));
  }
  out.nbytes = fixed ? numel * c10::elementSize(out.dtype) : 0;
  return out;
}

std::string where(const Json& node) {
  const Json& metadata = node.contains("metadata") ? node["metadata"] : Json::object();
  const std::string trace = metadata.is_object() ? metadata.value("stack_trace", std::string()) : "";
  // Frames read: File "/path/model.py", line 12, in forward. The innermost frame that is not
  // PyTorch's own code (nn.Linear.forward, the library call of a marker) is the model's line.
  std::string best;
  for (size_t at = trace.find("File \""); at != std::string::npos; at = trace.find("File \"", at + 1)) {
    const size_t file_end = trace.find('"', at + 6);
    if (file_end == std::string::npos) break;
    const std::string file = trace.substr(at + 6, file_end - at - 6);
    const size_t line_at = trace.find("line ", file_end);
    if (line_at == std::string::npos) break;
    const size_t line_end = trace.find_first_not_of("0123456789", line_at + 5);
    const std::string line = trace.substr(line_at + 5, line_end - line_at - 5);
    if (file.find("/torch/") != std::string::npos || file.find("libpipe/marker.py") != std::string::npos) continue;
    best = file + ":" + line;
  }
  if (!best.empty()) return best;
  const std::string target = node.value("target", std::string("?"));
  const auto op = operator_name(target);
  return op.name.empty() ? target : op.name;
}

}  // namespace libpipe::graph::exported
