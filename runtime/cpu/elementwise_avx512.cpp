// The AVX-512 kernels of elementwise.h (built with AVX-512 flags, CMakeLists.txt); callers check
// cpu_has_panel_kernels() first.
#include <immintrin.h>

// GCC 12's _mm512_cvtph_ps and _mm512_cvtepi32_epi16 start from an undefined vector, which -W(maybe-)uninitialized
// reports once inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cmath>

#include "runtime/cpu/avx512_vectors.h"
#include "runtime/cpu/elementwise.h"

namespace libpipe::cpu {

using avx512::load;
using avx512::round_to;
using avx512::store;

namespace {

// Row `row` (at element offset `at`) of rms_norm, given the sum of its squared values.
void normalize_row(WeightType type, const void* x, const void* weight, void* out, int64_t at, int64_t cols,
                   __m512 squares, float eps) {
  // As aten computes it in float32: the mean, plus eps, its reciprocal square root.
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(cols) + eps);
  const __m512 s = _mm512_set1_ps(rstd);
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 normed = round_to(type, _mm512_mul_ps(load(type, x, at + c, cols - c), s));
    store(type, out, at + c, _mm512_mul_ps(load(type, weight, c, cols - c), normed), cols - c);
  }
}

}  // namespace

void rms_norm(WeightType type, const void* x, const void* weight, void* out, int64_t cols, float eps, int64_t begin,
              int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = r * cols;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
      const __m512 v = load(type, x, row + c, cols - c);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    normalize_row(type, x, weight, out, row, cols, squares, eps);
  }
}

void add_rms_norm(WeightType type, const void* x, const void* y, const void* weight, void* sum, void* out, int64_t cols,
                  float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = r * cols;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
      // The sum as aten's add stores it (rounded to the type), then squared as rms_norm squares what it reads.
      const __m512 v =
          round_to(type, _mm512_add_ps(load(type, x, row + c, cols - c), load(type, y, row + c, cols - c)));
      store(type, sum, row + c, v, cols - c);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    normalize_row(type, sum, weight, out, row, cols, squares, eps);
  }
}

void rotary(WeightType type, const void* x, const void* cos, const void* sin, void* out, int64_t dim, int64_t heads,
            int64_t begin, int64_t end) {
  const int64_t half = dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = r * dim, angles = (r / heads) * dim;
    for (int64_t c = 0; c < dim; c += 16) {
      // rotate_half(x)[c] = c < half ? -x[c + half] : x[c - half]; a vector may straddle the middle.
      const int64_t n = std::min<int64_t>(16, dim - c);
      alignas(64) float rotated[16];
      if (c + n <= half) {
        _mm512_store_ps(rotated, _mm512_sub_ps(_mm512_setzero_ps(), load(type, x, row + c + half, n)));
      } else if (c >= half) {
        _mm512_store_ps(rotated, load(type, x, row + c - half, n));
      } else {
        alignas(64) float values[16];
        for (int64_t i = 0; i < n; ++i) {
          _mm512_store_ps(values, load(type, x, row + (c + i < half ? c + i + half : c + i - half), 1));
          rotated[i] = c + i < half ? -values[0] : values[0];
        }
      }
      const __m512 v = load(type, x, row + c, n);
      const __m512 a = round_to(type, _mm512_mul_ps(v, load(type, cos, angles + c, n)));
      const __m512 b = round_to(type, _mm512_mul_ps(_mm512_load_ps(rotated), load(type, sin, angles + c, n)));
      store(type, out, row + c, _mm512_add_ps(a, b), n);
    }
  }
}

void silu_mul(WeightType type, const void* gate, const void* up, void* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t n = std::min<int64_t>(16, end - i);
    const __m512 g = load(type, gate, i, n);
    // silu(g) = g / (1 + exp(-g)), rounded as aten stores it, then the product.
    const __m512 silu = round_to(
        type,
        _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), avx512::exp(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store(type, out, i, _mm512_mul_ps(silu, load(type, up, i, n)), n);
  }
}

}  // namespace libpipe::cpu
