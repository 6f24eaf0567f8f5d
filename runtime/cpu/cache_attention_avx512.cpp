// The AVX-512 kernels of cache_attention.h (built with AVX-512 flags, CMakeLists.txt); only
// cache_attention.h's entry point calls them, where the CPU has AVX-512.
#include <immintrin.h>

// GCC 12's _mm512_cvtph_ps and _mm512_cvtepi32_epi16 start from an undefined vector, which -W(maybe-)uninitialized
// reports once inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/cpu/avx512_vectors.h"
#include "runtime/cpu/cache_attention.h"

namespace libpipe::cpu {

namespace {

// One head of one row: QB queries at a time, ND 16-wide vectors per head.
template <int ND>
void one_task(const CacheAttention& a, int64_t task, std::vector<float>& scores) {
  constexpr int QB = ND >= 16 ? 1 : 16 / ND;  // queries whose vectors fit 16 registers
  const int64_t b = task / a.heads, h = task % a.heads;
  const int64_t g = h / (a.heads / a.kv_heads);
  const int64_t d = a.head_dim, ctx = a.context;
  const int64_t slot = a.slots[b];
  const int64_t k_base = slot * a.cache_stride[0] + g * a.cache_stride[1];
  const int64_t v_base = slot * a.v_stride[0] + g * a.v_stride[1];
  const bool* mask_row = a.mask + b * a.mask_stride[0] + h * a.mask_stride[1];
  scores.resize(static_cast<size_t>(QB * ctx));
  for (int64_t q0 = 0; q0 < a.queries; q0 += QB) {
    const int nq = static_cast<int>(std::min<int64_t>(QB, a.queries - q0));
    __m512 qv[QB][ND];
    for (int qi = 0; qi < QB; ++qi)
      for (int k = 0; k < ND; ++k)
        qv[qi][k] = qi < nq ? avx512::load(a.type, a.query, ((b * a.heads + h) * a.queries + q0 + qi) * d + 16 * k)
                            : _mm512_setzero_ps();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    // Scores of every key each query may see; -inf where it may not.
    for (int64_t j = 0; j < ctx; ++j) {
      bool any = false;
      bool sees[QB];
      for (int qi = 0; qi < nq; ++qi) {
        sees[qi] = mask_row[(q0 + qi) * a.mask_stride[2] + j * a.mask_stride[3]];
        any |= sees[qi];
      }
      if (!any) {
        for (int qi = 0; qi < nq; ++qi) scores[qi * ctx + j] = neg_inf;
        continue;
      }
      __m512 kv[ND];
      for (int k = 0; k < ND; ++k)
        kv[k] = avx512::load(a.cache_type, a.k_cache, k_base + j * a.cache_stride[2] + 16 * k);
      for (int qi = 0; qi < nq; ++qi) {
        __m512 acc = _mm512_mul_ps(qv[qi][0], kv[0]);
        for (int k = 1; k < ND; ++k) acc = _mm512_fmadd_ps(qv[qi][k], kv[k], acc);
        // Scaled after the product, as SDPA scales.
        scores[qi * ctx + j] = sees[qi] ? _mm512_reduce_add_ps(acc) * a.scale : neg_inf;
      }
    }
    // Softmax per query (the weights stay unnormalised; the sum divides at the end).
    float total[QB];
    for (int qi = 0; qi < nq; ++qi) {
      float* s = scores.data() + qi * ctx;
      __m512 mx = _mm512_set1_ps(neg_inf);
      int64_t j = 0;
      for (; j + 16 <= ctx; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
      float m = _mm512_reduce_max_ps(mx);
      for (; j < ctx; ++j) m = std::max(m, s[j]);
      if (m == neg_inf) {  // sees nothing: NaN, as SDPA gives
        total[qi] = std::numeric_limits<float>::quiet_NaN();
        for (j = 0; j < ctx; ++j) s[j] = 0;
        continue;
      }
      const __m512 mv = _mm512_set1_ps(m);
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j + 16 <= ctx; j += 16) {
        const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (j < ctx) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - j)) - 1u);
        const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_mask_loadu_ps(mv, tail, s + j), mv));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
      }
      total[qi] = _mm512_reduce_add_ps(sum);
      // In a bfloat16 or float16 model SDPA multiplies the values by the weights rounded to the dtype (the sum
      // stays float32): so here too, or greedy tokens would part from eager's at near ties.
      if (a.type != WeightType::kFloat32)
        for (j = 0; j < ctx; j += 16) {
          const int64_t n = std::min<int64_t>(16, ctx - j);
          _mm512_mask_storeu_ps(s + j, avx512::first(n),
                                avx512::round_to(a.type, _mm512_maskz_loadu_ps(avx512::first(n), s + j)));
        }
    }
    // The weighted sum of the values.
    __m512 acc[QB][ND];
    for (int qi = 0; qi < QB; ++qi)
      for (int k = 0; k < ND; ++k) acc[qi][k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < ctx; ++j) {
      bool any = false;
      for (int qi = 0; qi < nq; ++qi) any |= scores[qi * ctx + j] != 0.f;
      if (!any) continue;
      __m512 vv[ND];
      for (int k = 0; k < ND; ++k) vv[k] = avx512::load(a.cache_type, a.v_cache, v_base + j * a.v_stride[2] + 16 * k);
      for (int qi = 0; qi < nq; ++qi) {
        const __m512 p = _mm512_set1_ps(scores[qi * ctx + j]);
        for (int k = 0; k < ND; ++k) acc[qi][k] = _mm512_fmadd_ps(p, vv[k], acc[qi][k]);
      }
    }
    for (int qi = 0; qi < nq; ++qi) {
      const __m512 inv = _mm512_set1_ps(1.0f / total[qi]);
      for (int k = 0; k < ND; ++k)
        avx512::store(a.type, a.out, ((b * a.heads + h) * a.queries + q0 + qi) * d + 16 * k,
                      _mm512_mul_ps(acc[qi][k], inv));
    }
  }
}

template <int ND>
void tasks(const CacheAttention& a, int64_t begin, int64_t end) {
  thread_local std::vector<float> scores;
  for (int64_t t = begin; t < end; ++t) one_task<ND>(a, t, scores);
}

}  // namespace

void cache_attention(const CacheAttention& a, int64_t begin, int64_t end) {
  switch (a.head_dim / 16) {
    case 1: return tasks<1>(a, begin, end);
    case 2: return tasks<2>(a, begin, end);
    case 3: return tasks<3>(a, begin, end);
    case 4: return tasks<4>(a, begin, end);
    case 5: return tasks<5>(a, begin, end);
    case 6: return tasks<6>(a, begin, end);
    case 7: return tasks<7>(a, begin, end);
    case 8: return tasks<8>(a, begin, end);
    case 9: return tasks<9>(a, begin, end);
    case 10: return tasks<10>(a, begin, end);
    case 11: return tasks<11>(a, begin, end);
    case 12: return tasks<12>(a, begin, end);
    case 13: return tasks<13>(a, begin, end);
    case 14: return tasks<14>(a, begin, end);
    case 15: return tasks<15>(a, begin, end);
    default: return tasks<16>(a, begin, end);
  }
}

}  // namespace libpipe::cpu
