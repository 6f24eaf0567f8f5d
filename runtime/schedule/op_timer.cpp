#include "runtime/schedule/op_timer.h"

#include <chrono>
#include <cstring>
#include <memory>

namespace libpipe::schedule {

namespace {

using Clock = std::chrono::steady_clock;

thread_local OpTimer* t_timer = nullptr;
thread_local int t_depth = 0;  // operators open on this thread: only depth 0 is timed

struct OpContext : at::ObserverContext {
  bool top = false;
  std::string key;
  Clock::time_point start;
};

// "aten::linear [out x in]": the weight's shape tells a model's linear layers apart. What RecordFunction records as a
// boxed call's inputs is a window of the caller's stack that need not line up with the arguments (the TorchScript
// interpreter leaves out a trailing None and the window then starts one value early), so the weight is found as the
// last 2-d tensor: in aten::linear(input, weight, bias) nothing after the weight is 2-d. pipe::panel_linear(input,
// panels, bias, out_features, in_features) ends with the shape itself; pipe::panel_linear_group(input, panels,
// biases, out_features, in_features) with the list of outputs and the shared input size: "[96x80+40x80]".
std::string op_key(const at::RecordFunction& fn) {
  std::string key = fn.name();
  const auto inputs = fn.inputs();
  if (key == "pipe::panel_linear_group") {
    if (inputs.size() >= 2 && inputs[inputs.size() - 1].isInt() && inputs[inputs.size() - 2].isIntList()) {
      const std::string in = std::to_string(inputs[inputs.size() - 1].toInt());
      std::string shapes;
      for (int64_t out : inputs[inputs.size() - 2].toIntVector())
        shapes += (shapes.empty() ? "" : "+") + std::to_string(out) + "x" + in;
      return key + " [" + shapes + "]";
    }
    return key;
  }
  if (key == "pipe::panel_linear") {
    if (inputs.size() >= 2 && inputs[inputs.size() - 1].isInt() && inputs[inputs.size() - 2].isInt())
      return key + " [" + std::to_string(inputs[inputs.size() - 2].toInt()) + "x" +
             std::to_string(inputs[inputs.size() - 1].toInt()) + "]";
    return key;
  }
  if (key != "aten::linear") return key;
  for (size_t i = inputs.size(); i-- > 0;)
    if (inputs[i].isTensor() && inputs[i].toTensor().dim() == 2) {
      const at::Tensor& w = inputs[i].toTensor();
      return key + " [" + std::to_string(w.size(0)) + "x" + std::to_string(w.size(1)) + "]";
    }
  return key;
}

}  // namespace

struct OpTimerObserver {
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
    auto ctx = std::make_unique<OpContext>();
    ctx->top = t_depth++ == 0;
    if (ctx->top) {
      ctx->key = op_key(fn);
      ctx->start = Clock::now();
    }
    return ctx;
  }

  static void end(const at::RecordFunction&, at::ObserverContext* context) {
    --t_depth;
    auto* ctx = static_cast<OpContext*>(context);
    if (!ctx || !ctx->top || !t_timer) return;
    t_timer->add(ctx->key, std::chrono::duration<double, std::micro>(Clock::now() - ctx->start).count());
  }
};

OpTimer::OpTimer() {
  t_timer = this;
  t_depth = 0;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&OpTimerObserver::start, &OpTimerObserver::end)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
}

OpTimer::~OpTimer() {
  at::removeCallback(handle_);
  t_timer = nullptr;
  t_depth = 0;
}

void OpTimer::add(const std::string& key, double us) {
  // A stage has a few dozen distinct keys: a linear search beats hashing each call's key.
  for (auto& [k, total] : totals_)
    if (k == key) {
      total += us;
      return;
    }
  totals_.emplace_back(key, us);
}

}  // namespace libpipe::schedule
