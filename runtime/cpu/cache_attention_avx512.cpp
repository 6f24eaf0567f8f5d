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
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/cpu/avx512_vectors.h"
#include "runtime/cpu/cache_attention.h"

namespace libpipe::cpu {

namespace {

// Lane t = the sum of p[t]'s 16 lanes: four levels of shuffles and adds (p[i] with p[i+8], then within halves,
// quarters and pairs), 3 instructions per vector where a horizontal sum per vector takes about 10; the levels
// leave key t at position kPosition[t], which one permutation puts back.
inline __m512 sum16(const __m512 (&p)[16]) {
  __m512 q[8], r[4], s[2];
  for (int i = 0; i < 8; ++i)
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[i], p[i + 8], 0x44), _mm512_shuffle_f32x4(p[i], p[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[i], q[i + 4], 0x88), _mm512_shuffle_f32x4(q[i], q[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[i], r[i + 2], 0x44), _mm512_shuffle_ps(r[i], r[i + 2], 0xEE));
  const __m512 out = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
  // out's 128-bit lane L, element e holds key [0, 8, 4, 12][L] + [0, 2, 1, 3][e].
  const __m512i position = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(position, out);
}

// The keys j .. j + n - 1 (n <= 16) a query may see, as bits, from its mask row (bools `stride` apart).
inline __mmask16 visible(const bool* mask, int64_t stride, int64_t n) {
  if (stride == 1)
    return _mm_mask_cmpneq_epi8_mask(avx512::first(n), _mm_maskz_loadu_epi8(avx512::first(n), mask),
                                     _mm_setzero_si128());
  __mmask16 bits = 0;
  for (int64_t t = 0; t < n; ++t) bits |= static_cast<__mmask16>(mask[t * stride] ? 1u << t : 0u);
  return bits;
}

// Calls f(std::integral_constant<int, n>{}) for n in 1 .. N (N <= 16).
template <int N, int I = 1, typename F>
inline void with_constant(int n, F&& f) {
  if constexpr (I <= N) {
    if (n == I) return f(std::integral_constant<int, I>{});
    with_constant<N, I + 1>(n, std::forward<F>(f));
  }
}

// One key-value head of one row: the query heads that share it (grouped-query attention) and their queries, QB
// (head, query) pairs at a time, ND 16-wide vectors per head. The pairs of a block share every key and value the
// block reads (loaded, and converted to float32 from a bfloat16 or float16 cache, once), which is what a decode step
// (one query per head) needs: there the block is the group's heads. Each pair's arithmetic is that of the pair alone,
// so grouping changes no bit of the result.
template <WeightType Q, WeightType C, int ND>
void one_task(const CacheAttention& a, int64_t task, std::vector<float>& scores) {
  constexpr int QB = ND >= 16 ? 1 : 16 / ND;  // pairs whose query vectors fit 16 registers
  const int64_t group = a.heads / a.kv_heads;
  const int64_t pieces = cache_attention_query_pieces(a);
  const int64_t b = task / (a.kv_heads * pieces), g = task / pieces % a.kv_heads, piece = task % pieces;
  const int64_t d = a.head_dim, ctx = a.context;
  const int64_t slot = a.slots[b];
  const int64_t k_base = slot * a.cache_stride[0] + g * a.cache_stride[1];
  const int64_t v_base = slot * a.v_stride[0] + g * a.v_stride[1];
  // The task's queries: [q0, q0 + nq) of each head of the group. Pair i is head g * group + i / nq, query q0 + i % nq;
  // row_of(i) is its row of D in q and out [B, H, T, D] (with one piece, the group's pairs are consecutive rows).
  const int64_t q0 = piece * kQueriesPerTask, nq_task = std::min(kQueriesPerTask, a.queries - q0);
  const int64_t pairs = group * nq_task;
  const auto row_of = [&](int64_t i) { return (b * a.heads + g * group + i / nq_task) * a.queries + q0 + i % nq_task; };
  scores.resize(static_cast<size_t>(QB * ctx));
  // The keys of a block of 16, converted to float32 once for every pair (a cache in another dtype than float32).
  alignas(64) float keys[16 * ND * 16];
  for (int64_t i0 = 0; i0 < pairs; i0 += QB) {
    const int nq = static_cast<int>(std::min<int64_t>(QB, pairs - i0));
    __m512 qv[QB][ND];
    const bool* mask_row[QB];
    for (int qi = 0; qi < QB; ++qi) {
      const int64_t i = i0 + std::min(qi, nq - 1);
      mask_row[qi] = a.mask + b * a.mask_stride[0] + (g * group + i / nq_task) * a.mask_stride[1] +
                     (q0 + i % nq_task) * a.mask_stride[2];
      for (int k = 0; k < ND; ++k)
        qv[qi][k] = qi < nq ? avx512::load16<Q>(a.query, row_of(i0 + qi) * d + 16 * k) : _mm512_setzero_ps();
    }
    const float neg_inf = -std::numeric_limits<float>::infinity();
    // Keys past `seen` (the end of the last 16 that some pair of the block may see: a prompt chunk's early queries
    // under the causal mask) weigh nothing, so the softmax and the weighted sum stop there; what they skip would
    // add exact zeros, so no bit changes.
    int64_t seen = 0;
    // Scores of every key each query may see, -inf where it may not, 16 keys at a time: 16 product vectors
    // summed across their lanes together (sum16), not one horizontal sum per key.
    for (int64_t j0 = 0; j0 < ctx; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, ctx - j0);
      __mmask16 sees[QB];
      __mmask16 any = 0;
      for (int qi = 0; qi < nq; ++qi) {
        sees[qi] = visible(mask_row[qi] + j0 * a.mask_stride[3], a.mask_stride[3], nk);
        any |= sees[qi];
      }
      const __m512 none = _mm512_set1_ps(neg_inf);
      if (!any) {
        for (int qi = 0; qi < nq; ++qi) _mm512_mask_storeu_ps(scores.data() + qi * ctx + j0, avx512::first(nk), none);
        continue;
      }
      seen = j0 + nk;
      const auto scores_of = [&](int qi, auto key) {
        __m512 p[16];
        for (int t = 0; t < 16; ++t) {
          if (t >= nk) {
            p[t] = _mm512_setzero_ps();
            continue;
          }
          __m512 acc = _mm512_mul_ps(qv[qi][0], key(t, 0));
          for (int k = 1; k < ND; ++k) acc = _mm512_fmadd_ps(qv[qi][k], key(t, k), acc);
          p[t] = acc;
        }
        // Scaled after the product, as SDPA scales.
        const __m512 sc = _mm512_mul_ps(sum16(p), _mm512_set1_ps(a.scale));
        _mm512_mask_storeu_ps(scores.data() + qi * ctx + j0, avx512::first(nk), _mm512_mask_mov_ps(none, sees[qi], sc));
      };
      const auto cached = [&](int t, int k) {
        return avx512::load16<C>(a.k_cache, k_base + (j0 + t) * a.cache_stride[2] + 16 * k);
      };
      if (C == WeightType::kFloat32 || nq == 1) {
        for (int qi = 0; qi < nq; ++qi) scores_of(qi, cached);
      } else {
        for (int t = 0; t < nk; ++t)
          for (int k = 0; k < ND; ++k) _mm512_store_ps(keys + (t * ND + k) * 16, cached(t, k));
        for (int qi = 0; qi < nq; ++qi)
          scores_of(qi, [&](int t, int k) { return _mm512_load_ps(keys + (t * ND + k) * 16); });
      }
    }
    // Softmax per query (the weights stay unnormalised; the sum divides at the end).
    float total[QB];
    for (int qi = 0; qi < nq; ++qi) {
      float* s = scores.data() + qi * ctx;
      __m512 mx = _mm512_set1_ps(neg_inf);
      int64_t j = 0;
      for (; j + 16 <= seen; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
      float m = _mm512_reduce_max_ps(mx);
      for (; j < seen; ++j) m = std::max(m, s[j]);
      if (m == neg_inf) {  // sees nothing: NaN, as SDPA gives
        total[qi] = std::numeric_limits<float>::quiet_NaN();
        for (j = 0; j < seen; ++j) s[j] = 0;
        continue;
      }
      const __m512 mv = _mm512_set1_ps(m);
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j + 16 <= seen; j += 16) {
        const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (j < seen) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (seen - j)) - 1u);
        const __m512 e = avx512::exp(_mm512_sub_ps(_mm512_mask_loadu_ps(mv, tail, s + j), mv));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
      }
      total[qi] = _mm512_reduce_add_ps(sum);
      // In a bfloat16 or float16 model SDPA multiplies the values by the weights rounded to the dtype (the sum
      // stays float32): so here too, or greedy tokens would part from eager's at near ties.
      if constexpr (Q != WeightType::kFloat32)
        for (j = 0; j < seen; j += 16) {
          const int64_t n = std::min<int64_t>(16, seen - j);
          _mm512_mask_storeu_ps(s + j, avx512::first(n),
                                avx512::round_to(Q, _mm512_maskz_loadu_ps(avx512::first(n), s + j)));
        }
    }
    // The weighted sum of the values, with the number of pairs a constant so that the accumulators stay in
    // registers (a runtime count leaves them on the stack, each key's update waiting on a store and a load).
    const auto weighted_sum = [&](auto pairs_in_block) {
      constexpr int NQ = decltype(pairs_in_block)::value;
      __m512 acc[NQ][ND];
      for (int qi = 0; qi < NQ; ++qi)
        for (int k = 0; k < ND; ++k) acc[qi][k] = _mm512_setzero_ps();
      const float* s = scores.data();
      for (int64_t j = 0; j < seen; ++j) {
        bool any = false;
        for (int qi = 0; qi < NQ; ++qi) any |= s[qi * ctx + j] != 0.f;
        if (!any) continue;
        __m512 vv[ND];
        for (int k = 0; k < ND; ++k) vv[k] = avx512::load16<C>(a.v_cache, v_base + j * a.v_stride[2] + 16 * k);
        for (int qi = 0; qi < NQ; ++qi) {
          const __m512 p = _mm512_set1_ps(s[qi * ctx + j]);
          for (int k = 0; k < ND; ++k) acc[qi][k] = _mm512_fmadd_ps(p, vv[k], acc[qi][k]);
        }
      }
      for (int qi = 0; qi < NQ; ++qi) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[qi]);
        for (int k = 0; k < ND; ++k)
          avx512::store(Q, a.out, row_of(i0 + qi) * d + 16 * k, _mm512_mul_ps(acc[qi][k], inv));
      }
    };
    with_constant<QB>(nq, weighted_sum);
  }
}

