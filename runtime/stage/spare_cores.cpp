#include "runtime/stage/spare_cores.h"

#include <ATen/Parallel.h>

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
  stopping_.store(true);
  generation_.fetch_add(1);
  { std::lock_guard lock(sleep_mutex_); }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

bool SpareCores::enabled() {
  const char* env = std::getenv("LIBPIPE_SPARE_CORES");
  return !(env && std::strcmp(env, "0") == 0);
}

SpareCores::Lend::Lend(SpareCores* pool) : previous_(lent) { lent = pool; }
SpareCores::Lend::~Lend() { lent = previous_; }

int SpareCores::lent_cores() { return lent ? lent->cores_ : 0; }

namespace {
std::atomic<bool>& warm_ahead_on() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("LIBPIPE_WARM_AHEAD");
    return !(env && std::strcmp(env, "0") == 0);
  }()};
  return on;
}
}  // namespace

void SpareCores::set_warm_ahead(bool on) { warm_ahead_on().store(on, std::memory_order_relaxed); }
bool SpareCores::warm_ahead() { return warm_ahead_on().load(std::memory_order_relaxed); }

void SpareCores::warm(WarmList tensors) {
  if (lent && lent->cores_ > 1 && tensors && !tensors->empty() && warm_ahead()) lent->post_warm(std::move(tensors));
}

void SpareCores::post_warm(WarmList tensors) {
  if (cores_ - std::max(claimed(), 1) <= 0) return;
  {
    std::lock_guard lock(warm_mutex_);
    warm_tensors_.swap(tensors);
  }
  warm_posted_.store(true, std::memory_order_release);
  // The list this one replaced is released here, outside the lock.
}

void SpareCores::read_ahead(uint64_t generation) {
  WarmList held;  // alive while this reads it
  const void* frontier;
  size_t frontier_offset;
  {
    std::lock_guard lock(warm_mutex_);
    if (!warm_posted_.exchange(false, std::memory_order_acquire)) return;
    held = warm_tensors_;
    frontier = frontier_data_;
    frontier_offset = frontier_offset_;
  }
  if (!held) return;
  struct Span {
    const void* data;
    size_t bytes;
  };
  std::vector<Span> spans;
  spans.reserve(held->size());
  for (const at::Tensor& t : *held) spans.push_back({t.data_ptr(), t.nbytes()});
  const size_t count = spans.size();
  // Successive calls post overlapping windows of the same order of products: skip what an earlier window read.
  size_t first = 0, offset = 0, budget = kWarmBytes;
  for (size_t s = 0; s < count; ++s)
    if (spans[s].data == frontier) {
      for (size_t r = 0; r < s; ++r) budget -= std::min(budget, spans[r].bytes);
      first = s;
      offset = std::min(frontier_offset, spans[s].bytes);
      budget -= std::min(budget, offset);
      break;
    }
  constexpr size_t kLine = 64, kBlock = 4096;  // check for other work once per block
  uint64_t sink = 0;
  bool resume = false;  // cut short by a job or a stage: go on after it
  size_t s = first;
  for (; s < count && budget > 0; ++s, offset = 0) {
    const auto* base = static_cast<const char*>(spans[s].data);
    const size_t end = std::min(spans[s].bytes, offset + budget);
    bool cut = false;
    while (offset < end) {
      if (warm_posted_.load(std::memory_order_relaxed)) {
        cut = true;  // newer spans: read those
        break;
      }
      if (generation_.load(std::memory_order_relaxed) != generation || claimed() >= cores_) {
        // A job (attention, a norm shared with this helper) or a stage that wants the core.
        cut = resume = true;
        break;
      }
      const size_t from = offset, stop = std::min(end, offset + kBlock);
      // Independent loads, one per cache line: the core keeps many misses in flight.
      for (; offset < stop; offset += kLine) sink += *reinterpret_cast<const volatile unsigned char*>(base + offset);
      offset = stop;
      budget -= std::min(budget, stop - from);
      read_ahead_bytes_.fetch_add(stop - from, std::memory_order_relaxed);
    }
    if (cut || offset < spans[s].bytes) break;
  }
  {
    std::lock_guard lock(warm_mutex_);
    // Read to the end of the last span: the frontier is that end, which the next window holds.
    const bool all = s == count && count > 0;
    frontier_data_ = all ? spans[count - 1].data : s < count ? spans[s].data : nullptr;
    frontier_offset_ = all ? spans[count - 1].bytes : s < count ? offset : 0;
  }
  if (resume) warm_posted_.store(true, std::memory_order_release);
  static std::atomic<uint64_t> keep{0};  // so that the loads are not dropped
  keep.fetch_add(sink & 1, std::memory_order_relaxed);
}

