#include "runtime/schedule/request.h"

#include <c10/core/InferenceMode.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace libpipe::schedule {

Request::~Request() {
  if (event_fd_ >= 0) ::close(event_fd_);
}

void Request::fail(Status status, const std::string& why) {
  std::unique_lock lock(mutex_);
  if (failed_ || remaining_ == 0) return;  // the first failure is the one reported
  failed_ = true;
  status_ = status;
  message_ = why;
  done_.notify_all();
  notify_finished(lock);
}

void Request::finish_one() {
  std::unique_lock lock(mutex_);
  if (remaining_ > 0 && --remaining_ == 0) {
    done_.notify_all();
    notify_finished(lock);  // nothing new if the call failed before
  }
}

void Request::expire() { fail(Status::DeadlineExceeded, "the call did not finish before its deadline"); }

void Request::notify_finished(std::unique_lock<std::mutex>& lock) {
  if (notified_) return;
  notified_ = true;
  if (event_fd_ >= 0) {
    const uint64_t one = 1;
    // Cannot block or overflow: the counter goes from 0 to 1 once and nobody reads it.
    [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof one);
  }
  if (callback_) run_callback(lock, std::exchange(callback_, nullptr));
}

void Request::run_callback(std::unique_lock<std::mutex>& lock, DoneFn fn) {
  // Unlocked while it runs: the callback may look at the request (a C caller's pipe_request_wait
  // from another thread that it signals, say) without deadlocking on this lock.
  callback_running_ = true;
  callback_thread_ = std::this_thread::get_id();
  const Status status = status_;
  lock.unlock();
  fn(status);
  fn = nullptr;  // what it captured goes before abandon() may return
  lock.lock();
  callback_running_ = false;
  callback_returned_.notify_all();
}

bool Request::on_done(DoneFn fn) {
  std::unique_lock lock(mutex_);
  if (callback_set_) return false;
  callback_set_ = true;
  if (notified_) run_callback(lock, std::move(fn));
  else callback_ = std::move(fn);
  return true;
}

int Request::event_fd() {
  std::lock_guard lock(mutex_);
  if (event_fd_ < 0) {
    event_fd_ = ::eventfd(notified_ ? 1 : 0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0)
      throw Error(Status::Io, std::string("cannot create the call's event descriptor (eventfd: ") +
                                  std::strerror(errno) + "); close descriptors or raise the process's limit");
  }
  return event_fd_;
}

void Request::abandon() {
  cancel();  // a call still running finishes now, and its callback runs here
  std::unique_lock lock(mutex_);
  // A callback on this very thread is the one abandon() is called from (which the C ABI forbids):
  // waiting for it would wait forever.
  callback_returned_.wait(lock, [&] { return !callback_running_ || callback_thread_ == std::this_thread::get_id(); });
  callback_ = nullptr;
  if (event_fd_ >= 0) {
    ::close(event_fd_);
    event_fd_ = -1;
  }
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
    notify_finished(lock);
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

c10::IValue Request::take_single() {
  wait_until(Clock::time_point::max());
  std::lock_guard lock(mutex_);
  if (failed_) throw Error(status_, message_);
  if (results_.size() != 1)
    throw Error(Status::Internal, "take_single() on a call of " + std::to_string(results_.size()) + " micro-batches");
  c10::InferenceMode inference;
  device::wait(result_ready_);
  if (outputs_on_device_) {
    device::lend_to_current_streams(results_[0]);
  } else {
    device::Place cpu;
    cpu.receive(results_, {});
  }
  return std::move(results_[0]);
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
