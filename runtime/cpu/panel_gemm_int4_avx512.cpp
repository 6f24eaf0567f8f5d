// The int4 and int8 kernels of panel_gemm.h without AVX512-VNNI (an Intel Skylake): VPMADDUBSW + VPMADDWD give the
// integer sums VPDPBUSD gives (panel_gemm_int4_vnni.cpp), so results do not depend on the CPU. Built with the AVX-512
// flags of panel_gemm_avx512.cpp, without VNNI.
#include <immintrin.h>

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

inline __m512i dot(__m512i sum, __m512i codes, __m512i row) {
  // Pairs of products as 16-bit sums (at most 2 x 15 x 127: no saturation), then pairs of those as 32-bit.
  const __m512i pairs = _mm512_maddubs_epi16(codes, row);
  return _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}

// The int8 weights' codes are q + 128 (0 .. 255): VPMADDUBSW's pair of two such products could reach 2 x 255 x 127 and
// saturate, so each code is split into its low 7 bits (pairs at most 2 x 127 x 127) and its top bit (times 128,
// added as 32-bit): the exact sums VPDPBUSD gives.
inline __m512i dot8(__m512i sum, __m512i codes, __m512i row) {
  const __m512i low = _mm512_and_si512(codes, _mm512_set1_epi8(0x7f));
  const __m512i top = _mm512_and_si512(_mm512_srli_epi16(codes, 7), _mm512_set1_epi8(1));
  const __m512i low_pairs = _mm512_maddubs_epi16(low, row), top_pairs = _mm512_maddubs_epi16(top, row);
  sum = _mm512_add_epi32(sum, _mm512_madd_epi16(low_pairs, _mm512_set1_epi16(1)));
  return _mm512_add_epi32(sum, _mm512_madd_epi16(top_pairs, _mm512_set1_epi16(128)));
}

#include "runtime/cpu/panel_gemm_int4.inc"
#include "runtime/cpu/panel_gemm_int8.inc"

}  // namespace

void int8_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant v) {
  if (v.vnni) return int8_product_vnni(p, unit_begin, unit_end, v.prefetch);
  return v.prefetch ? int8::product<true>(p, unit_begin, unit_end) : int8::product<false>(p, unit_begin, unit_end);
}

void int4_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant v) {
  if (v.vnni) return int4_product_vnni(p, unit_begin, unit_end, v.prefetch);
  return v.prefetch ? product<true>(p, unit_begin, unit_end) : product<false>(p, unit_begin, unit_end);
}

}  // namespace libpipe::cpu::avx512
