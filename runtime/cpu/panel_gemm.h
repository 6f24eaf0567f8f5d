// Products of a few rows by a weight held in the layout the kernels read: panels of 64 output features.
//
// A decode step multiplies a handful of rows (one per sequence) by every weight of the model, so its
// time is the time to stream the weights from memory: the kernel must read each weight byte once, in
// long sequential runs, with every core (bench/RESULTS.md, "Linear layers of few rows"). aten::linear
// re-packs the weight on each call for MKL (a second pass over it) and MKL's packed form costs a second
// copy of the weights. Here the weight is stored once, already in the kernel's layout:
//
//   float32 / float16:  panel b holds outputs 64b .. 64b+63, as [K][64]   (k major, 64 outputs per k)
//   bfloat16:           panel b as [K/2][64][2]: each output's k and k+1 side by side, the operand
//                       layout of AVX-512 BF16's VDPBF16PS (a pair of products per lane)
//   int8:               panel b as [K][64] of signed 8-bit weights, one float32 scale per output feature
//                       beside them (weight = scale * q, symmetric): a quarter of float32's bytes to stream.
//                       The rows are float32 (a bfloat16 caller converts its few rows first); each int8
//                       weight is widened to float32 in registers, so accumulation is float32 as for the others.
//
// A tail panel (N not a multiple of 64) is zero-padded, and K is padded to even for bfloat16. The
// micro-kernel broadcasts one input element per row and multiplies it into four 16-wide output vectors,
// so a row of one output panel costs 4 loads for any number of rows: one row streams the weight at the
// memory's speed, 6 rows at once reuse each load 6 times (compute-bound from ~16 rows).
//
// Work is cut in units of 16 output features, so that two threads share even a 576-wide layer
// evenly; each unit's results come from one thread in one order of summation, so results never depend
// on how units were spread over threads. Accumulation is in float32 for every weight type.
//
// Plain C++ over raw pointers: the kernels are built with AVX-512 flags in a file of their own and
// chosen at run time (cpu_has_*); nothing here calls them on a CPU without AVX-512.
#pragma once

#include <cstdint>

namespace libpipe::cpu {

enum class WeightType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3 };

constexpr int64_t kPanelWidth = 64;  // output features per panel
constexpr int64_t kUnitWidth = 16;   // output features per unit of work (one 512-bit vector of float32)

// What this CPU runs: the kernels need AVX-512 F/BW/VL/DQ; bfloat16 may use VDPBF16PS where the CPU has
// AVX-512 BF16 (bf16_uses_dot_product), and converts pairs to float32 otherwise.
bool cpu_has_panel_kernels();
bool cpu_has_avx512_bf16();

// How a product streams its weights; every variant gives the same bits (the bfloat16 kernels add the products
// in the same order, VDPBF16PS's, and a product of two bfloat16 values is exact in float32). Which runs is
// measured per process (kernel_choice.h).
struct KernelVariant {
  bool native_bf16 = false;  // bfloat16 by VDPBF16PS (needs AVX-512 BF16), else pairs converted to float32
  bool prefetch = false;     // software prefetches ahead of the panel stream
};

// Elements (of the weight's type) of the panels of an [n, k] weight.
int64_t panel_elements(WeightType type, int64_t n, int64_t k);
// K as stored (padded to even for bfloat16).
int64_t panel_depth(WeightType type, int64_t k);

// Writes weight [n, k] (row-major, `type`'s element size) as panels into `dst`, which holds
// panel_elements(type, n, k) elements. Panels [panel_begin, panel_end) only, so that packing a large
// weight can be shared between threads.
void pack_panels(WeightType type, const void* weight, int64_t n, int64_t k, void* dst, int64_t panel_begin,
                 int64_t panel_end);

// Row `row` of the original weight, read back from the panels into dst[k] (an embedding lookup on a
// head tied to the embedding, which is stored only as panels).
void unpack_row(WeightType type, const void* panels, int64_t n, int64_t k, int64_t row, void* dst);

struct PanelProduct {
  WeightType type = WeightType::kFloat32;
  const void* x = nullptr;  // [m, k] rows, `type`'s element type (float32 for int8), row stride ldx elements
  int64_t ldx = 0;
  const void* panels = nullptr;   // pack_panels' output for [n, k]
  const float* scales = nullptr;  // int8: [n], each output feature's scale
  const void* bias = nullptr;     // [n] of `type` (float32 for int8), or null
  void* out = nullptr;            // [m, n] of `type` (float32 for int8), row stride ldo elements
  int64_t ldo = 0;
  int64_t m = 0, n = 0, k = 0;
};

// Units of 16 output features in a product of n outputs.
inline int64_t panel_units(int64_t n) { return (n + kUnitWidth - 1) / kUnitWidth; }

// Computes outputs of units [unit_begin, unit_end) for every row: out = x * weight^T + bias, with the variant
// KernelChoice picks (timing it while it measures). Requires cpu_has_panel_kernels(); for bfloat16, k's
// padding column of x is never read.
void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end);

}  // namespace libpipe::cpu
