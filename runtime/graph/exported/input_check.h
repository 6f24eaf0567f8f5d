// What LibTorch's runtime for exported programs does not check, libpipe does, before a call runs:
// nativert validates nothing (a wrong dtype or size surfaces as some kernel's error deep in a stage,
// or, where the kernel accepts it, as a wrong result). A call, and each of its micro-batches, is
// checked against the program's record of its inputs: their count, dtypes, ranks, fixed sizes, and
// every symbolic size within its range and equal wherever the program uses the same symbol.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "runtime/graph/exported/model.h"

namespace libpipe::graph::exported {

// Throws Error(Input) naming the input, the dimension, what it got and what the program takes (and
// how to export it to take that). `what` says what is checked in messages ("micro-batch 2 of 4"; empty
// for a whole call).
void check_inputs(const ExportedModel& model, const std::vector<c10::IValue>& inputs, const std::string& what = "");

}  // namespace libpipe::graph::exported
