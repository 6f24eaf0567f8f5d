// The AVX-512 micro-kernels of panel_gemm.h. This file alone is compiled with AVX-512 flags (CMakeLists.txt);
// panel_gemm.cpp calls into it only on a CPU that has them, and the VDPBF16PS kernels only where the CPU
// has AVX-512 BF16 (every other instruction here is AVX-512 F/BW/VL/DQ or F16C).
#include <immintrin.h>

// GCC 12's _mm512_cvtph_ps and _mm512_cvtepi32_epi16 start from an undefined vector, which -W(maybe-)uninitialized
// reports once inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "runtime/cpu/avx512_vectors.h"
#include "runtime/cpu/panel_gemm.h"
#include "runtime/cpu/panel_gemm_kernels.h"

namespace libpipe::cpu::avx512 {

namespace {

constexpr int kMaxRows = 6;  // rows per tile: 6 x 4 accumulators, 4 weight vectors, 1 broadcast in 32 registers

// Software prefetch of the panel stream, in bytes ahead of the row of the panel being read: into L2 far
// ahead, into L1 near. The hardware prefetcher follows the sequential run alone on some CPUs (an AMD EPYC
// measured 5-25% slower with prefetches at 4 rows); on others a tile of several rows issues too few loads
// per cache line for it to keep the memory busy (an Intel Xeon: 4 rows on one core 11.2 -> 16.5 GB/s with
// them). Whether to prefetch is measured per process (kernel_choice.h). Only the first tile of rows over a
// panel prefetches: the others find it in L2.
constexpr int64_t kPrefetchL2Bytes = 2048;
constexpr int64_t kPrefetchL1Bytes = 512;

template <bool kPrefetch, int NZ>
inline void prefetch_panel_row(const void* row_of_vectors) {
  if constexpr (kPrefetch) {
    const char* at = static_cast<const char*>(row_of_vectors);
    for (int j = 0; j < NZ; ++j) {
      _mm_prefetch(at + 64 * j + kPrefetchL2Bytes, _MM_HINT_T1);
      _mm_prefetch(at + 64 * j + kPrefetchL1Bytes, _MM_HINT_T0);
    }
  }
}

inline __m512 f16_to_f32(__m256i v) { return _mm512_cvtph_ps(v); }
inline float f16_scalar(uint16_t v) { return _cvtsh_ss(v); }
inline __mmask16 tail_mask(int64_t valid) { return first(valid); }

// Bias (or zeros) for the accumulators of one output vector; `valid` outputs are real.
template <WeightType T>
inline __m512 load_bias(const void* bias, int64_t col, int64_t valid) {
  if (!bias) return _mm512_setzero_ps();
  const __mmask16 mask = tail_mask(valid);
  if constexpr (T == WeightType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(bias) + col);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(bias) + col);
    return T == WeightType::kBFloat16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
}

template <WeightType T>
inline void store_out(void* out, int64_t index, __m512 v, int64_t valid) {
  const __mmask16 mask = tail_mask(valid);
  if constexpr (T == WeightType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + index, mask, v);
  } else {
    const __m256i h = T == WeightType::kBFloat16 ? f32_to_bf16(v) : f32_to_f16(v);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + index, mask, h);
  }
}

// Where a tile's accumulators start and end: from the bias (first block of K) or `saved`, and to the output
// (last block) or `saved`, which holds MR x 64 floats between blocks of K.
struct TileSpan {
  int64_t i0 = 0, i1 = 0;  // rows of the panel: k for float32 / float16, pairs of k for bfloat16
  bool first = true, last = true;
  float* saved = nullptr;
};

