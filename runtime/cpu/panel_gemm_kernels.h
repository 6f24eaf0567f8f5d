// The AVX-512 kernels' entry point (panel_gemm_avx512.cpp, built with AVX-512 flags); only panel_gemm.cpp
// calls it, after checking the CPU.
#pragma once

#include <cstdint>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu::avx512 {

void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant variant);
// cpu::quantize_rows in AVX-512, the same bits (panel_gemm.cpp calls it where the CPU has the kernels).
void quantize_rows(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales, int32_t* sums,
                   int64_t row_begin, int64_t row_end);
// The int4 kernels (panel_gemm_int4_avx512.cpp); panel_product calls them for WeightType::kInt4. With
// variant.vnni (only where the CPU has AVX512-VNNI) they call int4_product_vnni (panel_gemm_int4_vnni.cpp).
void int4_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant variant);
void int4_product_vnni(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, bool prefetch);
// The int8 kernels, beside them (the same files, the same two ways to the same integer sums).
void int8_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant variant);
void int8_product_vnni(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, bool prefetch);

}  // namespace libpipe::cpu::avx512
