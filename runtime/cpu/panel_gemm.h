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
//   int8:               signed 8-bit codes q in [-127, 127], one float32 scale per output feature beside the panels
//                       (weight = scale * q, symmetric): a quarter of float32's bytes to stream. K is padded to a
//                       multiple of 32 with zero codes; panel b is K/4 steps of 256 bytes, one per 4 consecutive k:
//                       four 64-byte vectors, vector j for outputs 16j .. 16j+15, each 32-bit lane one output's 4
//                       codes (byte t for k = 4s+t), stored as q + 128 (0 .. 255): the unsigned operand of VPDPBUSD.
//                       The rows are quantized as int4's are (below: quantize_rows, int8 per block of 32 k), and
//                       the kernel's int32 sums per block, less 128 x the block's sum of row codes, go to float32 as
//                       scale_x * sum, accumulated over K and multiplied by the output's scale at the end. Without
//                       AVX512-VNNI each code is split into its low 7 bits and its top bit (VPMADDUBSW would
//                       saturate at 2 x 255 x 127 per 16-bit pair), which VPMADDUBSW + VPMADDWD multiply exactly:
//                       the same integer sums, the same bits. Why integers: widening each code to float32 made the
//                       kernel compute-bound from a few rows (one FMA per 16 products against VPDPBUSD's 64).
//   int4:               4-bit codes q in [-8, 7] with a float16 scale per (group of G k, output feature), weight =
//                       scale * q (quantize_int4 in panel_linear.h; G = 32, 64 or 128, K padded to a multiple of
//                       G with zero codes). Panel b is, per group of G k: the group's 64 scales (128 bytes), then
//                       G/8 steps of 256 bytes, one per 8 consecutive k: four 64-byte vectors, vector j for
//                       outputs 16j .. 16j+15, each 32-bit lane one output's 8 codes as nibbles, byte t of the
//                       lane holding k = 8s+t in its low nibble and k = 8s+4+t in its high one, stored as
//                       q + 8 (0 .. 15). So 4.5 bits per weight at G = 32 (llama.cpp's Q4_0 holds as many).
//                       The rows are quantized too, to int8 per block of 32 k (quantize_rows: a float32 scale,
//                       the block's largest magnitude at 127, and the sum of the block's codes), and the
//                       kernel takes integer dot products: an AND and a shift+AND unpack a vector into two
//                       operands of VPDPBUSD (unsigned 8-bit weight x signed 8-bit row, four products per
//                       32-bit lane), whose int32 sums per block of 32, less 8 x the block's sum of row codes
//                       (the +8 of the storage), go to float32 as scale_w * scale_x * sum. Without AVX512-VNNI
//                       VPMADDUBSW + VPMADDWD compute the same integer sums (at most 15 x 127 x 2 per 16-bit
//                       pair: no saturation), so both give the same bits. Why integers: widening nibbles to
//                       float32 takes ~20 instructions per 32 bytes of weights, compute-bound below the
//                       memory's speed at one row.
//
// A tail panel (N not a multiple of 64) is zero-padded, and K is padded to even for bfloat16. The float
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

enum class WeightType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kInt4 = 4 };

constexpr int64_t kPanelWidth = 64;  // output features per panel
constexpr int64_t kUnitWidth = 16;   // output features per unit of work (one 512-bit vector of float32)

// What this CPU runs: the kernels need AVX-512 F/BW/VL/DQ; bfloat16 may use VDPBF16PS where the CPU has
// AVX-512 BF16 (bf16_uses_dot_product), and converts pairs to float32 otherwise.
bool cpu_has_panel_kernels();
bool cpu_has_avx512_bf16();
// AVX512-VNNI's VPDPBUSD for the int4 kernel (LIBPIPE_CPU_ISA=avx512 pretends the CPU lacks it too).
bool cpu_has_avx512_vnni();

