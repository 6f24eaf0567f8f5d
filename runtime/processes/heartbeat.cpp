#include "runtime/processes/heartbeat.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

namespace libpipe::processes {

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

void mark_failed_in_store(c10d::Store& store, int rank) {
  try {
    store.add(heartbeat_key(rank), kHeartbeatFailed);
  } catch (const std::exception&) {
    // The store is gone: so is every watcher's, and each notices that by itself.
  }
}

struct Heartbeat::State {
  c10::intrusive_ptr<c10d::Store> store;
  milliseconds timeout{0};
  std::mutex mutex;  // guards everything below
  std::condition_variable cv;
  bool stop = false;
  bool failed = false;   // mark_failed: the next beat adds the failed mark and the beating ends
  bool exited = false;   // the beating thread returned
  bool bumping = false;  // a store call is waiting for its answer, asked at `asked`
  Clock::time_point asked;
  std::string error;  // why a store call failed
  // watch_peers: what the beating thread reads after each beat, and what it calls.
  struct Peer {
    int rank = 0;
    bool judged = true;  // false: only its marks count (the driver, which does not beat)
    int64_t count = 0;
    Clock::time_point moved;
    bool gone = false;  // left normally
  };
  std::vector<Peer> peers;
  std::function<void(const std::string&)> peer_failed;
  std::function<void(int)> peer_left;
  bool peer_failure_told = false;
  uint64_t watch_generation = 0;  // counts watch_peers calls: a beat's copy of `peers` is kept only if current

  // What one reading of the peers found, told by the beating thread once its store calls are answered.
  struct Findings {
    std::string failure;
    std::vector<int> left;
  };

