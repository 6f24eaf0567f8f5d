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

namespace libpipe {

struct PlanRequest {
  std::vector<std::string> split_points;     // "FQN:begin" / "FQN:end" / "FQN@K:end"
  int num_stages = 0;                        // with `policy`; 0 when not asked
  std::string policy;                        // "uniform", "params" or "time"
  std::vector<c10::IValue> example_inputs;   // needed by "time"; give estimates for any plan
};

// Throws Error(InvalidArgument) for a malformed request and Error(Split) when the model cannot be
// cut as asked; each message names the offending split point, policy or count.
std::shared_ptr<const graph::Plan> make_plan(std::shared_ptr<const graph::Program> model, const PlanRequest& request);

// Checks num_stages >= 1 and a known policy name. Throws Error(InvalidArgument).
void validate_stage_request(const PlanRequest& request);

// The intra-op threads each of `num_stages` stages gets by default: its share of the cores.
int default_threads_per_stage(size_t num_stages);

}  // namespace libpipe
