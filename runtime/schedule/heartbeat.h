// Liveness of the processes of a distributed session, apart from their work: each worker bumps a
// counter of its own in the driver's rendezvous store at a steady pace from a thread that does
// nothing else, and the driver watches the counters. A worker that computes one micro-batch for
// minutes keeps its counter moving; one that was killed or stopped, or whose host hangs, does not.
// The same counter tells the worker that its driver is gone: the store lives in the driver.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace libpipe::schedule {

// How often a worker bumps its counter for a given comm timeout: several beats fit in one
// timeout, so a beat delayed by a loaded machine does not look like a dead worker.
std::chrono::milliseconds heartbeat_interval(std::chrono::milliseconds comm_timeout);

// A worker's side. Bumps `libpipe/heartbeat/<rank>` every `interval` (heartbeat_interval of the
// driver's comm timeout, which judges the beats) until destroyed. Calls `lost(why)` once, from its
// own thread, when a bump fails (the store is gone: the driver died) or has not been answered for
// `timeout` (this worker's comm timeout: the driver is stopped or its host hangs); it then stops
// beating.
class HeartbeatSender {
 public:
  HeartbeatSender(c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds interval,
                  std::chrono::milliseconds timeout, std::function<void(const std::string&)> lost);
  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;
  // Stops beating; `lost` is not called afterwards. A bump stuck in a store that never answers
  // cannot be interrupted: its thread is left to end when the store's connection does.
  ~HeartbeatSender();

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the beating thread, which may outlive this
  std::thread beat_, watch_;
};

// The driver's side: remembers, per worker rank, when its counter last moved.
class HeartbeatMonitor {
 public:
  // Starts the clock of every worker rank 1..world_size-1 now.
  HeartbeatMonitor(c10d::Store& store, int world_size, std::chrono::milliseconds timeout);

  // Reads every counter. Empty while each moved within the timeout; otherwise a message naming
  // the first rank that did not. Throws what the store throws.
  std::string check();

 private:
  c10d::Store& store_;
  const std::chrono::milliseconds timeout_;
  std::vector<int64_t> count_;                                // per rank (0 unused)
  std::vector<std::chrono::steady_clock::time_point> moved_;  // when count_ last changed
};

// The store key of a rank's counter.
std::string heartbeat_key(int rank);

}  // namespace libpipe::schedule
