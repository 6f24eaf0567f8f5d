#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdlib>

#include "runtime/stage/packed_linear.h"
#include "runtime/stage/spare_cores.h"
#include "graph_nodes.h"

namespace libpipe {
namespace {

using test::count_nodes;

// A module whose forward is three linear layers: one with a bias, one without, one whose weight the
// forward computes (not an attribute: never packed). Modules made from the same seed hold equal weights.
torch::jit::Module three_linears(int64_t k, int64_t n, uint64_t seed = 1) {
  at::manual_seed(seed);
  torch::jit::Module m("PackedLinearTest");
  m.register_parameter("w1", at::randn({n, k}), false);
  m.register_parameter("b1", at::randn({n}), false);
  m.register_parameter("w2", at::randn({k, n}), false);
  m.define(R"(
def forward(self, x):
    h = torch.linear(x, self.w1, self.b1)
    h = torch.linear(h, self.w2)
    return torch.linear(h, self.w1 * 0.5)
)");
  return m;
}

bool packing_expected() {
  const char* env = std::getenv("LIBPIPE_PACKED_LINEAR");
  return at::globalContext().hasMKL() && !(env && std::string(env) == "0");
}

TEST(PackedLinear, ConstantWeightsArePackedAndResultsEqualLinear) {
  c10::InferenceMode guard;
  const int64_t k = 96, n = 160;
  // Two modules, not a clone: a clone shares its methods' graphs, which packing rewrites.
  torch::jit::Module packed = three_linears(k, n), plain = three_linears(k, n);
  const size_t rewritten = stage::pack_linear_weights(packed);
  const auto& graph = *packed.get_method("forward").graph();
  if (!packing_expected()) {
    EXPECT_EQ(rewritten, 0u);
    GTEST_SKIP() << "this LibTorch has no MKL (or LIBPIPE_PACKED_LINEAR=0): nothing is packed";
  }
  EXPECT_EQ(rewritten, 2u);  // w1 and w2 (once each); the computed weight stays aten::linear
  EXPECT_EQ(count_nodes(graph, "pipe::packed_linear"), 2u);
  EXPECT_EQ(count_nodes(graph, "aten::linear"), 1u);
  // Rows on both sides of kPackedMinRows and kPackedMaxRows, and inputs of more than two dimensions.
  for (auto shape :
       std::vector<std::vector<int64_t>>{{1, k}, {2, k}, {3, k}, {17, k}, {64, k}, {65, k}, {200, k}, {2, 5, k}, {k}}) {
    at::Tensor x = at::randn(shape);
    at::Tensor want = plain.forward({x}).toTensor();
    at::Tensor got = packed.forward({x}).toTensor();
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-4))
        << "input " << x.sizes() << ": max difference " << (got - want).abs().max().item<double>();
  }
}

// Weights cut into chunks of output features (for cores a stage borrows) give aten::linear's results
// for every row count, and the same results whether the chunks ran on one thread or on several.
TEST(PackedLinear, WeightsCutInChunksGiveLinearsResultsOnAnyThreads) {
  c10::InferenceMode guard;
  const int64_t k = 96;
  for (int chunks : {2, 3}) {
    const int64_t n = 400;  // 3 chunks of 144, 144 and 112 features; or 2 of 208 and 192
    torch::jit::Module packed = three_linears(k, n), plain = three_linears(k, n);
    const size_t rewritten = stage::pack_linear_weights(packed, chunks);
    if (!packing_expected()) {
      EXPECT_EQ(rewritten, 0u);
      GTEST_SKIP() << "this LibTorch has no MKL (or LIBPIPE_PACKED_LINEAR=0): nothing is packed";
    }
    ASSERT_EQ(rewritten, 2u);
    stage::SpareCores pool(chunks);
    for (int64_t rows : {1, 2, 3, 4, 17, 64, 65}) {
      at::Tensor x = at::randn({rows, k});
      at::Tensor want = plain.forward({x}).toTensor();
      at::Tensor alone = packed.forward({x}).toTensor();
      at::Tensor shared;
      {
        stage::SpareCores::Lend lend(&pool);
        shared = packed.forward({x}).toTensor();
      }
      EXPECT_TRUE(at::allclose(alone, want, 1e-4, 1e-4))
          << chunks << " chunks, " << rows << " rows: max difference " << (alone - want).abs().max().item<double>();
      EXPECT_TRUE(at::equal(shared, alone)) << chunks << " chunks, " << rows << " rows";
    }
  }
}

TEST(PackedLinear, WrongInputsGetLinearsOwnError) {
  c10::InferenceMode guard;
  torch::jit::Module m = three_linears(8, 12);
  stage::pack_linear_weights(m);
  EXPECT_THROW(m.forward({at::randn({3, 9})}), std::exception);               // wrong feature count
  EXPECT_THROW(m.forward({at::randn({3, 8}, at::kDouble)}), std::exception);  // another dtype
}

}  // namespace
}  // namespace libpipe
