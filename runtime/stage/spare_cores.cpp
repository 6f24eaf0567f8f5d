#include "runtime/stage/spare_cores.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace libpipe::stage {

namespace {

// How long a helper spins for the next job before it sleeps. A decode step calls the next linear
// layer within tens to hundreds of microseconds; waking a sleeping thread costs about as much.
constexpr std::chrono::microseconds kSpin{2000};

thread_local SpareCores* lent = nullptr;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

SpareCores::SpareCores(int cores) : cores_(cores < 1 ? 1 : cores) {
  for (int i = 1; i < cores_; ++i) helpers_.emplace_back([this] { helper_loop(); });
}

SpareCores::~SpareCores() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  generation_.fetch_add(1, std::memory_order_release);
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

bool SpareCores::enabled() {
  const char* env = std::getenv("LIBPIPE_SPARE_CORES");
  return !(env && std::strcmp(env, "0") == 0);
}

SpareCores::Lend::Lend(SpareCores* pool) : previous_(lent) { lent = pool; }
SpareCores::Lend::~Lend() { lent = previous_; }

void SpareCores::for_each(int64_t count, const std::function<void(int64_t)>& fn) {
  if (lent && count > 1) return lent->run(count, fn);
  for (int64_t i = 0; i < count; ++i) fn(i);
}

void SpareCores::run(int64_t count, const std::function<void(int64_t)>& fn) {
  // The caller's own core is counted in busy_ when it is a stage thread; spare are the rest.
  const int spare = cores_ - std::max(claimed(), 1);
  if (spare <= 0 || taken_.exchange(true, std::memory_order_acquire)) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::unique_lock lock(mutex_);
  job_ = &fn;
  count_ = count;
  next_ = done_ = 0;
  error_ = nullptr;
  joinable_ = spare;
  done_seen_.store(0, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  if (sleeping_ > 0) wake_.notify_all();
  work(lock, false);
  lock.unlock();
  // Helpers may still run the last indices they took.
  for (int spins = 0; done_seen_.load(std::memory_order_acquire) < count; ++spins) {
    cpu_relax();
    if (spins % 1024 == 1023) std::this_thread::yield();  // a helper may need this core
  }
  lock.lock();
  job_ = nullptr;  // a helper that wakes late finds nothing to take
  std::exception_ptr error = error_;
  error_ = nullptr;
  lock.unlock();
  taken_.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

void SpareCores::work(std::unique_lock<std::mutex>& lock, bool helper) {
  while (job_ && next_ < count_) {
    // A helper leaves the job when every core has a busy stage again: the caller does the rest.
    if (helper && claimed() >= cores_) return;
    const int64_t i = next_++;
    const auto* fn = job_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*fn)(i);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    done_seen_.store(++done_, std::memory_order_release);
  }
}

void SpareCores::helper_loop() {
  // Not the current generation: a job may have been posted before this thread ran.
  uint64_t seen = 0;
  for (;;) {
    // Spin while a stage may soon ask again, that is while a core is spare; else sleep at once,
    // so that a spinning helper never takes the core of a busy stage.
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
      if (claimed() >= cores_) break;
      if (spins % 256 == 255 && std::chrono::steady_clock::now() > until) break;
      cpu_relax();
    }
    std::unique_lock lock(mutex_);
    if (!stopping_ && generation_.load(std::memory_order_relaxed) == seen) {
      ++sleeping_;
      wake_.wait(lock, [&] { return stopping_ || generation_.load(std::memory_order_relaxed) != seen; });
      --sleeping_;
    }
    if (stopping_) return;
    seen = generation_.load(std::memory_order_relaxed);
    if (joinable_ > 0) {
      --joinable_;
      work(lock, true);
    }
  }
}

}  // namespace libpipe::stage
