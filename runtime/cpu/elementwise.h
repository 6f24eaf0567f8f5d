// The element-wise work of a decoder layer in one pass each: RMSNorm (alone or after its residual add), rotary
// position embedding, SiLU(gate) * up.
//
// In a TorchScript decoder each of these is 4-12 operators (casts, powers, means, slices, a concatenation, products
// and sums), each a dispatch, an allocation and a pass over its tensor; in a decode step of one row they took a
// quarter of a stage's time (bench/RESULTS.md). These kernels do the same arithmetic in one pass, rounding where
// eager PyTorch rounds (the intermediate results a bfloat16 or float16 model stores in its dtype are rounded to it
// here too), so that results equal eager's up to float32's order of summation.
//
// Plain C++ over raw pointers; AVX-512 kernels (elementwise_avx512.cpp) used only where panel_gemm.h's
// cpu_has_panel_kernels() holds. Rows are independent: callers spread row ranges over threads.
#pragma once

#include <cstdint>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu {

// out[r] = weight * to_dtype(to_float32(x[r]) * rsqrt(mean(to_float32(x[r])^2) + eps)), for rows [begin, end) of
// `cols` values each (x and out contiguous rows, weight [cols]); Hugging Face's LlamaRMSNorm.
void rms_norm(WeightType type, const void* x, const void* weight, void* out, int64_t cols, float eps, int64_t begin,
              int64_t end);

// sum[r] = x[r] + y[r], rounded to the type as aten's add stores it, and out[r] = rms_norm of sum[r], for rows
// [begin, end): a residual connection and the RMSNorm that reads it, in one pass over the row (the sum is the
// residual stream the layer's next connection adds to). Results equal add then rms_norm bit for bit.
void add_rms_norm(WeightType type, const void* x, const void* y, const void* weight, void* sum, void* out, int64_t cols,
                  float eps, int64_t begin, int64_t end);

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]), for rows [begin, end) of x
// [rows, dim]; row r uses cos/sin row r / heads ([rows / heads, dim]): the queries or keys [N, heads, dim] of N
// tokens with each token's angles.
void rotary(WeightType type, const void* x, const void* cos, const void* sin, void* out, int64_t dim, int64_t heads,
            int64_t begin, int64_t end);

// out = silu(gate) * up over elements [begin, end).
void silu_mul(WeightType type, const void* gate, const void* up, void* out, int64_t begin, int64_t end);

}  // namespace libpipe::cpu