// One tile: rows [row0, row0 + MR) of x times NZ 16-wide vectors of one panel (starting at vector j0 of 4), over
// the panel rows of `span`. `w` points at the panel; `col` is the tile's first output feature.
template <WeightType T, bool kNativeBf16, bool kPrefetch, int MR, int NZ>
void tile(const PanelProduct& p, int64_t row0, const void* w, int j0, int64_t col, const TileSpan& span) {
  __m512 acc[MR][NZ];
  if (span.first) {
    for (int j = 0; j < NZ; ++j) {
      const __m512 b = load_bias<T>(p.bias, col + 16 * j, p.n - col - 16 * j);
      for (int r = 0; r < MR; ++r) acc[r][j] = b;
    }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_load_ps(span.saved + r * kPanelWidth + 16 * j);
  }
  const int64_t k = p.k;
  if constexpr (T == WeightType::kFloat32) {
    const float* x = static_cast<const float*>(p.x) + row0 * p.ldx;
    const float* wp = static_cast<const float*>(w) + 16 * j0 + span.i0 * kPanelWidth;
    for (int64_t i = span.i0; i < span.i1; ++i, wp += kPanelWidth) {
      prefetch_panel_row<kPrefetch, NZ>(wp);
      __m512 wv[NZ];
      for (int j = 0; j < NZ; ++j) wv[j] = _mm512_loadu_ps(wp + 16 * j);
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * p.ldx + i]);
        for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
      }
    }
  } else if constexpr (T == WeightType::kFloat16) {
    const uint16_t* x = static_cast<const uint16_t*>(p.x) + row0 * p.ldx;
    const uint16_t* wp = static_cast<const uint16_t*>(w) + 16 * j0 + span.i0 * kPanelWidth;
    for (int64_t i = span.i0; i < span.i1; ++i, wp += kPanelWidth) {
      prefetch_panel_row<kPrefetch, (NZ + 1) / 2>(wp);  // 32 bytes per vector of 16 outputs
      __m512 wv[NZ];
      for (int j = 0; j < NZ; ++j)
        wv[j] = f16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j)));
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(f16_scalar(x[r * p.ldx + i]));
        for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
      }
    }
  } else {
    // bfloat16: pairs (k, k+1) per output; 128 elements per pair row of the panel.
    const uint16_t* x = static_cast<const uint16_t*>(p.x) + row0 * p.ldx;
    const uint16_t* wp = static_cast<const uint16_t*>(w) + 32 * j0 + span.i0 * 2 * kPanelWidth;
    const int64_t pairs = k / 2;
    const int64_t end = std::min(span.i1, pairs);
    for (int64_t i = span.i0; i < end; ++i, wp += 2 * kPanelWidth) {
      prefetch_panel_row<kPrefetch, NZ>(wp);
      __m512i wv[NZ];
      for (int j = 0; j < NZ; ++j) wv[j] = _mm512_loadu_si512(wp + 32 * j);
      for (int r = 0; r < MR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * p.ldx + 2 * i, sizeof pair);
        if constexpr (kNativeBf16) {
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, (__m512bh)wv[j]);
        } else {
          const __m512 lo = _mm512_set1_ps(bf16_scalar(static_cast<uint16_t>(pair & 0xffff)));
          const __m512 hi = _mm512_set1_ps(bf16_scalar(static_cast<uint16_t>(pair >> 16)));
          // The odd element first, then the even: VDPBF16PS's order. A product of two bfloat16 values is exact in
          // float32, so each fused multiply-add rounds as its add does, and both kernels give the same bits
          // (VDPBF16PS aside treats denormal inputs and results as zero).
          for (int j = 0; j < NZ; ++j) {
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv[j], 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv[j], _mm512_set1_epi32(~0xffff)));
            acc[r][j] = _mm512_fmadd_ps(lo, even, _mm512_fmadd_ps(hi, odd, acc[r][j]));
          }
        }
      }
    }
    if (k % 2 && span.i1 > pairs) {  // the last k alone: its partner in the panel is zero, x's may be anything
      for (int j = 0; j < NZ; ++j) {
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wp + 32 * j), 16));
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_scalar(x[r * p.ldx + k - 1])), even, acc[r][j]);
      }
    }
  }
  if (span.last) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NZ; ++j)
        store_out<T>(p.out, (row0 + r) * p.ldo + col + 16 * j, acc[r][j], p.n - col - 16 * j);
  } else {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NZ; ++j) _mm512_store_ps(span.saved + r * kPanelWidth + 16 * j, acc[r][j]);
  }
}

