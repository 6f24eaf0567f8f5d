// libFuzzer target: split-point syntax ("FQN:begin", "FQN@K:end") and the plan request's
// policy and stage-count validation, the text users type on the command line or pass through
// the C ABI. Refusals must be libpipe's Error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/error.h"
#include "runtime/graph/split_spec.h"
#include "runtime/planner/plan_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    libpipe::graph::parse_split_point(text);
  } catch (const libpipe::Error&) {}
  try {
    libpipe::PlanRequest request;
    request.num_stages = size > 0 ? static_cast<int8_t>(data[0]) : 0;
    request.policy = size > 0 ? text.substr(1) : text;
    libpipe::validate_stage_request(request);
  } catch (const libpipe::Error&) {}
  return 0;
}
