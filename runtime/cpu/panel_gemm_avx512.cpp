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
// No software prefetch: the panels are read in one sequential run, which the hardware prefetcher
// follows; prefetching 8-64 rows ahead measured 5-25% slower at 4 rows.

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

// One tile: rows [0, MR) of x times NZ 16-wide vectors of one panel (starting at vector j0 of 4), over
// all of K. `w` points at the panel; `col` is the tile's first output feature.
template <WeightType T, bool kNativeBf16, int MR, int NZ>
void tile(const PanelProduct& p, const void* xrows, int64_t row0, const void* w, int j0, int64_t col) {
  __m512 acc[MR][NZ];
  for (int j = 0; j < NZ; ++j) {
    const __m512 b = load_bias<T>(p.bias, col + 16 * j, p.n - col - 16 * j);
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  const int64_t k = p.k;
  if constexpr (T == WeightType::kFloat32) {
    const float* x = static_cast<const float*>(xrows) + row0 * p.ldx;
    const float* wp = static_cast<const float*>(w) + 16 * j0;
    for (int64_t i = 0; i < k; ++i, wp += kPanelWidth) {
      __m512 wv[NZ];
      for (int j = 0; j < NZ; ++j) wv[j] = _mm512_loadu_ps(wp + 16 * j);
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * p.ldx + i]);
        for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
      }
    }
  } else if constexpr (T == WeightType::kFloat16) {
    const uint16_t* x = static_cast<const uint16_t*>(xrows) + row0 * p.ldx;
    const uint16_t* wp = static_cast<const uint16_t*>(w) + 16 * j0;
    for (int64_t i = 0; i < k; ++i, wp += kPanelWidth) {
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
    const uint16_t* x = static_cast<const uint16_t*>(xrows) + row0 * p.ldx;
    const uint16_t* wp = static_cast<const uint16_t*>(w) + 32 * j0;
    const int64_t pairs = k / 2;
    for (int64_t i = 0; i < pairs; ++i, wp += 2 * kPanelWidth) {
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
          for (int j = 0; j < NZ; ++j) {
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv[j], 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv[j], _mm512_set1_epi32(~0xffff)));
            acc[r][j] = _mm512_fmadd_ps(hi, odd, _mm512_fmadd_ps(lo, even, acc[r][j]));
          }
        }
      }
    }
    if (k % 2) {  // the last k alone: its partner in the panel is zero, x's may be anything
      for (int j = 0; j < NZ; ++j) {
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wp + 32 * j), 16));
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_scalar(x[r * p.ldx + k - 1])), even, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NZ; ++j) store_out<T>(p.out, (row0 + r) * p.ldo + col + 16 * j, acc[r][j], p.n - col - 16 * j);
}

template <WeightType T, bool kNativeBf16, int MR>
void tile_nz(const PanelProduct& p, int64_t row0, const void* w, int j0, int nz, int64_t col) {
  switch (nz) {
    case 1: return tile<T, kNativeBf16, MR, 1>(p, p.x, row0, w, j0, col);
    case 2: return tile<T, kNativeBf16, MR, 2>(p, p.x, row0, w, j0, col);
    case 3: return tile<T, kNativeBf16, MR, 3>(p, p.x, row0, w, j0, col);
    default: return tile<T, kNativeBf16, MR, 4>(p, p.x, row0, w, j0, col);
  }
}

template <WeightType T, bool kNativeBf16>
void rows_of_panel(const PanelProduct& p, const void* w, int j0, int nz, int64_t col) {
  for (int64_t row = 0; row < p.m; row += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.m - row)) {
      case 1: tile_nz<T, kNativeBf16, 1>(p, row, w, j0, nz, col); break;
      case 2: tile_nz<T, kNativeBf16, 2>(p, row, w, j0, nz, col); break;
      case 3: tile_nz<T, kNativeBf16, 3>(p, row, w, j0, nz, col); break;
      case 4: tile_nz<T, kNativeBf16, 4>(p, row, w, j0, nz, col); break;
      case 5: tile_nz<T, kNativeBf16, 5>(p, row, w, j0, nz, col); break;
      default: tile_nz<T, kNativeBf16, 6>(p, row, w, j0, nz, col); break;
    }
  }
}

template <WeightType T, bool kNativeBf16>
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
    rows_of_panel<T, kNativeBf16>(p, w, j0, nz, u * kUnitWidth);
    u += nz;
  }
}

}  // namespace

void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, bool native_bf16) {
  switch (p.type) {
    case WeightType::kFloat32: return product<WeightType::kFloat32, false>(p, unit_begin, unit_end);
    case WeightType::kFloat16: return product<WeightType::kFloat16, false>(p, unit_begin, unit_end);
    case WeightType::kBFloat16:
      return native_bf16 ? product<WeightType::kBFloat16, true>(p, unit_begin, unit_end)
                         : product<WeightType::kBFloat16, false>(p, unit_begin, unit_end);
  }
}

}  // namespace libpipe::cpu::avx512
