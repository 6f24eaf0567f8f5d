// What a caller asks the planner for (markers, split points by module path, or a stage count with a
// balancing policy), and the checks of a stage count and policy that need no model: its own file, so that
// what checks requests alone (the split-point fuzz target) need not link the planner's stage building.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace libpipe {

struct PlanRequest {
  std::vector<std::string> split_points;    // "FQN:begin" / "FQN:end" / "FQN@K:end"
  int num_stages = 0;                       // with `policy`; 0 when not asked
  std::string policy;                       // "uniform", "params" or "time"
  std::vector<c10::IValue> example_inputs;  // needed by "time"; give estimates for any plan
};

// Checks num_stages >= 1 and a known policy name. Throws Error(InvalidArgument).
void validate_stage_request(const PlanRequest& request);

}  // namespace libpipe
