// DeadlineTimer: fails calls at their deadline by itself, so that a call whose deadline passes
// while a stage holds it (or while it waits in a queue) finishes then and tells its callback and
// eventfd, without anybody waiting on it. One thread per session, started with the first call
// that has a deadline.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/schedule/request.h"

namespace libpipe::schedule {

class DeadlineTimer {
 public:
  DeadlineTimer();
  ~DeadlineTimer();  // stops the thread; calls still watched keep running without a timer
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Fails `request` with Status::DeadlineExceeded once Clock::now() reaches its deadline, unless it
  // finished before. Holds it weakly: a call whose last owner let go is forgotten. Thread-safe.
  void watch(const std::shared_ptr<Request>& request);

 private:
  void loop();
  void prune();  // under mutex_

  using Entry = std::pair<Clock::time_point, std::weak_ptr<Request>>;
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const { return a.first > b.first; }
  };
  std::mutex mutex_;
  std::condition_variable changed_;
  std::priority_queue<Entry, std::vector<Entry>, Later> heap_;  // earliest deadline on top
  size_t prune_at_ = 1024;  // heap size at which entries of destroyed calls are dropped
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace libpipe::schedule
