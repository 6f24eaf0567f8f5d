// Which variant of the panel kernels a process runs, chosen by timing the variants on the products it
// computes.
//
// The fastest way to stream a weight differs between CPUs, and the difference is large: on an Intel Xeon
// with AVX-512 BF16 and AMX, VDPBF16PS streamed a one-row bfloat16 product at 11.7 GB/s per core where
// converting pairs to float32 reached 16.5, and software prefetches took a 4-row float32 product from
// 11.2 to 16.5 GB/s; on an AMD EPYC the same prefetches measured 5-25% slower. A calibration at start-up
// would time a buffer that sits in a large L3 (480 MiB on that Xeon), not in memory as a model's weights
// do, so the variants are timed on the real products instead: per weight type and class of row counts,
// each product piece runs the variants in turn until every one has enough samples, then the one that
// streamed the most weight bytes per second runs from then on. A variant clearly slower than the best
// after a first look (kFirstLook samples each) stops being tried: many-row products are compute-bound,
// where converting bfloat16 pairs to float32 runs at ~0.6x of VDPBF16PS on an AMD EPYC, and trying it 48
// times made the first prompt of a process 25% slower (a 1B model's 128-token prefill 0.71 -> 0.96 s).
// All variants give the same bits (panel_gemm.h), so the choice changes only the speed.
//
// LIBPIPE_PANEL_PREFETCH=0|1 and LIBPIPE_BF16_KERNEL=dot|convert fix a choice instead of measuring it.
#pragma once

#include <cstdint>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu {

class KernelChoice {
 public:
  // Samples of each variant before a class decides.
  static constexpr int kSamples = 48;
  // Samples of each variant after which one slower than the best by kClearlySlower is dropped (and a class
  // with one variant left decides). A piece of a many-row product takes milliseconds; 8 of them summed
  // leave little to noise, and dropping the wrong one costs only speed.
  static constexpr int kFirstLook = 8;
  static constexpr double kClearlySlower = 1.3;

  struct Pick {
    KernelVariant variant;
    int slot = -1;  // >= 0: time the piece and record() it under this slot
  };

  // The process's choices (thread-safe). Tests make their own.
  static KernelChoice& instance();
  KernelChoice();
  ~KernelChoice();
  KernelChoice(const KernelChoice&) = delete;
  KernelChoice& operator=(const KernelChoice&) = delete;

  // The variant for a piece of a product of `rows` rows of `type`.
  Pick pick(WeightType type, int64_t rows);
  // A timed piece: `bytes` of weights streamed in `seconds`.
  void record(WeightType type, int64_t rows, int slot, int64_t bytes, double seconds);

  // The variants measured for `type` (1, 2 or 4), in slot order, and which are fixed by the environment.
  static int variants(WeightType type);
  static KernelVariant variant(WeightType type, int slot);

  // The class of a row count: 1, 2-3, 4-5, 6-11, 12-47, 48 and more.
  static constexpr int kRowClasses = 6;
  static int row_class(int64_t rows);

  // The slot decided for (type, row class), -1 while still measuring (for tests and reports).
  int decided(WeightType type, int row_class) const;

 private:
  struct Class;
  Class& of(WeightType type, int64_t rows) const;
  Class* classes_;  // [5 weight types][kRowClasses]
};

}  // namespace libpipe::cpu
