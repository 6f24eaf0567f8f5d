// OpTimer: where a stage's time goes, by operator. While one is alive on a thread, that thread's top-level operators
// (those the TorchScript interpreter calls; what they call in turn counts towards them) are timed through a
// thread-local RecordFunction observer and summed by name. A linear layer's name carries its weight's shape
// ("aten::linear [49152x576]"), so that the layers of a model (attention projections, MLP, the language-model head)
// show apart. What the stage's time holds beyond the operators' sum is the interpreter's own work and the stage's
// glue. Only traces with operators on use it (Session::start_trace): an observer costs about a microsecond per
// operator, which a plain trace should not pay.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>

namespace libpipe::schedule {

class OpTimer {
 public:
  OpTimer();  // starts timing this thread's operators; one timer per thread at a time
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Microseconds per operator key, in the order the keys first appeared.
  const std::vector<std::pair<std::string, double>>& totals() const { return totals_; }

 private:
  friend struct OpTimerObserver;
  void add(const std::string& key, double us);

  std::vector<std::pair<std::string, double>> totals_;
  at::CallbackHandle handle_ = 0;
};

}  // namespace libpipe::schedule