template <WeightType T, bool kNativeBf16, bool kPrefetch, int MR>
void tile_nz(const PanelProduct& p, int64_t row0, const void* w, int j0, int nz, int64_t col, const TileSpan& span) {
  switch (nz) {
    case 1: return tile<T, kNativeBf16, kPrefetch, MR, 1>(p, row0, w, j0, col, span);
    case 2: return tile<T, kNativeBf16, kPrefetch, MR, 2>(p, row0, w, j0, col, span);
    case 3: return tile<T, kNativeBf16, kPrefetch, MR, 3>(p, row0, w, j0, col, span);
    default: return tile<T, kNativeBf16, kPrefetch, MR, 4>(p, row0, w, j0, col, span);
  }
}

template <WeightType T, bool kNativeBf16, bool kPrefetch>
void tile_rows(const PanelProduct& p, int64_t row, int64_t rows, const void* w, int j0, int nz, int64_t col,
               const TileSpan& span) {
  switch (rows) {
    case 1: return tile_nz<T, kNativeBf16, kPrefetch, 1>(p, row, w, j0, nz, col, span);
    case 2: return tile_nz<T, kNativeBf16, kPrefetch, 2>(p, row, w, j0, nz, col, span);
    case 3: return tile_nz<T, kNativeBf16, kPrefetch, 3>(p, row, w, j0, nz, col, span);
    case 4: return tile_nz<T, kNativeBf16, kPrefetch, 4>(p, row, w, j0, nz, col, span);
    case 5: return tile_nz<T, kNativeBf16, kPrefetch, 5>(p, row, w, j0, nz, col, span);
    default: return tile_nz<T, kNativeBf16, kPrefetch, 6>(p, row, w, j0, nz, col, span);
  }
}

// Panel rows per block of K when several tiles of rows share a panel: 64 KiB of panel (float32, or bfloat16
// pairs), so that the tiles after the first read the block from L2 (or L1), not memory. Without the blocks, a
// product of 8 rows on an Intel Xeon streamed 20 GB/s on 2 cores where one of 6 rows reached 31: the second
// tile's pass over the whole panel cost half as much again as the first's from memory. Blocks of 64 rows (16 KiB,
// to stay in L1) were slower on an AMD EPYC (Zen 4) at every row count from 8 (bench/linear_gemm, one thread, the 1B
// Llama's layers at 128 rows: float32 46 -> 52 GMAC/s, bfloat16 92 -> 106; 2 threads at 8 rows, bfloat16 173 -> 271
// GFLOP/s): every block restarts the first tile's stream from memory, whose hardware prefetch had just found it.
constexpr int64_t kBlockRows = 256;
// Rows whose accumulators wait in memory between blocks of K (a group of tiles; more rows take more groups).
constexpr int64_t kGroupRows = 8 * kMaxRows;

template <WeightType T, bool kNativeBf16, bool kPrefetch>
void rows_of_panel(const PanelProduct& p, const void* w, int j0, int nz, int64_t col) {
  const int64_t depth = T == WeightType::kBFloat16 ? (p.k + 1) / 2 : p.k;  // panel rows
  if (p.m <= kMaxRows) {
    TileSpan whole;
    whole.i1 = depth;
    return tile_rows<T, kNativeBf16, kPrefetch>(p, 0, p.m, w, j0, nz, col, whole);
  }
  alignas(64) float saved[kGroupRows * kPanelWidth];
  for (int64_t group = 0; group < p.m; group += kGroupRows) {
    const int64_t group_end = std::min(p.m, group + kGroupRows);
    for (int64_t i0 = 0; i0 < depth; i0 += kBlockRows) {
      TileSpan span;
      span.i0 = i0;
      span.i1 = std::min(depth, i0 + kBlockRows);
      span.first = i0 == 0;
      span.last = span.i1 == depth;
      for (int64_t row = group; row < group_end; row += kMaxRows) {
        span.saved = saved + (row - group) * kPanelWidth;
        const int64_t rows = std::min<int64_t>(kMaxRows, group_end - row);
        // The group's first tile streams the block from memory; the others find it in L1.
        if (row == group) tile_rows<T, kNativeBf16, kPrefetch>(p, row, rows, w, j0, nz, col, span);
        else tile_rows<T, kNativeBf16, false>(p, row, rows, w, j0, nz, col, span);
      }
    }
  }
}

