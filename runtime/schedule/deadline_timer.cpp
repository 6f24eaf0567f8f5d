#include "runtime/schedule/deadline_timer.h"

#include <algorithm>

namespace libpipe::schedule {

DeadlineTimer::DeadlineTimer() : thread_([this] { loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void DeadlineTimer::watch(const std::shared_ptr<Request>& request) {
  {
    std::lock_guard lock(mutex_);
    if (heap_.size() >= prune_at_) prune();
    heap_.emplace(request->deadline(), request);
  }
  changed_.notify_all();  // it may be earlier than the one the thread sleeps towards
}

void DeadlineTimer::prune() {
  // Calls far from their deadline that finished and were let go would otherwise pile up here.
  std::vector<Entry> live;
  for (; !heap_.empty(); heap_.pop())
    if (!heap_.top().second.expired()) live.push_back(heap_.top());
  heap_ = decltype(heap_)(Later(), std::move(live));
  prune_at_ = std::max<size_t>(1024, 2 * heap_.size());
}

void DeadlineTimer::loop() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (heap_.empty()) {
      changed_.wait(lock);
      continue;
    }
    const auto next = heap_.top().first;
    if (Clock::now() < next) {
      changed_.wait_until(lock, next);  // woken early by a nearer deadline, or stop
      continue;
    }
    std::weak_ptr<Request> due = heap_.top().second;
    heap_.pop();
    // Failing a call runs its callback: never under this lock, which watch() takes.
    lock.unlock();
    if (auto request = due.lock()) request->expire();
    lock.lock();
  }
}

}  // namespace libpipe::schedule
