// Split points by module path, as PyTorch's SplitPoint.BEGINNING / END: "FQN:begin" cuts just
// before a module call, "FQN:end" just after it. A module called more than once gives one cut per
// call; "FQN@K:begin" / "FQN@K:end" selects the K-th call (0-based) alone.
#pragma once

#include <string>
#include <vector>

#include "runtime/graph/program.h"

namespace libpipe::graph {

struct SplitPoint {
  std::string text;  // as given, for messages
  std::string path;  // module path, "layers.3"
  int call = -1;     // which call of the module; -1: every call
  bool begin = false;
};

// Throws Error(InvalidArgument) with the expected syntax for anything malformed.
SplitPoint parse_split_point(const std::string& text);

// A cut before position `position` of the top-level sequence, and the split point behind it.
struct Cut {
  size_t position;
  std::string reason;  // "layers.0:end (call 0)", "pipe::split() marker", "policy params"
};

// Resolves split points to cuts in `sequence` (the model's top-level nodes, as
// top_level_sequence() returns them). Throws Error(Split) naming the split point for an unknown
// module (with the nearest existing paths), a module never called by forward, a call inside an
// if/loop block, a cut inside a `with` block that is not grad-mode, or a cut that would leave a
// stage empty.
std::vector<Cut> resolve_split_points(const Program& model, const std::vector<size_t>& sequence,
                                      const std::vector<SplitPoint>& points);

// Module paths of `model` closest to `path` by edit distance, best first.
std::vector<std::string> nearest_module_paths(const Program& model, const std::string& path, size_t count);

// Position ranges [start, end) of each call site's nodes in `sequence`; {0, 0} for a call site with
// no top-level node (called inside a block).
std::vector<std::pair<size_t, size_t>> call_site_ranges(const Program& model, const std::vector<size_t>& sequence);

// For each position p of `sequence`, the `with` block (its ContextEnter node) a cut before p would
// fall inside, or nullptr.
std::vector<const ProgramNode*> open_contexts(const Program& model, const std::vector<size_t>& sequence);

}  // namespace libpipe::graph
