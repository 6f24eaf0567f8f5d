#include "runtime/processes/ring.h"

#include <algorithm>

#include "runtime/log.h"
#include "runtime/processes/heartbeat.h"

namespace libpipe::processes {

using schedule::MicroBatch;
using schedule::Request;

Ring::Ring(std::unique_ptr<WorkerGroup> group, size_t capacity, std::chrono::milliseconds comm_timeout,
           const std::atomic<bool>& shutting_down, device::Place transport_place, Retire retire)
    : group_(std::move(group)),
      comm_timeout_(comm_timeout),
      shutting_down_(shutting_down),
      transport_place_(std::move(transport_place)),
      retire_(std::move(retire)),
      outbound_(capacity) {
  sender_ = std::thread([this] { sender_loop(); });
  receiver_ = std::thread([this] { receiver_loop(); });
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

Ring::~Ring() { stop(); }

std::string Ring::broken() const {
  std::lock_guard lock(mutex_);
  return broken_;
}

void Ring::sender_loop() {
  while (auto item = outbound_.pop()) {
    MicroBatch mb = std::move(*item);
    auto request = std::move(mb.request);
    std::string why;
    Status status = Status::Ok;
    if (!request->failed()) {
      try {
        transport_place_.receive(mb.env, mb.ready_all());
      } catch (const c10::Error& e) {
        status = Status::Execution;
        why = "could not bring micro-batch " + std::to_string(mb.index) + " to " + transport_place_.device().str() +
              " for the transport: " + e.what_without_backtrace();
      }
    }
    if (status == Status::Ok) {
      std::lock_guard lock(mutex_);
      if (!broken_.empty()) {
        status = Status::Communication;
        why = "the session is broken: " + broken_;
      } else if (shutting_down_) {
        status = Status::Cancelled;
        why = "the session was destroyed while the call was running";
      } else if (!request->failed()) {
        remote_[{request->id(), mb.index}] = request;
      }
    }
    if (status != Status::Ok || request->failed()) {
      retire_(request, status, why);
      continue;
    }
    comm::Message m{comm::Kind::Data, request->id(), mb.index, 0, std::move(mb.env), {}};
    try {
      group_->send(m);
    } catch (const std::exception& e) {
      break_ring(e.what());
    }
  }
  // Closed by stop() once the local stages stopped: tell the workers to finish.
  if (broken().empty()) {
    try {
      group_->send(comm::control(comm::Kind::Shutdown));
    } catch (const std::exception& e) {
      break_ring(e.what());
    }
  }
}

void Ring::receiver_loop() {
  for (;;) {
    comm::Message m;
    try {
      m = group_->receive();
    } catch (const std::exception& e) {
      break_ring(e.what());
      return;
    }
    std::shared_ptr<Request> request;
    {
      std::lock_guard lock(mutex_);
      if (m.kind == comm::Kind::Shutdown) {
        closed_ = true;
        cv_.notify_all();
        return;
      }
      auto it = remote_.find({m.request, static_cast<size_t>(m.microbatch)});
      if (it == remote_.end()) continue;  // already failed when the session broke
      request = std::move(it->second);
      remote_.erase(it);
    }
    if (m.kind == comm::Kind::Result && m.values.size() == 1) {
      // A result received on a GPU (NCCL) is ordered after this thread's current stream there.
      if (device::holds_gpu_tensor(m.values[0]))
        request->result_ready_.at(m.microbatch) = device::mark_current(transport_place_.device());
      request->results_.at(m.microbatch) = std::move(m.values[0]);
      retire_(request, Status::Ok, "");
    } else if (m.kind == comm::Kind::Error) {
      retire_(request, static_cast<Status>(m.status), m.text);
    } else {
      retire_(request, Status::Internal,
              "a worker answered with message kind " + std::to_string(static_cast<int>(m.kind)));
    }
  }
}

void Ring::watchdog_loop() {
  // The counters are read often enough that a worker is failed soon after its timeout passes.
  const auto tick = std::clamp<std::chrono::milliseconds>(comm_timeout_ / 20, std::chrono::milliseconds(5),
                                                          std::chrono::milliseconds(200));
  std::unique_ptr<HeartbeatMonitor> monitor;
  std::unique_lock lock(mutex_);
  while (!stop_watchdog_) {
    cv_.wait_for(lock, tick);
    if (stop_watchdog_ || !broken_.empty() || closed_) continue;
    // The store is not read under the lock: the threads that move calls along never wait for it.
    lock.unlock();
    std::string why;
    try {
      if (!monitor)
        monitor = std::make_unique<HeartbeatMonitor>(group_->store(), group_->world_size(), comm_timeout_,
                                                     /*failed_marks_are_fatal=*/group_->nccl());
      else why = monitor->check();
    } catch (const c10::Error& e) {
      why = std::string("the workers' heartbeats could not be read from the store: ") + e.what_without_backtrace();
    } catch (const std::exception& e) {
      why = std::string("the workers' heartbeats could not be read from the store: ") + e.what();
    }
    if (!why.empty()) break_ring(why);
    lock.lock();
  }
}

void Ring::break_ring(const std::string& why) {
  std::map<std::pair<uint64_t, size_t>, std::shared_ptr<Request>> held;
  {
    std::lock_guard lock(mutex_);
    if (!broken_.empty() || closed_) return;
    broken_ = why;
    held.swap(remote_);
    cv_.notify_all();
  }
  // Info, not error: every call it fails says why, and a caller's one-line error report stays one line.
  log::info("the session is broken: " + why);
  group_->fail(why);
  for (auto& [key, request] : held) retire_(request, Status::Communication, why);
}

void Ring::stop() {
  if (stopped_) return;
  stopped_ = true;
  // The local stages have stopped: whatever reaches the sender now is dropped, then it sends the
  // Shutdown, which each worker passes on after everything it holds.
  outbound_.close();
  sender_.join();
  {
    // No time limit: a worker may hold a long micro-batch, and one that dies or hangs stops its
    // heartbeat, so the watchdog breaks the ring.
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return closed_ || !broken_.empty(); });
  }
  group_->abort("the session was destroyed");
  receiver_.join();
  {
    std::lock_guard lock(mutex_);
    stop_watchdog_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  std::map<std::pair<uint64_t, size_t>, std::shared_ptr<Request>> held;
  {
    std::lock_guard lock(mutex_);
    held.swap(remote_);
  }
  for (auto& [key, request] : held)
    retire_(request, Status::Cancelled, "the session was destroyed while the call was running");
  group_.reset();
}

}  // namespace libpipe::processes