template <WeightType T, bool kNativeBf16, bool kPrefetch>
void product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end) {
  const int64_t depth = panel_depth(T, p.k);
  const int64_t panel_size = depth * kPanelWidth;  // elements
  const size_t element = T == WeightType::kFloat32 ? 4 : 2;
  constexpr int64_t kUnitsPerPanel = kPanelWidth / kUnitWidth;
  for (int64_t u = unit_begin; u < unit_end;) {
    const int64_t panel = u / kUnitsPerPanel;
    const int j0 = static_cast<int>(u % kUnitsPerPanel);
    const int nz = static_cast<int>(std::min<int64_t>(kUnitsPerPanel - j0, unit_end - u));
    const void* w = static_cast<const char*>(p.panels) + static_cast<size_t>(panel * panel_size) * element;
    rows_of_panel<T, kNativeBf16, kPrefetch>(p, w, j0, nz, u * kUnitWidth);
    u += nz;
  }
}

}  // namespace

void quantize_rows(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales, int32_t* sums,
                   int64_t row_begin, int64_t row_end) {
  // The scalar code's arithmetic (panel_gemm.cpp), 16 at a time: the same maximum (VMAXPS returns its second operand
  // for a NaN, as std::max keeps the maximum so far), the same float32 scale, inverse and products, and rounding to
  // nearest with halves away from zero done exactly: truncate, then step away from zero where the dropped fraction
  // (exact: |v| < 2^23) is at least a half.
  const int64_t blocks = depth / kInt4RowBlock;
  const __m512 sign_bit = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* xr = x + r * ldx;
    int8_t* q = codes + r * depth;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i0 = b * kInt4RowBlock;
      __m512 v[2];
      __m512 amax = _mm512_setzero_ps();
      for (int h = 0; h < 2; ++h) {
        v[h] = _mm512_maskz_loadu_ps(first(k - i0 - 16 * h), xr + i0 + 16 * h);
        amax = _mm512_max_ps(_mm512_andnot_ps(sign_bit, v[h]), amax);
      }
      const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512 y = _mm512_mul_ps(v[h], _mm512_set1_ps(inverse));
        const __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __mmask16 up = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign_bit, _mm512_sub_ps(y, t)), half, _CMP_GE_OQ);
        const __m512 rounded = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(sign_bit, y)));
        const __m512i c = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvttps_epi32(rounded)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i0 + 16 * h), _mm512_cvtepi32_epi8(c));
        sum = _mm512_add_epi32(sum, c);
      }
      scales[r * blocks + b] = scale;
      sums[r * blocks + b] = _mm512_reduce_add_epi32(sum);
    }
  }
}

void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant v) {
  switch (p.type) {
    case WeightType::kFloat32:
      return v.prefetch ? product<WeightType::kFloat32, false, true>(p, unit_begin, unit_end)
                        : product<WeightType::kFloat32, false, false>(p, unit_begin, unit_end);
    case WeightType::kFloat16:
      return v.prefetch ? product<WeightType::kFloat16, false, true>(p, unit_begin, unit_end)
                        : product<WeightType::kFloat16, false, false>(p, unit_begin, unit_end);
    case WeightType::kInt8: return int8_product(p, unit_begin, unit_end, v);
    case WeightType::kInt4: return int4_product(p, unit_begin, unit_end, v);
    case WeightType::kBFloat16:
      if (v.native_bf16)
        return v.prefetch ? product<WeightType::kBFloat16, true, true>(p, unit_begin, unit_end)
                          : product<WeightType::kBFloat16, true, false>(p, unit_begin, unit_end);
      return v.prefetch ? product<WeightType::kBFloat16, false, true>(p, unit_begin, unit_end)
                        : product<WeightType::kBFloat16, false, false>(p, unit_begin, unit_end);
  }
}

}  // namespace libpipe::cpu::avx512
