// A CPU stage's element-wise chains as one operator each (runtime/cpu/elementwise.h).
//
// fuse_elementwise rewrites, in a stage's forward, the patterns libpipe.decoders' layers (and Hugging Face's Llama
// code, which they follow) compile to:
//   RMSNorm   x.to(float32); h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); weight * h.to(x.dtype)
//             -> pipe::rms_norm(x, weight, eps)
//   residual  sum = x + y; rms_norm(sum)                                -> pipe::add_rms_norm(x, y, weight, eps),
//             both sum and the norm outputs (LIBPIPE_FUSED_RESIDUAL=0 leaves the add and the norm apart)
//   rotary    x * cos + cat(-x[..., half:], x[..., :half]) * sin      -> pipe::rotary(x, cos, sin)
//   SwiGLU    silu(gate) * up                                         -> pipe::silu_mul(gate, up)
// Each op computes the pattern's arithmetic in one pass with the pattern's roundings where its inputs are what
// the kernels take (CPU, float32 / bfloat16 / float16, the shapes a decoder gives them, AVX-512), and runs the
// original operators otherwise, so a rewritten stage gives the pattern's results (and errors) on any input.
// LIBPIPE_FUSED_ELEMENTWISE=0 leaves stages as they are.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include <tuple>

namespace libpipe::stage {

// Call before the stage's first run. Returns the number of patterns rewritten.
size_t fuse_elementwise(torch::jit::Module& stage);

// The ops, for tests.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                                double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

}  // namespace libpipe::stage