// How a product streams its weights; every variant gives the same bits (the bfloat16 kernels add the products
// in the same order, VDPBF16PS's, and a product of two bfloat16 values is exact in float32). Which runs is
// measured per process (kernel_choice.h).
struct KernelVariant {
  bool native_bf16 = false;  // bfloat16 by VDPBF16PS (needs AVX-512 BF16), else pairs converted to float32
  bool prefetch = false;     // software prefetches ahead of the panel stream
  bool vnni = false;         // int4 by VPDPBUSD (needs AVX512-VNNI), else VPMADDUBSW + VPMADDWD: the same sums
};

// Elements (of the weight's type) of the panels of an [n, k] weight (not int4: int4_panel_bytes).
int64_t panel_elements(WeightType type, int64_t n, int64_t k);
// K as stored (padded to even for bfloat16, to a multiple of 32 for int8).
int64_t panel_depth(WeightType type, int64_t k);

// Writes weight [n, k] (row-major, `type`'s element size) as panels into `dst`, which holds
// panel_elements(type, n, k) elements. Panels [panel_begin, panel_end) only, so that packing a large
// weight can be shared between threads.
void pack_panels(WeightType type, const void* weight, int64_t n, int64_t k, void* dst, int64_t panel_begin,
                 int64_t panel_end);

// Row `row` of the original weight, read back from the panels into dst[k] (an embedding lookup on a
// head tied to the embedding, which is stored only as panels).
void unpack_row(WeightType type, const void* panels, int64_t n, int64_t k, int64_t row, void* dst);

// int4 panels (layout above): K as stored (padded to a multiple of `group`), and the bytes of an [n, k] weight's
// panels.
constexpr int64_t kInt4RowBlock = 32;  // k per block of a row's int8 codes (quantize_rows)
inline int64_t int4_depth(int64_t k, int64_t group) { return (k + group - 1) / group * group; }
int64_t int4_panel_bytes(int64_t n, int64_t k, int64_t group);
// Writes codes [n, int4_depth(k, group)] (int8 in [-8, 7], row-major, already padded) and scales [n, depth / group]
// (float16 bits) as int4 panels into `dst` (int4_panel_bytes), panels [panel_begin, panel_end) only.
void pack_int4_panels(const int8_t* codes, const uint16_t* scales, int64_t n, int64_t k, int64_t group, void* dst,
                      int64_t panel_begin, int64_t panel_end);
// Rows [row_begin, row_end) of x [m, k] (float32, row stride ldx) as int8 per block of 32 k for the int4 and int8
// kernels: codes [m, depth] (depth = int4_depth(k, group) for int4, panel_depth(kInt8, k) for int8; the padding
// zero), and per row and block a float32 scale (the block's largest magnitude at 127; 0 for an all-zero block) and
// the sum of its codes ([m, depth / 32] each). Nearest rounding, halves away from zero: quantize_rows_scalar's
// arithmetic, which the AVX-512 code that runs where the CPU has the kernels matches bit for bit (tested).
void quantize_rows(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales, int32_t* sums,
                   int64_t row_begin, int64_t row_end);
void quantize_rows_scalar(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales,
                          int32_t* sums, int64_t row_begin, int64_t row_end);

struct PanelProduct {
  WeightType type = WeightType::kFloat32;
  const void* x = nullptr;  // [m, k] rows, `type`'s element type, row stride ldx elements (not int8 / int4)
  int64_t ldx = 0;
  const void* panels = nullptr;   // pack_panels' output for [n, k]
  const float* scales = nullptr;  // int8: [n], each output feature's scale
  // int4 and int8: x is unused; the rows as quantize_rows made them, k is the padded depth (panel_depth for int8)
  // and `group` the int4 weight's group.
  const int8_t* xq = nullptr;
  const float* xscales = nullptr;
  const int32_t* xsums = nullptr;
  int64_t group = 0;
  const void* bias = nullptr;  // [n] of `type` (float32 for int8), or null
  void* out = nullptr;         // [m, n] of `type` (float32 for int8), row stride ldo elements
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