template <WeightType Q, WeightType C, int ND>
void tasks(const CacheAttention& a, int64_t begin, int64_t end) {
  thread_local std::vector<float> scores;
  for (int64_t t = begin; t < end; ++t) one_task<Q, C, ND>(a, t, scores);
}

template <WeightType Q, WeightType C>
void by_head_dim(const CacheAttention& a, int64_t begin, int64_t end) {
  switch (a.head_dim / 16) {
    case 1: return tasks<Q, C, 1>(a, begin, end);
    case 2: return tasks<Q, C, 2>(a, begin, end);
    case 3: return tasks<Q, C, 3>(a, begin, end);
    case 4: return tasks<Q, C, 4>(a, begin, end);
    case 5: return tasks<Q, C, 5>(a, begin, end);
    case 6: return tasks<Q, C, 6>(a, begin, end);
    case 7: return tasks<Q, C, 7>(a, begin, end);
    case 8: return tasks<Q, C, 8>(a, begin, end);
    case 9: return tasks<Q, C, 9>(a, begin, end);
    case 10: return tasks<Q, C, 10>(a, begin, end);
    case 11: return tasks<Q, C, 11>(a, begin, end);
    case 12: return tasks<Q, C, 12>(a, begin, end);
    case 13: return tasks<Q, C, 13>(a, begin, end);
    case 14: return tasks<Q, C, 14>(a, begin, end);
    case 15: return tasks<Q, C, 15>(a, begin, end);
    default: return tasks<Q, C, 16>(a, begin, end);
  }
}

}  // namespace

void cache_attention(const CacheAttention& a, int64_t begin, int64_t end) {
  using W = WeightType;
  if (a.type == a.cache_type) {
    if (a.type == W::kFloat32) return by_head_dim<W::kFloat32, W::kFloat32>(a, begin, end);
    if (a.type == W::kBFloat16) return by_head_dim<W::kBFloat16, W::kBFloat16>(a, begin, end);
    return by_head_dim<W::kFloat16, W::kFloat16>(a, begin, end);
  }
  // A float32 model's caches in a smaller dtype (cache_attention_types_supported: the only mixes).
  if (a.cache_type == W::kBFloat16) return by_head_dim<W::kFloat32, W::kBFloat16>(a, begin, end);
  return by_head_dim<W::kFloat32, W::kFloat16>(a, begin, end);
}

}  // namespace libpipe::cpu
