#include "runtime/planner/planner.h"

#include <algorithm>
#include <thread>

#include "runtime/error.h"
#include "runtime/graph/partition.h"
#include "runtime/graph/split_spec.h"
#include "runtime/stage/profile.h"

namespace libpipe {

using graph::Plan;

int default_threads_per_stage(size_t num_stages) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / static_cast<int>(std::max<size_t>(1, num_stages)));
}

namespace {

std::shared_ptr<Plan> by_split_points(const std::shared_ptr<const graph::Program>& model,
                                      const std::vector<std::string>& texts) {
  std::vector<graph::SplitPoint> points;
  for (const auto& t : texts) points.push_back(graph::parse_split_point(t));
  const auto sequence = graph::top_level_sequence(*model);
  const auto cuts = graph::resolve_split_points(*model, sequence, points);
  std::vector<size_t> positions;
  std::vector<std::string> reasons;
  for (const auto& c : cuts) {
    positions.push_back(c.position);
    reasons.push_back(c.reason);
  }
  auto plan = Plan::from_cuts(model, sequence, positions);
  plan->describe_origin("split points", std::move(reasons));
  return plan;
}

std::shared_ptr<Plan> by_policy(const std::shared_ptr<const graph::Program>& model, const PlanRequest& request,
                                PolicyCosts* used) {
  const size_t n = static_cast<size_t>(request.num_stages);
  const auto sequence = graph::top_level_sequence(*model);
  const auto seg = graph::segment(*model, sequence);
  const std::string container = seg.container.empty() ? "the model's top level" : seg.container;
  const std::string policy_name = "policy " + request.policy;

  std::vector<size_t> cuts;
  if (request.policy == "uniform") {
    const size_t layers = seg.layer_starts.size();
    if (n > layers)
      throw Error(Status::Split, "cannot make " + std::to_string(n) + " stages with policy uniform: " + container +
                                     " has " + std::to_string(layers) + " layer" + (layers == 1 ? "" : "s") +
                                     " to share out (ask for at most " + std::to_string(layers) + ")");
    for (size_t k = 1; k < n; ++k) {
      // The allowed cut nearest the wanted layer start (a `with` block may cover the start),
      // after the previous cut.
      const size_t want = seg.layer_starts[k * layers / n];
      size_t best = SIZE_MAX;
      for (size_t c : seg.allowed_cuts) {
        if (!cuts.empty() && c <= cuts.back()) continue;
        const size_t dist = c > want ? c - want : want - c;
        const size_t best_dist = best == SIZE_MAX ? SIZE_MAX : (best > want ? best - want : want - best);
        if (dist < best_dist) best = c;
      }
      if (best == SIZE_MAX)
        throw Error(Status::Split, "cannot place " + std::to_string(n) +
                                       " uniform stages: too few places to cut outside layers and `with` blocks");
      cuts.push_back(best);
    }
  } else {
    std::vector<size_t> bounds = {0};
    bounds.insert(bounds.end(), seg.allowed_cuts.begin(), seg.allowed_cuts.end());
    bounds.push_back(sequence.size());
    std::vector<double> costs;
    if (request.policy == "params") {
      costs = graph::segment_param_bytes(*model, sequence, bounds);
    } else {  // time
      if (request.example_inputs.empty())
        throw Error(Status::InvalidArgument,
                    "policy time measures each part of the model on example inputs; give them "
                    "(pipe split/run --input IN.safetensors, or pipe_plan_options_set_example_inputs)");
      if (bounds.size() - 1 < n)
        throw Error(Status::Split, "cannot make " + std::to_string(n) + " stages: the model has only " +
                                       std::to_string(bounds.size() - 1) + " parts to put stage boundaries between");
      auto parts = Plan::from_cuts(model, sequence, seg.allowed_cuts);
      const int threads = default_threads_per_stage(n);
      costs = stage::time_stages(*parts, request.example_inputs, threads);
      // Each segment's time includes one stage call's fixed cost, which merged segments pay only
      // once. The whole model as one stage tells how much: spread the difference over the extra
      // calls and take it off each segment (never below zero).
      auto whole = Plan::from_cuts(model, sequence, {});
      const double one_stage = stage::time_stages(*whole, request.example_inputs, threads)[0];
      double sum = 0;
      for (double c : costs) sum += c;
      const double per_call = costs.size() > 1 ? std::max(0.0, (sum - one_stage) / double(costs.size() - 1)) : 0.0;
      for (double& c : costs) c = std::max(0.0, c - per_call);
    }
    for (size_t start : graph::min_max_partition(costs, n)) cuts.push_back(bounds[start]);
    if (used) *used = PolicyCosts{std::move(bounds), std::move(costs)};
  }
  auto plan = Plan::from_cuts(model, sequence, cuts);
  std::vector<std::string> reasons(cuts.size(), policy_name + " over the layers of " + container);
  plan->describe_origin(policy_name, std::move(reasons));
  return plan;
}

// Timing needs real weights: a skeleton's stages would run on the meta device and measure nothing.
void require_real_weights(const graph::Program& model, const char* what) {
  if (!model.parameter_without_data().empty())
    throw Error(Status::InvalidArgument, std::string(what) +
                                             " runs the model on the example inputs, but its weights are on the meta "
                                             "device (a skeleton; '" +
                                             model.parameter_without_data() +
                                             "' is one): use policy params or "
                                             "uniform, or time the full model");
}

}  // namespace

std::shared_ptr<const Plan> make_plan(std::shared_ptr<const graph::Program> model, const PlanRequest& request,
                                      PolicyCosts* used) {
  if (used) *used = PolicyCosts{};
  const bool by_points = !request.split_points.empty();
  const bool by_count = request.num_stages != 0 || !request.policy.empty();
  if (by_points && by_count)
    throw Error(Status::InvalidArgument, "give either split points or a stage count with a policy, not both");
  if (by_count) validate_stage_request(request);
  if (by_count && request.policy == "time") require_real_weights(*model, "policy time");
  if (!request.example_inputs.empty()) require_real_weights(*model, "timing stages on example inputs");
  std::shared_ptr<Plan> plan;
  if (by_points) plan = by_split_points(model, request.split_points);
  else if (by_count) plan = by_policy(model, request, used);
  else plan = Plan::from_markers(model);
  if (!request.example_inputs.empty())
    plan->set_estimates(
        stage::time_stages(*plan, request.example_inputs, default_threads_per_stage(plan->num_stages())));
  return plan;
}

}  // namespace libpipe
