// The int4 and int8 kernels of panel_gemm.h by AVX512-VNNI's VPDPBUSD: this file alone is compiled with -mavx512vnni,
// and runs only where the CPU has it (cpu_has_avx512_vnni).
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

inline __m512i dot(__m512i sum, __m512i codes, __m512i row) { return _mm512_dpbusd_epi32(sum, codes, row); }
inline __m512i dot8(__m512i sum, __m512i codes, __m512i row) { return _mm512_dpbusd_epi32(sum, codes, row); }

#include "runtime/cpu/panel_gemm_int4.inc"
#include "runtime/cpu/panel_gemm_int8.inc"

}  // namespace

void int8_product_vnni(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, bool prefetch) {
  return prefetch ? int8::product<true>(p, unit_begin, unit_end) : int8::product<false>(p, unit_begin, unit_end);
}

void int4_product_vnni(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, bool prefetch) {
  return prefetch ? product<true>(p, unit_begin, unit_end) : product<false>(p, unit_begin, unit_end);
}

}  // namespace libpipe::cpu::avx512
