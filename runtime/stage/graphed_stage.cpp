#include "runtime/stage/graphed_stage.h"

#include <ATen/ATen.h>

#include <sstream>

#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::stage {

namespace {

thread_local bool graphable_call = false;

// A copy of `value` in memory of its own: a tensor cloned, a tuple's tensors cloned, anything else as it is.
c10::IValue own_copy(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().clone();
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : value.toTupleRef().elements()) items.push_back(own_copy(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return value;
}

}  // namespace

GraphableCall::GraphableCall(bool graphable) : before_(graphable_call) { graphable_call = graphable; }
GraphableCall::~GraphableCall() { graphable_call = before_; }
bool GraphableCall::active() { return graphable_call; }

GraphedStage::GraphedStage(std::unique_ptr<Stage> stage, std::function<device::StepGraphFactory()> graphs,
                           std::string who, size_t max_graphs)
    : stage_(std::move(stage)), make_factory_(std::move(graphs)), who_(std::move(who)), max_graphs_(max_graphs) {}

std::string GraphedStage::shape_of(const std::vector<c10::IValue>& inputs) {
  std::ostringstream key;
  for (const auto& v : inputs) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      key << 'T' << static_cast<int>(t.scalar_type()) << '@' << t.device() << t.sizes();
    } else if (v.isInt()) {
      key << 'i' << v.toInt();
    } else if (v.isDouble()) {
      key << 'd' << v.toDouble();
    } else if (v.isBool()) {
      key << 'b' << v.toBool();
    } else if (v.isNone()) {
      key << 'n';
    } else {
      return "";
    }
    key << ';';
  }
  return key.str();
}

c10::IValue GraphedStage::forward(std::vector<c10::IValue> inputs) {
  if (!GraphableCall::active() || unavailable_) return stage_->forward(std::move(inputs));
  const std::string key = shape_of(inputs);
  if (key.empty()) return stage_->forward(std::move(inputs));
  auto it = recordings_.find(key);
  if (it == recordings_.end()) {
    if (recordings_.size() >= max_graphs_) return stage_->forward(std::move(inputs));
    if (!factory_) {
      try {
        factory_ = make_factory_();
      } catch (const Error& e) {
        unavailable_ = true;
        log::info(who_ + " runs without CUDA graphs: " + e.what());
        return stage_->forward(std::move(inputs));
      }
    }
    it = recordings_.emplace(key, Recording{}).first;
    try {
      return record(it->second, std::move(inputs));
    } catch (...) {
      recordings_.erase(it);  // the call failed (its input, say): a later one of this shape tries again
      throw;
    }
  }
  Recording& r = it->second;
  if (!r.graph) return stage_->forward(std::move(inputs));
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].isTensor()) r.inputs[i].toTensor().copy_(inputs[i].toTensor(), /*non_blocking=*/true);
  r.graph->replay();
  ++replays_;
  return own_copy(r.outputs);
}

c10::IValue GraphedStage::record(Recording& r, std::vector<c10::IValue> inputs) {
  // The recorded inputs: tensors of the graph's own, which later calls fill.
  for (const auto& v : inputs) r.inputs.push_back(own_copy(v));
  c10::IValue result;
  for (int i = 0; i < kWarmups; ++i) result = stage_->forward(r.inputs);
  try {
    auto graph = factory_();
    graph->capture([&] { r.outputs = stage_->forward(r.inputs); });
    r.graph = std::move(graph);
    ++recorded_;
    log::debug(who_ + " recorded a CUDA graph for calls of shape " + shape_of(inputs));
  } catch (const std::exception& e) {
    // The step waits for the GPU or reads a value on the host somewhere: such calls run as they are. The first such
    // shape is told at info level (a user expecting graphs learns why there are none), the others at debug.
    r.outputs = c10::IValue();
    r.inputs.clear();
    const std::string why = who_ + " cannot record calls of shape " + shape_of(inputs) +
                            " as a CUDA graph (they run as they are): " + e.what();
    if (told_unrecordable_) log::debug(why);
    else log::info(why);
    told_unrecordable_ = true;
  }
  // The warm-ups' last result is this call's (a graph's capture runs nothing).
  return own_copy(result);
}

}  // namespace libpipe::stage
