// The split marker op `pipe::split() -> ()`. Model authors call it in forward to mark a stage
// boundary (torch.ops.pipe.split() after registering the same schema in Python). Its alias
// analysis is CONSERVATIVE, so TorchScript treats it as having side effects and dead-code
// elimination keeps it in traced and scripted graphs.
#pragma once

#include <ATen/core/interned_strings.h>

namespace libpipe::graph {

// Idempotent. Must run before loading a model that contains markers.
void register_split_marker();

// The node kind of the marker in a TorchScript graph.
c10::Symbol split_marker_kind();

}  // namespace libpipe::graph