  // Reads the watched peers' counters (the beating thread, on its copy, without the lock). Throws what the
  // store throws.
  Findings read_peers(std::vector<Peer>& copy) {
    Findings found;
    for (auto& p : copy) {
      if (p.gone) continue;
      const int64_t v = store->add(heartbeat_key(p.rank), 0);
      const auto now = Clock::now();
      if (v >= kHeartbeatFailed) {
        found.failure = "rank " + std::to_string(p.rank) + " failed (see its log for why)";
        return found;
      }
      if (v >= kHeartbeatLeft) {
        p.gone = true;
        found.left.push_back(p.rank);
      } else if (v != p.count) {
        p.count = v;
        p.moved = now;
      } else if (p.judged && now - p.moved > timeout) {
        found.failure = "rank " + std::to_string(p.rank) + " stopped responding: no heartbeat for " +
                        std::to_string(timeout.count()) + " ms (it died, or it or its host hangs)";
        return found;
      }
    }
    return found;
  }
};

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, milliseconds interval, milliseconds timeout,
                     std::function<void(const std::string&)> lost)
    : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
  state_->timeout = timeout;
  interval = std::max(interval, milliseconds(1));
  // The watcher looks often enough to notice an unanswered bump soon after `timeout`.
  const milliseconds tick = std::clamp(timeout / 8, milliseconds(1), interval);
  // The beating thread owns a share of the state: a bump that a hung store never answers cannot be
  // interrupted, and the destructor leaves such a thread behind rather than wait for it. So it calls the peer
  // callbacks (which may reach its owner's objects) only between store calls and only while not stopped: the
  // destructor leaves a thread behind only while a store call is unanswered, and waits for it otherwise.
  beat_ = std::thread([state = state_, key = heartbeat_key(rank), interval] {
    std::unique_lock lock(state->mutex);
    bool marked_failed = false;
    while (!state->stop) {
      const bool failed = state->failed;
      std::vector<State::Peer> peers = state->peer_failure_told ? std::vector<State::Peer>{} : state->peers;
      const uint64_t generation = state->watch_generation;
      state->bumping = true;
      state->asked = Clock::now();
      lock.unlock();
      std::string error;
      State::Findings found;
      try {
        state->store->add(key, failed ? kHeartbeatFailed : 1);
        if (!failed && !peers.empty()) found = state->read_peers(peers);
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
      if (failed) {
        marked_failed = true;
        break;
      }
      if (state->stop || state->peer_failure_told || generation != state->watch_generation) continue;
      // What was learnt of the peers stays for the next beat (a newly watched list replaces it).
      state->peers = peers;
      if (!found.failure.empty()) state->peer_failure_told = true;
      if (!found.failure.empty() || !found.left.empty()) {
        auto peer_failed = state->peer_failed;
        auto peer_left = state->peer_left;
        lock.unlock();  // the callbacks may call mark_failed
        for (int peer : found.left)
          if (peer_left) peer_left(peer);
        if (!found.failure.empty() && peer_failed) peer_failed(found.failure);
        lock.lock();
        continue;  // mark_failed may have been called: the next round marks it at once
      }
      state->cv.wait_for(lock, interval, [&] { return state->stop || state->failed; });
    }
    // Stopped: the watchers of this rank stop watching it (best effort; a store that is gone needs no goodbye).
    if (state->stop && state->error.empty() && !marked_failed) {
      const bool failed = state->failed;
      state->bumping = true;
      state->asked = Clock::now();
      lock.unlock();
      try {
        state->store->add(key, failed ? kHeartbeatFailed : kHeartbeatLeft);
      } catch (const std::exception&) {}
      lock.lock();
      state->bumping = false;
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

void Heartbeat::watch_peers(std::vector<int> peers, std::vector<int> marks_only,
                            std::function<void(const std::string&)> failed, std::function<void(int)> left) {
  std::lock_guard lock(state_->mutex);
  state_->peers.clear();
  const auto now = Clock::now();
  for (int r : peers) state_->peers.push_back({r, true, 0, now, false});
  for (int r : marks_only) state_->peers.push_back({r, false, 0, now, false});
  state_->peer_failed = std::move(failed);
  state_->peer_left = std::move(left);
  state_->peer_failure_told = false;
  ++state_->watch_generation;
}

void Heartbeat::mark_failed() {
  {
    std::lock_guard lock(state_->mutex);
    state_->failed = true;
  }
  state_->cv.notify_all();
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_all();
  watch_.join();
  std::unique_lock lock(state_->mutex);
  // A sleeping thread returns at once (after its goodbye); one inside a store call returns when the store
  // answers, unless the store has not answered for the timeout (see State): then it is left behind.
  const auto stuck = [&] { return state_->bumping && Clock::now() - state_->asked >= state_->timeout; };
  while (!state_->exited && !stuck()) state_->cv.wait_for(lock, milliseconds(50));
  const bool exited = state_->exited;
  lock.unlock();
  if (exited) beat_.join();
  else beat_.detach();
}

HeartbeatMonitor::HeartbeatMonitor(c10d::Store& store, int world_size, milliseconds timeout,
                                   bool failed_marks_are_fatal)
    : store_(store),
      timeout_(timeout),
      failed_marks_are_fatal_(failed_marks_are_fatal),
      count_(world_size, 0),
      moved_(world_size, Clock::now()) {
  for (int r = 1; r < world_size; ++r) count_[r] = store_.add(heartbeat_key(r), 0);
  std::fill(moved_.begin(), moved_.end(), Clock::now());
}

std::string HeartbeatMonitor::check() {
  for (size_t r = 1; r < count_.size(); ++r) {
    const int64_t count = store_.add(heartbeat_key(static_cast<int>(r)), 0);
    // Timed from when this thread saw the count, not from when the worker bumped it: a watcher that
    // was itself held up by a loaded machine finds the count moved and blames nobody.
    const auto now = Clock::now();
    if (count >= kHeartbeatFailed) {
      // Over TCP the ring's own connection to that worker tells why, first and better; NCCL's cannot tell.
      if (failed_marks_are_fatal_) return "worker rank " + std::to_string(r) + " failed (its log says why)";
    } else if (count >= kHeartbeatLeft) {
      continue;  // ended normally, having passed the session's end on: silent from now on, and rightly so
    }
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

}  // namespace libpipe::processes
