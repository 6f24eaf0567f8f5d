// Liveness of the processes of a distributed session, apart from their work, in one place for every transport:
// each worker process runs one Heartbeat, which bumps a counter of its own in the driver's rendezvous store at a
// steady pace from a thread that does nothing else, and the driver watches the counters (HeartbeatMonitor). A
// worker that computes one micro-batch for minutes keeps its counter moving; one that was killed or stopped, or
// whose host hangs, does not. The same counter tells the worker that its driver is gone: the store lives in the
// driver.
//
// A transport that cannot notice a dead peer by itself (NCCL: its kernels wait for ever on one machine; a TCP
// connection fails when its peer's process ends) has the Heartbeat watch the other ranks too. Two marks travel
// in the counters for it: a rank that fails adds kFailed (its watchers fail at once, without waiting for the
// timeout), and one that ends normally adds kLeft (its watchers stop watching it). The driver, which does not
// beat (its store is its liveness), marks its own counter failed when its session breaks.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace libpipe::processes {

// How often a worker bumps its counter for a given comm timeout: several beats fit in one
// timeout, so a beat delayed by a loaded machine does not look like a dead worker.
std::chrono::milliseconds heartbeat_interval(std::chrono::milliseconds comm_timeout);

// The store key of a rank's counter.
std::string heartbeat_key(int rank);

// The marks a counter carries beside its beats (a beat adds 1, far below either).
inline constexpr int64_t kHeartbeatLeft = int64_t{1} << 40;
inline constexpr int64_t kHeartbeatFailed = int64_t{1} << 50;

// Marks `rank`'s counter failed (best effort: a store that is gone is ignored). For the driver, whose
// workers may watch its counter (watch_peers).
void mark_failed_in_store(c10d::Store& store, int rank);

// A worker's liveness. Bumps `libpipe/heartbeat/<rank>` every `interval` (heartbeat_interval of the driver's
// comm timeout, which judges the beats) until destroyed, then adds kHeartbeatLeft (or kHeartbeatFailed after
// mark_failed). Calls `lost(why)` once, from its own thread, when a bump fails (the store is gone: the driver
// died) or has not been answered for `timeout` (this worker's comm timeout: the driver is stopped or its host
// hangs); it then stops beating.
class Heartbeat {
 public:
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds interval,
            std::chrono::milliseconds timeout, std::function<void(const std::string&)> lost);
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  // Stops beating; no callback is called afterwards. A bump stuck in a store that never answers cannot be
  // interrupted: its thread is left to end when the store's connection does.
  ~Heartbeat();

  // From the next beat on, also reads the counters of `peers` and `marks_only` at each beat: `failed(why)` once
  // when a counter carries kHeartbeatFailed, or one of `peers` stays still for the timeout (counted from this
  // call); `left(peer)` when one carries kHeartbeatLeft (that peer is watched no more). `marks_only` are judged
  // by their marks alone (the driver, which does not beat). Both are called from the beating thread, never
  // after this object is destroyed.
  void watch_peers(std::vector<int> peers, std::vector<int> marks_only, std::function<void(const std::string&)> failed,
                   std::function<void(int)> left);

  // This rank failed: its next beat adds kHeartbeatFailed, so the peers watching it fail at once, and the
  // beating stops. Callable from any thread, more than once.
  void mark_failed();

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the beating thread, which may outlive this
  std::thread beat_, watch_;
};

// The driver's side: remembers, per worker rank, when its counter last moved.
class HeartbeatMonitor {
 public:
  // Starts the clock of every worker rank 1..world_size-1 now. `failed_marks_are_fatal`: a worker's failed mark
  // breaks the session at once (NCCL, whose transport cannot tell); otherwise it counts as a beat (TCP, whose
  // connection to the worker says why first).
  HeartbeatMonitor(c10d::Store& store, int world_size, std::chrono::milliseconds timeout,
                   bool failed_marks_are_fatal = false);

  // Reads every counter. Empty while each moved within the timeout (or its worker ended normally); otherwise a
  // message naming the first rank that did not (or that marked itself failed, where that is fatal). Throws what
  // the store throws.
  std::string check();

 private:
  c10d::Store& store_;
  const std::chrono::milliseconds timeout_;
  const bool failed_marks_are_fatal_;
  std::vector<int64_t> count_;                                // per rank (0 unused)
  std::vector<std::chrono::steady_clock::time_point> moved_;  // when count_ last changed
};

}  // namespace libpipe::processes
