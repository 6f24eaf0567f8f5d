// Measures how long each stage of a plan takes on example inputs: the "time" split policy and the
// per-stage estimates a plan reports come from here.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

#include "runtime/graph/plan.h"

namespace libpipe::stage {

// Builds every stage and runs them one after another on `inputs` (forward's arguments), twice to
// warm up (TorchScript's profiling executor optimises on the first calls) and then `repeats`
// times, on one thread with `threads` intra-op threads (the share a stage gets in a session).
// Returns each stage's fastest time in milliseconds: on a shared machine the fastest run is the
// one least disturbed by other work, and the most repeatable statistic. Throws Error(Input) for
// inputs the model does not take and Error(Execution) if a stage raises.
std::vector<double> time_stages(const graph::Plan& plan, const std::vector<c10::IValue>& inputs, int threads,
                                int repeats = 15);

}  // namespace libpipe::stage
