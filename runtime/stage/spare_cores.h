// Cores a CPU stage may borrow while the other stages of its session are idle.
//
// A session on a machine with as many cores as CPU stages gives each stage one thread. When fewer
// steps are in flight than there are stages (one sequence decoding: the stages take turns), the
// cores of the idle stages sit unused, and a decode step, which streams every weight from memory
// once, runs at one core's memory bandwidth. SpareCores lends those cores: a stage's operator
// splits its work into chunks (pipe::panel_linear: the output features of a layer), and helper
// threads take chunks while fewer stages are busy than the session has cores. Chunks are short
// (a fraction of a millisecond): a helper leaves a job between two chunks once every core has a busy
// stage again, so it holds a core a stage wants for at most one chunk.
//
// Why not OpenMP (more intra-op threads per stage): libgomp spins only briefly when it manages more
// threads than there are cores, which it then always does (every stage thread has its own team), so
// its workers sleep between two layers and each layer pays their wake-up; measured no faster than
// one thread. Helpers here spin for a while after each job, and only the session's stages use them.
//
// Results never depend on whether a chunk ran on a helper: callers split their work the same way
// either way, and each chunk is computed by one thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace libpipe::stage {

class SpareCores {
 public:
  // `cores`: how many threads the session's stages may compute on at once (its stage threads
  // included); cores - 1 helper threads are started.
  explicit SpareCores(int cores);
  ~SpareCores();
  SpareCores(const SpareCores&) = delete;
  SpareCores& operator=(const SpareCores&) = delete;

  int cores() const { return cores_; }

  // False where LIBPIPE_SPARE_CORES=0 says not to lend (for comparisons).
  static bool enabled();

  // Runs fn(i) for every i in [0, count) exactly once, on the calling thread and on the spare
  // cores of the pool lent to this thread (Lend), if any: helpers join only while fewer of the
  // session's stages are busy (Busy) than it has cores, and only one caller at a time gets them.
  // Without a lent pool or spare core, runs them all here, in order. Returns when every fn(i)
  // has returned; rethrows the first exception one threw.
  static void for_each(int64_t count, const std::function<void(int64_t)>& fn);

  // The cores of the pool lent to the calling thread (Lend), 0 when none is: how many pieces a
  // caller should cut its work into, at least, so that every core may take one.
  static int lent_cores();

  // Runs fn(begin, end) over contiguous ranges that cover [0, count) once: on the cores lent to this
  // thread (pieces of at most `max_piece` and at least `grain`, one per core at least when there are enough),
  // else on the calling thread's intra-op threads (at::parallel_for, pieces of at least `grain`), else here in
  // one piece.
  static void for_ranges(int64_t count, int64_t grain, int64_t max_piece,
                         const std::function<void(int64_t, int64_t)>& fn);

  // At most this many bytes are read per call of warm.
  static constexpr size_t kWarmBytes = size_t{4} << 20;
  // What warm reads: tensors in order. Shared and never changed once posted, so that a post costs one reference
  // count, and the tensors stay alive while a helper reads them.
  using WarmList = std::shared_ptr<const std::vector<at::Tensor>>;

  // Asks an idle helper of the pool lent to the calling thread to read `tensors` (in order, up to kWarmBytes) into
  // the caches while it waits for the next job. Why: one sequence's decode step streams every weight from memory,
  // and between two products the calling core computes for a while (norms, attention, the TorchScript
  // interpreter: a quarter of a small model's step) with the memory bus idle; reading the next products' first
  // weights in that gap moves their traffic out of the products' time. A helper stops at a job and goes on after
  // it, stops for good at the next warm call (whose tensors usually continue where it stopped), and leaves the
  // core when a stage wants it; nothing is computed from what it reads, so no result can change. No-op without a
  // lent pool or a spare core, or where LIBPIPE_WARM_AHEAD=0.
  static void warm(WarmList tensors);
  // Whether warm does anything, for every pool of the process (LIBPIPE_WARM_AHEAD=0 sets false at start).
  static void set_warm_ahead(bool on);
  static bool warm_ahead();
  // Bytes this pool's helpers have read ahead (warm) since it started.
  uint64_t read_ahead_bytes() const { return read_ahead_bytes_.load(std::memory_order_relaxed); }

  // Lends `pool` (may be null: nothing lent) to the calling thread for the scope.
  class Lend {
   public:
    explicit Lend(SpareCores* pool);
    ~Lend();
    Lend(const Lend&) = delete;
    Lend& operator=(const Lend&) = delete;

   private:
    SpareCores* previous_;
  };

  // How many micro-batches the session's pipeline holds: with as many as it has cores, every stage
  // has work or soon will, and nothing is lent.
  void set_pipeline_load(int64_t microbatches) { load_.store(microbatches, std::memory_order_relaxed); }

  // Counts the calling stage thread as busy (computing) for the scope; null pool: no-op.
  class Busy {
   public:
    explicit Busy(SpareCores* pool) : pool_(pool) {
      if (pool_) pool_->busy_.fetch_add(1, std::memory_order_relaxed);
    }
    ~Busy() {
      if (pool_) pool_->busy_.fetch_sub(1, std::memory_order_relaxed);
    }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    SpareCores* pool_;
  };

 private:
  void run(int64_t count, const std::function<void(int64_t)>& fn);
  void helper_loop();
  void post_warm(WarmList tensors);
  // Reads the posted tensors (the helper's side of warm) until they end or the helper is wanted elsewhere.
  void read_ahead(uint64_t generation);
  // Takes and runs indices of job `generation` until none is left (a helper: or until every core
  // has a busy stage again, or the job is over).
  void work(uint64_t generation, bool helper);

  const int cores_;
  // Threads that need a core of their own now: busy stages, or the micro-batches in the pipeline.
  int claimed() const {
    return static_cast<int>(
        std::max<int64_t>(busy_.load(std::memory_order_relaxed), load_.load(std::memory_order_relaxed)));
  }

  std::atomic<int> busy_{0};
  std::atomic<int64_t> load_{0};
  std::atomic<bool> taken_{false};  // a caller holds the helpers

  // The current job, written by its caller before it publishes next_ (release). Indices are handed
  // out lock-free: next_ packs the job's generation (high 32 bits) with the next index (low 32), so a
  // helper that is late for a job can never take an index of the next one (its compare-exchange
  // fails once the next job has reset next_; a job cannot end while one of its indices is untaken).
  std::atomic<const std::function<void(int64_t)>*> job_{nullptr};
  std::atomic<int64_t> count_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> joinable_{0};  // helpers that may still join the current job
  std::mutex error_mutex_;
  std::exception_ptr error_;  // guarded by error_mutex_

  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> generation_{0};  // bumped per job: helpers spin on it before sleeping
  std::vector<std::thread> helpers_;

  // The tensors of the latest warm call, taken by one helper.
  std::mutex warm_mutex_;
  WarmList warm_tensors_;  // guarded by warm_mutex_
  std::atomic<bool> warm_posted_{false};
  std::atomic<uint64_t> read_ahead_bytes_{0};
  // Where the helper stopped reading in the latest tensors: the next call's list starts at the next product, and
  // what lies before this point was read.
  const void* frontier_data_ = nullptr;  // guarded by warm_mutex_
  size_t frontier_offset_ = 0;           // guarded by warm_mutex_
};

}  // namespace libpipe::stage
