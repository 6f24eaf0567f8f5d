// The fused element-wise operators (runtime/stage/torchscript/fused_elementwise.h, runtime/cpu/elementwise.h) against
// the eager operators they replace, in every dtype, on odd sizes and one row; and the rewrite of a decoder layer's
// patterns.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/serialization/import.h>

#include <string>
#include <vector>

#include "fixtures.h"
#include "graph_nodes.h"
#include "runtime/cpu/panel_gemm.h"
#include "runtime/stage/torchscript/fused_elementwise.h"

namespace libpipe {
namespace {

using test::count_nodes;

#define SKIP_WITHOUT_KERNELS() \
  if (!cpu::cpu_has_panel_kernels()) GTEST_SKIP() << "this CPU has no AVX-512: the operators run the eager ones"

// Eager PyTorch's results, computed the same way, must agree to within the dtype's last bit at the result's scale
// (the kernels round where eager rounds; only float32 sums may run in another order).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double tol = got.scalar_type() == at::kFloat ? 1e-5 : got.scalar_type() == at::kHalf ? 1e-3 : 8e-3;
  EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), tol, tol))
      << what << ": max difference " << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
}

at::Tensor eager_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  return weight * (h * at::rsqrt(h.pow(2).mean({-1}, true) + eps)).to(x.scalar_type());
}

at::Tensor eager_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf};

TEST(FusedElementwise, RmsNormEqualsEager) {
  SKIP_WITHOUT_KERNELS();
  c10::InferenceMode guard;
  at::manual_seed(1);
  for (at::ScalarType dtype : kDtypes)
    for (int64_t cols : {1, 7, 16, 100, 576})
      for (int64_t rows : {1, 3, 300}) {
        const at::Tensor x = (at::randn({rows, cols}) * 3).to(dtype), w = at::randn({cols}).to(dtype);
        expect_close(stage::rms_norm(x, w, 1e-5), eager_rms_norm(x, w, 1e-5),
                     std::string(c10::toString(dtype)) + " " + std::to_string(rows) + " x " + std::to_string(cols));
      }
  // What the kernel does not take runs the eager operators: a float32 weight on bfloat16 values, a 3-d input.
  const at::Tensor x = at::randn({2, 3, 8}).to(at::kBFloat16), w = at::randn({8});
  EXPECT_TRUE(at::equal(stage::rms_norm(x, w, 1e-6), eager_rms_norm(x, w, 1e-6)));
  const at::Tensor y = at::randn({2, 3, 8});
  expect_close(stage::rms_norm(y, at::ones({8}), 1e-6), eager_rms_norm(y, at::ones({8}), 1e-6), "3-d");
}

TEST(FusedElementwise, AddRmsNormEqualsTheAddThenTheNorm) {
  SKIP_WITHOUT_KERNELS();
  c10::InferenceMode guard;
  at::manual_seed(5);
  for (at::ScalarType dtype : kDtypes)
    for (int64_t cols : {1, 7, 16, 100, 576})
      for (int64_t rows : {1, 3, 300}) {
        const std::string what =
            std::string(c10::toString(dtype)) + " " + std::to_string(rows) + " x " + std::to_string(cols);
        const at::Tensor x = (at::randn({rows, cols}) * 3).to(dtype), y = at::randn({rows, cols}).to(dtype);
        const at::Tensor w = at::randn({cols}).to(dtype);
        const auto [sum, out] = stage::add_rms_norm(x, y, w, 1e-5);
        // The residual stream is aten's add, bit for bit; the norm is the norm of that sum (the same kernel's
        // arithmetic, so bit for bit too) and close to eager's.
        EXPECT_TRUE(at::equal(sum, x + y)) << what;
        EXPECT_TRUE(at::equal(out, stage::rms_norm(x + y, w, 1e-5))) << what;
        expect_close(out, eager_rms_norm(x + y, w, 1e-5), what);
      }
  // What the kernel does not take runs the add and the norm as they are: a broadcast, mixed dtypes.
  const at::Tensor x = at::randn({3, 8}), row = at::randn({8}), w = at::randn({8});
  const auto [sum, out] = stage::add_rms_norm(x, row, w, 1e-6);
  EXPECT_TRUE(at::equal(sum, x + row));
  EXPECT_TRUE(at::equal(out, stage::rms_norm(x + row, w, 1e-6)));
  const at::Tensor half = at::randn({3, 8}).to(at::kBFloat16);
  const auto [mixed_sum, mixed_out] = stage::add_rms_norm(x, half, w, 1e-6);
  EXPECT_TRUE(at::equal(mixed_sum, x + half));
  EXPECT_EQ(mixed_sum.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(mixed_out, stage::rms_norm(x + half, w, 1e-6)));
}

TEST(FusedElementwise, RotaryEqualsEager) {
  SKIP_WITHOUT_KERNELS();
  c10::InferenceMode guard;
  at::manual_seed(2);
  for (at::ScalarType dtype : kDtypes)
    for (int64_t dim : {2, 24, 64, 128})  // 24: the middle falls inside a vector
      for (int64_t tokens : {1, 5}) {
        const int64_t heads = 3;
        const at::Tensor x = at::randn({tokens, heads, dim}).to(dtype);
        const at::Tensor angles = at::randn({tokens, dim});
        const at::Tensor cos = angles.cos().to(dtype).unsqueeze(1), sin = angles.sin().to(dtype).unsqueeze(1);
        expect_close(stage::rotary(x, cos, sin), eager_rotary(x, cos, sin),
                     std::string(c10::toString(dtype)) + " dim " + std::to_string(dim) + ", " + std::to_string(tokens) +
                         " tokens");
      }
  // Angles of another shape (per head): the eager operators.
  const at::Tensor x = at::randn({2, 3, 8}), c = at::randn({2, 3, 8}), s = at::randn({2, 3, 8});
  EXPECT_TRUE(at::equal(stage::rotary(x, c, s), eager_rotary(x, c, s)));
}

