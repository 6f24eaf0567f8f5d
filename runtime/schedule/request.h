// Request: one call submitted to a session, cut into micro-batches that finish one by one (or
// fail together); and MicroBatch, one of them on its way through the stages with the values that
// cross stage boundaries.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chunk/microbatch.h"
#include "runtime/device/place.h"
#include "runtime/error.h"
#include "runtime/named_tensor.h"
#include "runtime/schedule/stage_sharing.h"

namespace libpipe::processes {
class Ring;
}  // namespace libpipe::processes

namespace libpipe::schedule {

using Clock = std::chrono::steady_clock;

// One submitted call. Thread-safe; outlives its session (a session destroyed with calls in flight
// fails them). A call is finished once every micro-batch ran or it failed (an error, cancel(), its
// deadline); at that moment, and only then, it notifies whoever asked without waiting: a callback
// (on_done) and an eventfd (event_fd), so event loops need no thread parked per call.
class Request {
 public:
  using DoneFn = std::function<void(Status)>;

  // `outputs_on_device`: results stay where the last stage left them (a GPU) instead of coming
  // to the CPU.
  explicit Request(uint64_t id, size_t microbatches, Clock::time_point deadline, bool outputs_on_device = false)
      : id_(id),
        deadline_(deadline),
        outputs_on_device_(outputs_on_device),
        remaining_(microbatches),
        results_(microbatches),
        result_ready_(microbatches) {}
  ~Request();  // closes the eventfd if abandon() did not

  // Waits until the call is finished or `until` passes; true if finished. A call still running
  // at its deadline fails then with Status::DeadlineExceeded.
  bool wait_until(Clock::time_point until);
  // Stops the call: micro-batches not yet run are dropped, and it fails with Status::Cancelled.
  void cancel();
  // Waits until none of the call's micro-batches is queued or running (they finish or are
  // dropped), after which nothing reads the call's inputs any more.
  void drain();
  // The merged outputs; throws the call's Error if it failed. Waits for the call to finish, and
  // for the GPU work that writes the results. GPU outputs are handed to the calling thread's
  // current streams (their memory is not reused before the caller's kernels have read it).
  std::vector<NamedTensor> result(const std::vector<chunk::OutputSpec>& specs);
  // The result of a call of one micro-batch (Session::submit_step) as the last stage returned it, on the CPU
  // unless the session keeps outputs on the device; throws the call's Error if it failed. Waits for the call.
  c10::IValue take_single();

  // Calls `fn(status)` once, when the call finishes (Status::Ok when every micro-batch ran): at
  // once on this thread if it already has, otherwise on the thread that finishes it, never while
  // this request's lock is held. False (and `fn` is dropped) if a callback was set before.
  bool on_done(DoneFn fn);
  // A Linux eventfd, created on the first call, that becomes readable when the call finishes and
  // stays so (it is written once and never read here). Owned by the request. Throws Error(Io) if
  // the system has no descriptor left.
  int event_fd();
  // The owner lets go (the C ABI's pipe_request_destroy): cancels an unfinished call, so its
  // callback runs now on this thread; waits until a callback running on another thread returned;
  // closes the eventfd. Afterwards no callback runs and nothing writes the descriptor.
  void abandon();
  // Fails the call with Status::DeadlineExceeded if it is still running (the session's deadline
  // timer calls this once the deadline has passed).
  void expire();

  uint64_t id() const { return id_; }
  bool failed();
  Clock::time_point deadline() const { return deadline_; }

 private:
  friend class Session;
  friend class processes::Ring;
  void fail(Status status, const std::string& why);
  void finish_one();
  bool finished_locked() const { return failed_ || remaining_ == 0; }
  // Under mutex_ (held by `lock`) when the call has just finished: the first time only, makes the
  // eventfd readable and runs the callback, with the lock released while it runs.
  void notify_finished(std::unique_lock<std::mutex>& lock);
  void run_callback(std::unique_lock<std::mutex>& lock, DoneFn fn);

  const uint64_t id_;
  const Clock::time_point deadline_;
  const bool outputs_on_device_;
  std::mutex mutex_;
  std::condition_variable done_;
  size_t remaining_;
  std::vector<c10::IValue> results_;                       // one per micro-batch, written by the last stage
  std::vector<std::shared_ptr<c10::Event>> result_ready_;  // per micro-batch: GPU work writing it
  bool failed_ = false;
  Status status_ = Status::Ok;
  std::string message_;
  bool merged_ = false;
  std::vector<NamedTensor> outputs_;
  // Completion notices (on_done, event_fd).
  bool notified_ = false;      // finished and told so: the callback and eventfd see it once
  bool callback_set_ = false;  // one on_done per request, even after its callback ran
  DoneFn callback_;            // waiting for the call to finish
  bool callback_running_ = false;
  std::thread::id callback_thread_;
  std::condition_variable callback_returned_;
  int event_fd_ = -1;
};

// One micro-batch of a request in flight: the stages read and extend its environment of
// crossing values.
struct MicroBatch {
  std::shared_ptr<Request> request;
  size_t index = 0;
  std::vector<c10::IValue> env;  // indexed by crossing-value id
  // GPU work the values wait for: the caller's pending work on its GPU inputs, and per stage the
  // work it queued for this micro-batch (empty while no GPU stage has run it).
  device::Ready input_ready;
  std::vector<std::shared_ptr<c10::Event>> stage_ready;
  // Within this process: the next stage to run it, and what stage sharing (stage_sharing.h) knows of it.
  size_t next_stage = 0;
  StageSharing::Ticket ticket;
  // A generation engine's step that GPU stages may replay as a CUDA graph (stage/graphed_stage.h).
  bool graphable = false;
  // The events a stage reading values from `producers` (stage indices, -1 the caller) waits for.
  device::Ready ready_for(const std::vector<int>& producers) const;
  // Everything the micro-batch waits for (before it leaves the process).
  device::Ready ready_all() const;
};

}  // namespace libpipe::schedule
