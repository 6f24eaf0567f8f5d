#include "runtime/planner/plan_request.h"

#include "runtime/error.h"

namespace libpipe {

void validate_stage_request(const PlanRequest& request) {
  if (request.num_stages < 1)
    throw Error(Status::InvalidArgument,
                "the number of stages must be at least 1, got " + std::to_string(request.num_stages));
  if (request.policy != "uniform" && request.policy != "params" && request.policy != "time")
    throw Error(Status::InvalidArgument, "unknown split policy '" + request.policy +
                                             "'; use uniform (equal layers), params (equal parameter "
                                             "bytes) or time (equal measured time)");
}

}  // namespace libpipe