TEST(FusedElementwise, SiluMulEqualsEager) {
  SKIP_WITHOUT_KERNELS();
  c10::InferenceMode guard;
  at::manual_seed(3);
  for (at::ScalarType dtype : kDtypes)
    for (int64_t n : {1, 15, 1536, 3 * 1536 + 5}) {
      at::Tensor gate = (at::randn({n}) * 4).to(dtype);
      if (n > 2) {
        gate[0] = -100.0;  // exp(100) overflows in float32: silu is -0, not NaN
        gate[1] = 90.0;
      }
      const at::Tensor up = at::randn({n}).to(dtype);
      expect_close(stage::silu_mul(gate, up), at::silu(gate) * up,
                   std::string(c10::toString(dtype)) + " " + std::to_string(n));
    }
  const at::Tensor g = at::randn({4, 6}), u = at::randn({6});  // broadcast: eager
  EXPECT_TRUE(at::equal(stage::silu_mul(g, u), at::silu(g) * u));
}

// A decoder layer's element-wise chains, written as libpipe.decoders.llama writes them.
torch::jit::Module layer(at::ScalarType dtype) {
  at::manual_seed(4);
  torch::jit::Module m("FusedElementwiseTest");
  m.register_parameter("weight", at::randn({64}).to(dtype), false);
  m.register_attribute("eps", c10::FloatType::get(), 1e-5);
  m.define(R"(
def rotate_half(self, x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

def forward(self, residual, x, cos, sin, gate, up):
    x = residual + x
    dtype = x.dtype
    h = x.to(6)  # torch.float32
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    normed = self.weight * h.to(dtype)
    q = normed.view(normed.shape[0], 4, 16)
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    q = q * c + self.rotate_half(q) * s
    return q, torch.silu(gate) * up, x
)");
  return m;
}

TEST(FusedElementwise, TheDecodersPatternsAreRewrittenAndComputeTheSame) {
  SKIP_WITHOUT_KERNELS();
  c10::InferenceMode guard;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    torch::jit::Module fused = layer(dtype), plain = layer(dtype);
    // The stage's forward as libpipe builds it: calls inlined.
    auto graph = fused.get_method("forward").graph();
    torch::jit::Inline(*graph);
    EXPECT_EQ(stage::fuse_elementwise(fused), 3u);
    EXPECT_EQ(count_nodes(*graph, "pipe::add_rms_norm"), 1u);
    EXPECT_EQ(count_nodes(*graph, "pipe::rms_norm"), 0u);
    EXPECT_EQ(count_nodes(*graph, "aten::add"), 0u);  // the residual add, the norm's + eps and the rotary's sum
    EXPECT_EQ(count_nodes(*graph, "pipe::rotary"), 1u);
    EXPECT_EQ(count_nodes(*graph, "pipe::silu_mul"), 1u);
    EXPECT_EQ(count_nodes(*graph, "aten::rsqrt"), 0u);
    EXPECT_EQ(count_nodes(*graph, "aten::cat"), 0u);
    for (int64_t rows : {1, 9}) {
      const at::Tensor x = at::randn({rows, 64}).to(dtype);
      const at::Tensor angles = at::randn({rows, 16});
      const std::vector<c10::IValue> inputs{at::randn({rows, 64}).to(dtype), x,
                                            angles.cos().to(dtype),          angles.sin().to(dtype),
                                            at::randn({rows, 40}).to(dtype), at::randn({rows, 40}).to(dtype)};
      const auto want = plain.forward(inputs).toTuple()->elements();
      const auto got = fused.forward(inputs).toTuple()->elements();
      for (size_t i = 0; i < want.size(); ++i)
        expect_close(got[i].toTensor(), want[i].toTensor(), "output " + std::to_string(i));
    }
  }
}

// libpipe.decoders' own layers (the tiny Llama of tests/models/decoder_models.py, 2 layers): every norm, rotary
// embedding and SwiGLU of the inlined forward is fused.
TEST(FusedElementwise, EveryChainOfTheDecoderIsFused) {
  SKIP_WITHOUT_KERNELS();
  torch::jit::Module decoder = torch::jit::load(test::fixture("tiny_decoder.pt"));
  auto graph = decoder.get_method("forward").graph();
  torch::jit::Inline(*graph);
  const size_t layers = 2;
  EXPECT_EQ(stage::fuse_elementwise(decoder), layers * 2 + 1 + layers * 2 + layers) << *graph;
  EXPECT_EQ(count_nodes(*graph, "aten::rsqrt"), 0u);
  // A residual add goes with the norm that reads it: each layer's post-attention norm and the next layer's input
  // norm. The first layer's input norm reads the embedding, and the final norm the rows the head needs, selected
  // from the last layer's sum: those two stay plain norms.
  EXPECT_EQ(count_nodes(*graph, "pipe::add_rms_norm"), layers * 2 - 1);
  EXPECT_EQ(count_nodes(*graph, "pipe::rms_norm"), 2u);
  EXPECT_EQ(count_nodes(*graph, "aten::silu"), 0u);
  EXPECT_EQ(count_nodes(*graph, "aten::cat"), 1u);  // the rotary embedding's cat((freqs, freqs)), once per call
}

}  // namespace
}  // namespace libpipe
