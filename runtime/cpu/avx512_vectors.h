// 16 values of a weight type as one vector of float32, for the AVX-512 kernels only (included by the
// *_avx512.cpp files, which are built with AVX-512 flags): loads and stores with a count of valid values,
// rounding to the type as aten rounds (to nearest even, a NaN stays a NaN), and exp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu::avx512 {

inline __mmask16 first(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (valid > 0 ? valid : 0)) - 1u);
}

inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

inline __m256i f32_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline __m256i f32_to_f16(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

inline float bf16_scalar(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Values [index, index + valid) of `base` (at most 16; the rest read as 0).
inline __m512 load(WeightType type, const void* base, int64_t index, int64_t valid = 16) {
  const __mmask16 m = first(valid);
  if (type == WeightType::kFloat32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + index);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + index);
  return type == WeightType::kBFloat16 ? bf16_to_f32(h) : _mm512_cvtph_ps(h);
}

inline void store(WeightType type, void* base, int64_t index, __m512 v, int64_t valid = 16) {
  const __mmask16 m = first(valid);
  if (type == WeightType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(base) + index, m, v);
    return;
  }
  const __m256i h = type == WeightType::kBFloat16 ? f32_to_bf16(v) : f32_to_f16(v);
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + index, m, h);
}

// 16 values [index, index + 16) of a `T` array, without a mask (the type known where the kernel is compiled).
template <WeightType T>
inline __m512 load16(const void* base, int64_t index) {
  if constexpr (T == WeightType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
    if constexpr (T == WeightType::kBFloat16) return bf16_to_f32(h);
    return _mm512_cvtph_ps(h);
  }
}

// v rounded to `type` and back: what storing an intermediate result in the model's dtype does to it.
inline __m512 round_to(WeightType type, __m512 v) {
  if (type == WeightType::kFloat32) return v;
  if (type == WeightType::kBFloat16) return bf16_to_f32(f32_to_bf16(v));
  return _mm512_cvtph_ps(f32_to_f16(v));
}

// exp(x) to about 2 float32 ulps: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n through
// the exponent bits; 0 below -87, +inf above 88.
inline __m512 exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __mmask16 huge = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);  // ln2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // 2^n as two factors, so that n = 128 (x near 88) does not overflow the exponent field.
  const __m512i half_n = _mm512_srai_epi32(_mm512_cvtps_epi32(n), 1);
  const __m512i rest = _mm512_sub_epi32(_mm512_cvtps_epi32(n), half_n);
  const __m512 two_a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half_n, _mm512_set1_epi32(127)), 23));
  const __m512 two_b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(rest, _mm512_set1_epi32(127)), 23));
  __m512 result = _mm512_mul_ps(_mm512_mul_ps(p, two_a), two_b);
  result = _mm512_mask_mov_ps(result, tiny, _mm512_setzero_ps());
  result = _mm512_mask_mov_ps(result, huge, _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_mov_ps(result, nan, x);
}

}  // namespace libpipe::cpu::avx512
