#include "runtime/graph/exported/input_check.h"

#include <map>

#include "runtime/error.h"

namespace libpipe::graph::exported {

namespace {

std::string shape_text(const TensorMeta& meta) {
  std::string out = "[";
  for (size_t d = 0; d < meta.sizes.size(); ++d) {
    out += d ? ", " : "";
    const Dim& dim = meta.sizes[d];
    out += dim.size >= 0 ? std::to_string(dim.size) : !dim.symbol.empty() ? dim.symbol : dim.expr;
  }
  return out + "]";
}

}  // namespace

void check_inputs(const ExportedModel& model, const std::vector<c10::IValue>& inputs, const std::string& what) {
  const auto& names = model.input_names();
  const auto& metas = model.input_metas();
  const std::string in = what.empty() ? "" : " (" + what + ")";
  if (inputs.size() != metas.size())
    throw Error(Status::Input, "the program takes " + std::to_string(metas.size()) + " inputs but " +
                                   std::to_string(inputs.size()) + " were given" + in);
  // symbol -> (first input and dimension that gave it a size, that size)
  std::map<std::string, std::tuple<std::string, size_t, int64_t>> seen;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = "input '" + names[i] + "'";
    if (!inputs[i].isTensor()) throw Error(Status::Input, name + " is not a tensor" + in);
    const at::Tensor& t = inputs[i].toTensor();
    const TensorMeta& meta = metas[i];
    if (t.scalar_type() != meta.dtype)
      throw Error(Status::Input, name + " has dtype " + c10::toString(t.scalar_type()) +
                                     " but the program was exported for " + c10::toString(meta.dtype) + in +
                                     ": convert it (.to(torch." + python_dtype(meta.dtype) + ")) first");
    if (t.dim() != static_cast<int64_t>(meta.sizes.size()))
      throw Error(Status::Input, name + " has " + std::to_string(t.dim()) + " dimensions " + c10::str(t.sizes()) +
                                     " but the program takes " + std::to_string(meta.sizes.size()) + " " +
                                     shape_text(meta) + in);
    for (size_t d = 0; d < meta.sizes.size(); ++d) {
      const Dim& dim = meta.sizes[d];
      const int64_t got = t.size(static_cast<int64_t>(d));
      const std::string where = name + " has size " + std::to_string(got) + " in dimension " + std::to_string(d);
      if (dim.size >= 0) {
        if (got != dim.size)
          throw Error(Status::Input, where + " but the program was exported with a fixed size of " +
                                         std::to_string(dim.size) + " there " + shape_text(meta) + in +
                                         (d == 0 ? ": export it with a dynamic batch (libpipe.export_program does), "
                                                   "or give it that many rows per micro-batch"
                                                 : ": export it with that dimension dynamic to vary it"));
        continue;
      }
      if (dim.symbol.empty()) continue;  // an expression of symbols: its symbols are checked where they stand alone
      auto range = model.symbol_ranges().find(dim.symbol);
      if (range != model.symbol_ranges().end()) {
        const auto [lo, hi] = range->second;
        if (got < lo || (hi >= 0 && got > hi))
          throw Error(Status::Input, where + " but the program allows " + std::to_string(lo) +
                                         (hi >= 0 ? " to " + std::to_string(hi) : " or more") + " there (" +
                                         dim.symbol + ")" + in);
      }
      auto [it, fresh] = seen.try_emplace(dim.symbol, names[i], d, got);
      if (!fresh && std::get<2>(it->second) != got)
        throw Error(Status::Input, where + " but input '" + std::get<0>(it->second) + "' has " +
                                       std::to_string(std::get<2>(it->second)) + " in dimension " +
                                       std::to_string(std::get<1>(it->second)) +
                                       "; the program takes them equal (both are " + dim.symbol + ")" + in);
    }
  }
}

}  // namespace libpipe::graph::exported
