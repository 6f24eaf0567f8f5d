#include "runtime/graph/torchscript/split_marker.h"

#include <torch/library.h>

namespace libpipe::graph {

void register_split_marker() {
  static const bool once = [] {
    // A host process may already have registered the schema (for example a Python process that
    // defined it for tracing); then the op exists and nothing is to be done.
    if (c10::Dispatcher::singleton().findSchema({"pipe::split", ""}).has_value()) return true;
    // Registered on first use rather than by a static TORCH_LIBRARY block, so that the check
    // above can run first; the registration lives as long as the process.
    static torch::Library lib(torch::Library::DEF, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::split() -> ()", c10::AliasAnalysisKind::CONSERVATIVE), [] {});
    return true;
  }();
  (void)once;
}

c10::Symbol split_marker_kind() { return c10::Symbol::fromQualString("pipe::split"); }

}  // namespace libpipe::graph
