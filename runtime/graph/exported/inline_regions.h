// Higher-order operators of a torch.export program, settled when the program is loaded rather than when a
// stage is built.
//
// torch.export keeps a region of a model that changes a mode as a higher-order operator around a subgraph:
// `with torch.no_grad()` or a `@torch.no_grad()` method (transformers' rotary embeddings) exported in grad mode
// becomes wrap_with_set_grad_enabled, `with torch.autocast(...)` wrap_with_autocast. LibTorch's runtime for
// exported programs (nativert) runs only cond, while_loop and run_const_graph, and refuses the rest when a
// stage is created. A stage runs under inference mode, where grad mode has no effect, so a set_grad_enabled
// region is inlined into its graph, as is an autocast region: a disabled one as it is, one that is on (for the
// cpu or cuda device type) with autocast's casts made explicit, so its stages compute what the model computes
// under autocast. Any other higher-order operator nativert cannot run is refused here, at load, naming it and
// where it came from.
#pragma once

#include <string>

#include "runtime/graph/exported/program_json.h"

namespace libpipe::graph::exported {

// Inlines in `graph` (a serialized Graph: nodes, inputs, outputs, tensor_values, ...) and in the subgraphs of
// the operators kept (cond's branches, while_loop's body), renaming the inlined values apart from the
// graph's own. Throws Error(Unsupported) naming `path`, the operator and the line of model code for one
// that cannot run, and Error(InvalidFormat) for a region whose subgraph does not match its call.
void inline_regions(Json& graph, const std::string& path);

}  // namespace libpipe::graph::exported
