#include "runtime/schedule/heartbeat.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

namespace libpipe::schedule {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string short_what(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

std::string heartbeat_key(int rank) { return "libpipe/heartbeat/" + std::to_string(rank); }

milliseconds heartbeat_interval(milliseconds comm_timeout) {
  return std::clamp(comm_timeout / 8, milliseconds(10), milliseconds(1000));
}

struct HeartbeatSender::State {
  c10::intrusive_ptr<c10d::Store> store;
  milliseconds timeout{0};
  std::mutex mutex;  // guards everything below
  std::condition_variable cv;
  bool stop = false;
  bool exited = false;   // the beating thread returned
  bool bumping = false;  // a bump is waiting for the store's answer, asked at `asked`
  Clock::time_point asked;
  std::string error;  // why a bump failed
};

HeartbeatSender::HeartbeatSender(c10::intrusive_ptr<c10d::Store> store, int rank, milliseconds interval,
                                 milliseconds timeout, std::function<void(const std::string&)> lost)
    : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
  state_->timeout = timeout;
  interval = std::max(interval, milliseconds(1));
  // The watcher looks often enough to notice an unanswered bump soon after `timeout`.
  const milliseconds tick = std::clamp(timeout / 8, milliseconds(1), interval);
  // The beating thread owns a share of the state: a bump that a hung store never answers cannot be
  // interrupted, and the destructor leaves such a thread behind rather than wait for it.
  beat_ = std::thread([state = state_, key = heartbeat_key(rank), interval] {
    std::unique_lock lock(state->mutex);
    while (!state->stop) {
      state->bumping = true;
      state->asked = Clock::now();
      lock.unlock();
      std::string error;
      try {
        state->store->add(key, 1);
      } catch (const std::exception& e) {
        error = short_what(e);
        if (error.empty()) error = "the store call failed";
      }
      lock.lock();
      state->bumping = false;
      if (!error.empty()) {
        state->error = error;
        break;
      }
      state->cv.wait_for(lock, interval, [&] { return state->stop; });
    }
    state->exited = true;
    state->cv.notify_all();
  });
  watch_ = std::thread([this, timeout, tick, lost = std::move(lost)] {
    std::string why;
    {
      std::unique_lock lock(state_->mutex);
      for (;;) {
        if (state_->stop) return;
        if (!state_->error.empty()) {
          why = "a heartbeat to the driver's store failed (" + state_->error + "): the driver is gone";
          break;
        }
        if (state_->bumping && Clock::now() - state_->asked >= timeout) {
          why = "the driver's store did not answer a heartbeat for " + std::to_string(timeout.count()) +
                " ms (the comm timeout): the driver was killed or stopped, or its host hangs";
          break;
        }
        state_->cv.wait_for(lock, tick);
      }
    }
    lost(why);
  });
}

HeartbeatSender::~HeartbeatSender() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_all();
  watch_.join();
  std::unique_lock lock(state_->mutex);
  // A sleeping thread returns at once; one inside a bump returns when the store answers, unless the
  // store has not answered for the timeout (see State): then it is left behind.
  const auto stuck = [&] { return state_->bumping && Clock::now() - state_->asked >= state_->timeout; };
  while (!state_->exited && !stuck()) state_->cv.wait_for(lock, milliseconds(50));
  const bool exited = state_->exited;
  lock.unlock();
  if (exited) beat_.join();
  else beat_.detach();
}

HeartbeatMonitor::HeartbeatMonitor(c10d::Store& store, int world_size, milliseconds timeout)
    : store_(store), timeout_(timeout), count_(world_size, 0), moved_(world_size, Clock::now()) {
  for (int r = 1; r < world_size; ++r) count_[r] = store_.add(heartbeat_key(r), 0);
  std::fill(moved_.begin(), moved_.end(), Clock::now());
}

std::string HeartbeatMonitor::check() {
  for (size_t r = 1; r < count_.size(); ++r) {
    const int64_t count = store_.add(heartbeat_key(static_cast<int>(r)), 0);
    // Timed from when this thread saw the count, not from when the worker bumped it: a watcher that
    // was itself held up by a loaded machine finds the count moved and blames nobody.
    const auto now = Clock::now();
    if (count != count_[r]) {
      count_[r] = count;
      moved_[r] = now;
    } else if (now - moved_[r] >= timeout_) {
      return "worker rank " + std::to_string(r) + " sent no heartbeat for " + std::to_string(timeout_.count()) +
             " ms (the comm timeout): it was killed or stopped, or its host hangs";
    }
  }
  return "";
}

}  // namespace libpipe::schedule
