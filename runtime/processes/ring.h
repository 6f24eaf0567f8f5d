// Ring: the way through the worker processes of a distributed session. Micro-batches that leave
// this process's last stage go to a sender thread, travel through the workers' stages, and come
// back to a receiver thread as a result or an error; a watchdog breaks the ring when a worker's
// heartbeat (heartbeat.h) stops for the comm timeout, whether or not it holds work: a worker may
// compute one micro-batch for as long as it takes. A broken ring fails every call the workers held
// and every call after it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/device/place.h"
#include "runtime/schedule/bounded_queue.h"
#include "runtime/schedule/request.h"
#include "runtime/processes/worker_group.h"

namespace libpipe::processes {

class Ring {
 public:
  // Finishes one micro-batch of a request that left the pipeline (status Ok: it did not fail).
  using Retire = std::function<void(const std::shared_ptr<schedule::Request>&, Status, const std::string&)>;

  // Starts the sender, receiver and watchdog over `group`, whose workers are connected and loaded.
  // `capacity` bounds the micro-batches waiting to be sent; once the owner sets `shutting_down`,
  // micro-batches that reach the sender are cancelled instead of sent. The sender brings what
  // travels to `transport_place` first (the CPU for Gloo, the GPU for NCCL).
  Ring(std::unique_ptr<WorkerGroup> group, size_t capacity, std::chrono::milliseconds comm_timeout,
       const std::atomic<bool>& shutting_down, device::Place transport_place, Retire retire);
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  // Stops the ring if stop() was not called.
  ~Ring();

  // Hands a micro-batch that left the last local stage to the workers; false once the ring stops.
  bool push(schedule::MicroBatch mb) { return outbound_.push(std::move(mb)); }
  // Empty while the ring works; why it broke once it did.
  std::string broken() const;
  // Once the local stages have stopped: ends the workers (a Shutdown that each worker passes on
  // after everything it holds), then the threads; fails whatever the workers still held. Waits
  // as long as the workers take to finish what they hold, as the local stages do, since the
  // watchdog goes on breaking the ring as soon as a worker's heartbeat stops.
  void stop();

 private:
  void sender_loop();
  void receiver_loop();
  void watchdog_loop();
  void break_ring(const std::string& why);  // fails every call the workers hold

  std::unique_ptr<WorkerGroup> group_;
  const std::chrono::milliseconds comm_timeout_;
  const std::atomic<bool>& shutting_down_;
  device::Place transport_place_;  // used by the sender thread only
  const Retire retire_;
  schedule::BoundedQueue<schedule::MicroBatch> outbound_;
  std::thread sender_, receiver_, watchdog_;
  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  std::map<std::pair<uint64_t, size_t>, std::shared_ptr<schedule::Request>> remote_;  // with the workers
  std::string broken_;
  bool closed_ = false;  // the Shutdown came back: every worker has finished
  bool stop_watchdog_ = false;
  bool stopped_ = false;
};

}  // namespace libpipe::processes
