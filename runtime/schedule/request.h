// Request: one call submitted to a session, cut into micro-batches that finish one by one (or
// fail together); and MicroBatch, one of them on its way through the stages with the values that
// cross stage boundaries.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/chunk/microbatch.h"
#include "runtime/error.h"
#include "runtime/named_tensor.h"

namespace libpipe::schedule {

using Clock = std::chrono::steady_clock;

// One submitted call. Thread-safe; outlives its session (a session destroyed with calls in flight
// fails them).
class Request {
 public:
  explicit Request(uint64_t id, size_t microbatches, Clock::time_point deadline)
      : id_(id), deadline_(deadline), remaining_(microbatches), results_(microbatches) {}

  // Waits until the call is finished or `until` passes; true if finished. A call still running
  // at its deadline fails then with Status::DeadlineExceeded.
  bool wait_until(Clock::time_point until);
  // Stops the call: micro-batches not yet run are dropped, and it fails with Status::Cancelled.
  void cancel();
  // Waits until none of the call's micro-batches is queued or running (they finish or are
  // dropped), after which nothing reads the call's inputs any more.
  void drain();
  // The merged outputs; throws the call's Error if it failed. Waits for the call to finish.
  std::vector<NamedTensor> result(const std::vector<chunk::OutputSpec>& specs);

  uint64_t id() const { return id_; }
  bool failed();
  Clock::time_point deadline() const { return deadline_; }

 private:
  friend class Session;
  friend class Ring;
  void fail(Status status, const std::string& why);
  void finish_one();
  bool finished_locked() const { return failed_ || remaining_ == 0; }

  const uint64_t id_;
  const Clock::time_point deadline_;
  std::mutex mutex_;
  std::condition_variable done_;
  size_t remaining_;
  std::vector<c10::IValue> results_;  // one per micro-batch, written by the last stage
  bool failed_ = false;
  Status status_ = Status::Ok;
  std::string message_;
  bool merged_ = false;
  std::vector<NamedTensor> outputs_;
};

// One micro-batch of a request in flight: the stages read and extend its environment of
// crossing values.
struct MicroBatch {
  std::shared_ptr<Request> request;
  size_t index = 0;
  std::vector<c10::IValue> env;  // indexed by crossing-value id
};

}  // namespace libpipe::schedule
