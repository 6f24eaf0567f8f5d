// The AVX-512 kernels' entry point (panel_gemm_avx512.cpp, built with AVX-512 flags); only panel_gemm.cpp
// calls it, after checking the CPU.
#pragma once

#include <cstdint>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu::avx512 {

void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end, KernelVariant variant);

}  // namespace libpipe::cpu::avx512
