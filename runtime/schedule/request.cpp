#include "runtime/schedule/request.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>

namespace libpipe::schedule {

void Request::fail(Status status, const std::string& why) {
  std::lock_guard lock(mutex_);
  if (failed_ || remaining_ == 0) return;  // the first failure is the one reported
  failed_ = true;
  status_ = status;
  message_ = why;
  done_.notify_all();
}

void Request::finish_one() {
  std::lock_guard lock(mutex_);
  if (remaining_ > 0 && --remaining_ == 0) done_.notify_all();
}

bool Request::failed() {
  std::lock_guard lock(mutex_);
  return failed_;
}

void Request::cancel() { fail(Status::Cancelled, "the call was cancelled"); }

void Request::drain() {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return remaining_ == 0; });
}

bool Request::wait_until(Clock::time_point until) {
  std::unique_lock lock(mutex_);
  const auto limit = std::min(until, deadline_);
  done_.wait_until(lock, limit, [&] { return finished_locked(); });
  if (finished_locked()) return true;
  if (Clock::now() >= deadline_) {
    failed_ = true;
    status_ = Status::DeadlineExceeded;
    message_ = "the call did not finish before its deadline";
    done_.notify_all();
    return true;
  }
  return false;
}

std::vector<NamedTensor> Request::result(const std::vector<chunk::OutputSpec>& specs) {
  wait_until(Clock::time_point::max());
  std::lock_guard lock(mutex_);
  if (failed_) throw Error(status_, message_);
  if (!merged_) {
    c10::InferenceMode inference;
    device::wait(result_ready_);
    if (outputs_on_device_) {
      for (const auto& r : results_) device::lend_to_current_streams(r);
    } else {
      // Results that reached this process on a GPU (through NCCL) still come down.
      device::Place cpu;
      cpu.receive(results_, {});
    }
    outputs_ = chunk::merge_outputs(results_, specs);
    results_.clear();
    merged_ = true;
  }
  return outputs_;
}

device::Ready MicroBatch::ready_for(const std::vector<int>& producers) const {
  device::Ready ready;
  for (int p : producers) {
    if (p < 0) ready.insert(ready.end(), input_ready.begin(), input_ready.end());
    else if (static_cast<size_t>(p) < stage_ready.size() && stage_ready[p]) ready.push_back(stage_ready[p]);
  }
  return ready;
}

device::Ready MicroBatch::ready_all() const {
  device::Ready ready = input_ready;
  for (const auto& e : stage_ready)
    if (e) ready.push_back(e);
  return ready;
}

}  // namespace libpipe::schedule
