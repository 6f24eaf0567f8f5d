#include "runtime/stage/preamble_split.h"

#include <algorithm>
#include <map>

#include "runtime/error.h"
#include "runtime/graph/partition.h"
#include "runtime/log.h"

namespace libpipe::stage {

namespace {

std::vector<c10::IValue> gather(const std::vector<c10::IValue>& values, const std::vector<size_t>& from) {
  std::vector<c10::IValue> out;
  out.reserve(from.size());
  for (size_t i : from) out.push_back(values[i]);
  return out;
}

void append_results(std::vector<c10::IValue>& values, const c10::IValue& tuple, size_t count) {
  const auto& items = tuple.toTupleRef().elements();
  if (items.size() != count)
    throw Error(Status::Internal, "a part of the first stage gave " + std::to_string(items.size()) +
                                      " values where its plan says " + std::to_string(count));
  values.insert(values.end(), items.begin(), items.end());
}

}  // namespace

std::unique_ptr<Stage> PreambleSplitStage::build(
    const graph::Plan& plan, const BuildOptions& build,
    const std::function<std::unique_ptr<Stage>(std::unique_ptr<Stage>)>& wrap_body) {
  const graph::StagePlan& first = plan.stage(0);
  const graph::Program& model = plan.model();
  const std::vector<size_t> sequence = graph::top_level_sequence(model);
  const graph::Segmentation layers = graph::segment(model, sequence);
  if (layers.layer_starts.empty()) return nullptr;
  const size_t start = layers.layer_starts.front();
  if (std::find(layers.allowed_cuts.begin(), layers.allowed_cuts.end(), start) == layers.allowed_cuts.end())
    return nullptr;
  const auto at = std::find(first.nodes.begin(), first.nodes.end(), sequence[start]);
  if (at == first.nodes.end() || at == first.nodes.begin()) return nullptr;

  std::vector<std::vector<size_t>> groups{{first.nodes.begin(), at}, {at, first.nodes.end()}};
  for (size_t s = 1; s < plan.num_stages(); ++s) groups.push_back(plan.stage(s).nodes);
  std::shared_ptr<graph::Plan> cut;
  try {
    cut = graph::Plan::from_groups(plan.shared_model(), std::move(groups));
  } catch (const Error& e) {
    log::debug(std::string("stage 0 stays whole (its preamble cannot be cut off: ") + e.what() + ")");
    return nullptr;
  }

  auto stage = std::unique_ptr<PreambleSplitStage>(new PreambleSplitStage());
  std::map<size_t, size_t> slot;  // program value id -> index among one call's values
  size_t next = 0;
  for (size_t id : first.inputs) slot[plan.values()[id].value] = next++;
  auto args_of = [&](const graph::StagePlan& part) {
    std::vector<size_t> args;
    for (size_t id : part.inputs) {
      auto it = slot.find(cut->values()[id].value);
      if (it == slot.end()) throw Error(Status::Internal, "a part of stage 0 reads a value stage 0 is not given");
      args.push_back(it->second);
    }
    return args;
  };
  stage->preamble_args_ = args_of(cut->stage(0));
  for (size_t id : cut->stage(0).outputs) slot[cut->values()[id].value] = next++;
  stage->preamble_outputs_ = cut->stage(0).outputs.size();
  stage->body_args_ = args_of(cut->stage(1));
  stage->last_ = plan.num_stages() == 1;
  if (!stage->last_) {
    for (size_t id : cut->stage(1).outputs) slot[cut->values()[id].value] = next++;
    stage->body_outputs_ = cut->stage(1).outputs.size();
    for (size_t id : first.outputs) {
      auto it = slot.find(plan.values()[id].value);
      if (it == slot.end()) throw Error(Status::Internal, "stage 0 hands on a value neither of its parts makes");
      stage->results_.push_back(it->second);
    }
  }
  stage->preamble_ = build_stage(*cut, 0, build);
  stage->body_ = wrap_body(build_stage(*cut, 1, build));
  return stage;
}

c10::IValue PreambleSplitStage::forward(std::vector<c10::IValue> inputs) {
  std::vector<c10::IValue> values = std::move(inputs);
  append_results(values, preamble_->forward(gather(values, preamble_args_)), preamble_outputs_);
  c10::IValue out = body_->forward(gather(values, body_args_));
  if (last_) return out;
  append_results(values, out, body_outputs_);
  return c10::ivalue::Tuple::create(gather(values, results_));
}

}  // namespace libpipe::stage
