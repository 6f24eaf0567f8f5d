// The planner: turns what the user asked for (pipe::split() markers, split points by module path,
// or a stage count with a balancing policy) into a Plan, measuring stage times on example inputs
// when they are given. It sits above runtime/graph (the split rules) and runtime/stage (which
// builds and times stages).
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/graph/plan.h"
#include "runtime/planner/plan_request.h"

namespace libpipe {

// What a "params" or "time" policy shared out among the stages: the model's parts (part i is
// positions [bounds[i], bounds[i+1]) of graph::top_level_sequence()) and each part's cost by the
// policy's measure (bytes, or ms less the per-call overhead). The stages are the min-max
// partition of `costs`; reported so that a test can check that against brute force.
struct PolicyCosts {
  std::vector<size_t> bounds;
  std::vector<double> costs;
};

// Throws Error(InvalidArgument) for a malformed request and Error(Split) when the model cannot be
// cut as asked; each message names the offending split point, policy or count. With `used`, a
// balancing policy also reports there what it cut by (left empty for other requests).
std::shared_ptr<const graph::Plan> make_plan(std::shared_ptr<const graph::Program> model, const PlanRequest& request,
                                             PolicyCosts* used = nullptr);

// The intra-op threads each of `num_stages` stages gets by default: its share of the cores.
int default_threads_per_stage(size_t num_stages);

}  // namespace libpipe