void SpareCores::for_ranges(int64_t count, int64_t grain, int64_t max_piece,
                            const std::function<void(int64_t, int64_t)>& fn) {
  if (count <= 0) return;
  const int cores = lent_cores();
  if (cores > 1) {
    int64_t pieces = std::min(count, std::max<int64_t>(cores, (count + std::max<int64_t>(max_piece, 1) - 1) /
                                                                  std::max<int64_t>(max_piece, 1)));
    // Work below two grains stays here: handing a microsecond of element-wise work (a one-row silu_mul, a
    // decode step's rotary) to a helper costs more than it saves, and takes the helper off its reading ahead.
    pieces = std::min(pieces, std::max<int64_t>(1, count / std::max<int64_t>(grain, 1)));
    if (pieces <= 1) {
      fn(0, count);
      return;
    }
    for_each(pieces, [&](int64_t p) { fn(p * count / pieces, (p + 1) * count / pieces); });
    return;
  }
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, count, std::max<int64_t>(grain, 1), fn);
    return;
  }
  fn(0, count);
}

void SpareCores::for_each(int64_t count, const std::function<void(int64_t)>& fn) {
  if (lent && count > 1) return lent->run(count, fn);
  for (int64_t i = 0; i < count; ++i) fn(i);
}

void SpareCores::run(int64_t count, const std::function<void(int64_t)>& fn) {
  // The caller's own core is counted in busy_ when it is a stage thread; spare are the rest.
  const int spare = cores_ - std::max(claimed(), 1);
  if (spare <= 0 || count >= (int64_t{1} << 32) || taken_.exchange(true, std::memory_order_acquire)) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  // Only this caller writes the job (taken_), and helpers read it only after the bump below.
  const uint64_t generation = (generation_.load(std::memory_order_relaxed) + 1) & 0xffffffffu;
  job_.store(&fn, std::memory_order_relaxed);
  count_.store(count, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  joinable_.store(spare, std::memory_order_relaxed);
  next_.store(generation << 32, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    {
      std::lock_guard lock(sleep_mutex_);
    }
    wake_.notify_all();
  }
  work(generation, false);
  // Helpers may still run the last indices they took.
  for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
    cpu_relax();
    if (spins % 1024 == 1023) std::this_thread::yield();  // a helper may need this core
  }
  std::exception_ptr error;
  {
    std::lock_guard lock(error_mutex_);
    std::swap(error, error_);
  }
  taken_.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

void SpareCores::work(uint64_t generation, bool helper) {
  for (;;) {
    // A helper leaves the job when every core has a busy stage again: the caller does the rest.
    if (helper && claimed() >= cores_) return;
    uint64_t next = next_.load(std::memory_order_acquire);
    int64_t i;
    const std::function<void(int64_t)>* job;
    do {
      i = static_cast<int64_t>(next & 0xffffffffu);
      if ((next >> 32) != generation || i >= count_.load(std::memory_order_relaxed)) return;
      job = job_.load(std::memory_order_relaxed);
    } while (!next_.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel, std::memory_order_acquire));
    try {
      (*job)(i);
    } catch (...) {
      std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_release);
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
      if (warm_posted_.load(std::memory_order_relaxed)) read_ahead(seen);
      if (spins % 256 == 255 && std::chrono::steady_clock::now() > until) break;
      cpu_relax();
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock lock(sleep_mutex_);
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return stopping_.load() || generation_.load(std::memory_order_seq_cst) != seen; });
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stopping_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    // The job's fields were written before the bump just seen; a job already over (its caller gone)
    // has no index of this generation left, and work() returns at once.
    int joinable = joinable_.load(std::memory_order_relaxed);
    while (joinable > 0 && !joinable_.compare_exchange_weak(joinable, joinable - 1, std::memory_order_acq_rel)) {}
    if (joinable > 0) work(seen & 0xffffffffu, true);
  }
}

}  // namespace libpipe::stage
