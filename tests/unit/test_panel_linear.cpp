// Linear layers on panels (runtime/cpu/panel_gemm.h, runtime/stage/panel_linear.h) against eager PyTorch:
// the kernels on odd shapes and a row count of 1 in every weight type, the sharing of a product between
// threads, and the rewrite of a stage's forward (one copy of each weight, tied embeddings).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "graph_nodes.h"
#include "runtime/cpu/panel_gemm.h"
#include "runtime/cpu/panel_gemm_kernels.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/torchscript/panel_rewrite.h"
#include "runtime/stage/spare_cores.h"

namespace libpipe {
namespace {

using test::count_nodes;

#define SKIP_WITHOUT_PANELS()                                                                            \
  if (!stage::panel_linear_available())                                                                  \
  GTEST_SKIP() << "this CPU has no AVX-512 (or LIBPIPE_PACKED_LINEAR=0 / LIBPIPE_CPU_ISA=none): linear " \
                  "layers stay aten::linear"

// Tolerance of a result in `dtype` against float32 arithmetic on the same (rounded) inputs: float32's
// summation order, or one rounding of the result to bfloat16 / float16.
void expect_close(const at::Tensor& got, const at::Tensor& reference, const std::string& what) {
  ASSERT_EQ(got.sizes(), reference.sizes()) << what;
  const at::Tensor g = got.to(at::kFloat), r = reference.to(at::kFloat);
  const double scale = r.abs().max().item<double>() + 1e-6;
  const double rtol = got.scalar_type() == at::kFloat ? 1e-5 : got.scalar_type() == at::kHalf ? 2e-3 : 1e-2;
  const double worst = ((g - r).abs() - rtol * r.abs()).max().item<double>();
  EXPECT_LE(worst, 4 * rtol * scale) << what << ": max difference " << (g - r).abs().max().item<double>();
}

// aten::linear in float32 on the inputs as `dtype` holds them.
at::Tensor reference_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(x.to(at::kFloat), w.to(at::kFloat), b.defined() ? b.to(at::kFloat) : at::Tensor());
}

cpu::WeightType weight_type(at::ScalarType t) {
  return t == at::kFloat      ? cpu::WeightType::kFloat32
         : t == at::kBFloat16 ? cpu::WeightType::kBFloat16
                              : cpu::WeightType::kFloat16;
}

// The kernel itself, both bfloat16 kernels where the CPU has VDPBF16PS.
at::Tensor kernel_product(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias, int64_t n, int64_t k,
                          bool native_bf16, int64_t unit_begin = 0, int64_t unit_end = -1, at::Tensor out = {},
                          bool prefetch = false) {
  if (!out.defined()) out = at::full({x.size(0), n}, 7.0, x.options());
  cpu::PanelProduct p;
  p.type = weight_type(x.scalar_type());
  p.x = x.data_ptr();
  p.ldx = k;
  p.panels = panels.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.ldo = n;
  p.m = x.size(0);
  p.n = n;
  p.k = k;
  cpu::KernelVariant variant;
  variant.native_bf16 = native_bf16;
  variant.prefetch = prefetch;
  cpu::avx512::panel_product(p, unit_begin, unit_end < 0 ? cpu::panel_units(n) : unit_end, variant);
  return out;
}

TEST(PanelLinear, KernelsEqualLinearOnOddShapesInEveryWeightType) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {1, 15, 17, 64, 65, 130, 576}) {
      for (int64_t k : {1, 3, 8, 17, 576}) {
        const at::Tensor w = at::randn({n, k}).to(dtype);
        const at::Tensor b = at::randn({n}).to(dtype);
        const at::Tensor panels = stage::to_panels(w);
        ASSERT_TRUE(panels.defined());
        for (int64_t m : {1, 2, 5, 6, 7, 13, 64}) {
          const at::Tensor x = at::randn({m, k}).to(dtype);
          for (bool with_bias : {false, true}) {
            const at::Tensor bias = with_bias ? b : at::Tensor();
            const at::Tensor want = reference_linear(x, w, bias);
            const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(m) + " x " +
                                     std::to_string(k) + " by " + std::to_string(n) + (with_bias ? " + bias" : "");
            expect_close(kernel_product(x, panels, bias, n, k, false), want, what + " (converting kernel)");
            if (dtype == at::kBFloat16 && cpu::cpu_has_avx512_bf16())
              expect_close(kernel_product(x, panels, bias, n, k, true), want, what + " (VDPBF16PS)");
            expect_close(stage::panel_linear(x, panels, bias, n, k), want, what + " (the operator)");
          }
        }
      }
    }
  }
}

// Every variant of the kernels (prefetching or not; for bfloat16, VDPBF16PS or pairs converted to float32) gives
// the same bits, so which one a process picks by measurement (cpu::KernelChoice) never changes a result: odd K,
// tail panels, every tile height and a bias included.
TEST(PanelLinear, EveryKernelVariantGivesTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(6);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t k : {1, 2, 17, 576, 1537}) {
      for (int64_t m : {1, 3, 6, 13}) {
        const int64_t n = 130;
        const at::Tensor w = at::randn({n, k}).to(dtype), b = at::randn({n}).to(dtype);
        const at::Tensor x = at::randn({m, k}).to(dtype);
        const at::Tensor panels = stage::to_panels(w);
        for (bool with_bias : {false, true}) {
          const at::Tensor bias = with_bias ? b : at::Tensor();
          const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(m) + " x " +
                                   std::to_string(k) + " by " + std::to_string(n) + (with_bias ? " + bias" : "");
          const at::Tensor plain = kernel_product(x, panels, bias, n, k, false);
          EXPECT_TRUE(at::equal(kernel_product(x, panels, bias, n, k, false, 0, -1, {}, true), plain))
              << what << ": prefetching";
          if (dtype == at::kBFloat16 && cpu::cpu_has_avx512_bf16()) {
            EXPECT_TRUE(at::equal(kernel_product(x, panels, bias, n, k, true), plain)) << what << ": VDPBF16PS";
            EXPECT_TRUE(at::equal(kernel_product(x, panels, bias, n, k, true, 0, -1, {}, true), plain))
                << what << ": VDPBF16PS, prefetching";
          }
        }
      }
    }
  }
}

// A range of units writes exactly its outputs, and the same bits as the whole product.
TEST(PanelLinear, UnitRangesWriteTheirOutputsOnlyWithTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(4);
  const int64_t n = 200, k = 33;  // 13 units, the last of 8 features
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor w = at::randn({n, k}).to(dtype), x = at::randn({9, k}).to(dtype);
    const at::Tensor panels = stage::to_panels(w);
    const at::Tensor whole = kernel_product(x, panels, {}, n, k, cpu::cpu_has_avx512_bf16());
    std::mt19937 rng(5);
    for (int trial = 0; trial < 20; ++trial) {
      const int64_t a = rng() % 14, b = a + rng() % (14 - a);
      at::Tensor out = at::full({9, n}, 7.0, x.options());
      kernel_product(x, panels, {}, n, k, cpu::cpu_has_avx512_bf16(), a, b, out);
      const int64_t first = std::min(a * 16, n), last = std::min(b * 16, n);
      if (first < last) {
        EXPECT_TRUE(at::equal(out.narrow(1, first, last - first), whole.narrow(1, first, last - first)))
            << "units " << a << " .. " << b;
      }
      EXPECT_TRUE(at::all(out.narrow(1, 0, first) == 7).item<bool>()) << "units " << a << " .. " << b;
      EXPECT_TRUE(at::all(out.narrow(1, last, n - last) == 7).item<bool>()) << "units " << a << " .. " << b;
    }
  }
}

TEST(PanelLinear, InputsOfMoreDimensionsAndARowCountOfZero) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const at::Tensor w = at::randn({70, 12});
  const at::Tensor panels = stage::to_panels(w);
  const at::Tensor x = at::randn({2, 3, 12});
  expect_close(stage::panel_linear(x, panels, std::nullopt, 70, 12), at::linear(x, w), "[2, 3, 12]");
  const at::Tensor one = at::randn({12});
  expect_close(stage::panel_linear(one, panels, std::nullopt, 70, 12), at::linear(one, w), "[12]");
  EXPECT_EQ(stage::panel_linear(at::randn({0, 12}), panels, std::nullopt, 70, 12).sizes(), (at::IntArrayRef{0, 70}));
  // A view that is not contiguous (every other column).
  const at::Tensor wide = at::randn({4, 24});
  const at::Tensor strided = wide.slice(1, 0, 24, 2);
  expect_close(stage::panel_linear(strided, panels, std::nullopt, 70, 12), at::linear(strided, w), "a strided view");
}

TEST(PanelLinear, EmbeddingRowsReadBackFromPanels) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor w = at::randn({130, 7}).to(dtype);
    const at::Tensor panels = stage::to_panels(w);
    const at::Tensor ids = at::tensor({0, 63, 64, 129, 5}, at::kLong).view({5, 1});
    EXPECT_TRUE(at::equal(stage::panel_embedding(panels, ids, 130, 7), at::embedding(w, ids))) << c10::toString(dtype);
    EXPECT_THROW(stage::panel_embedding(panels, at::tensor({130}, at::kLong), 130, 7), std::exception);
    EXPECT_THROW(stage::panel_embedding(panels, at::tensor({-1}, at::kLong), 130, 7), std::exception);
  }
}

TEST(PanelLinear, WrongInputsAreRefusedWithWhatWasWrong) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const at::Tensor panels = stage::to_panels(at::randn({12, 8}));
  auto message = [&](const at::Tensor& x) {
    try {
      stage::panel_linear(x, panels, std::nullopt, 12, 8);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(at::randn({3, 9})).find("takes 8 features"), std::string::npos);
  EXPECT_NE(message(at::randn({3, 8}, at::kDouble)).find("same dtype"), std::string::npos);
  EXPECT_THROW(stage::panel_linear(at::randn({3, 8}), panels, std::nullopt, 65, 8), std::exception);  // not its size
  EXPECT_FALSE(stage::to_panels(at::randn({3, 8}, at::kDouble)).defined());
  EXPECT_FALSE(stage::to_panels(at::randn({8})).defined());
}

// Three linear layers, one with a bias, one whose weight the forward computes (not an attribute: never
// rewritten), and a weight also read by an embedding lookup and one also read by another operator.
// int8_rows: w2's rows as the int8 kernel quantizes them (quantized_rows below), for a reference of an int8 w2.
torch::jit::Module layers(int64_t k, int64_t n, at::ScalarType dtype, uint64_t seed = 1, bool int8_rows = false) {
  at::manual_seed(seed);
  torch::jit::Module m("PanelLinearTest");
  m.register_parameter("w1", at::randn({n, k}).to(dtype), false);
  m.register_parameter("b1", at::randn({n}).to(dtype), false);
  m.register_parameter("w2", at::randn({k, n}).to(dtype), false);
  m.register_parameter("tied", at::randn({50, k}).to(dtype), false);
  m.register_parameter("shared", at::randn({k, k}).to(dtype), false);
  m.define(R"(
def rows(self, h):
    m = h.size(0)
    k = h.size(1)
    depth = (k + 31) // 32 * 32
    b = torch.constant_pad_nd(h.float(), [0, depth - k]).view([m, depth // 32, 32])
    s = b.abs().amax(2, True) / torch.full([1], 127.0)
    v = (b * torch.where(s > 0, 1.0 / s, torch.zeros_like(s))).double()
    c = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127)
    return (c * s.double()).view([m, depth])[:, :k].to(h.dtype)
)");
  m.define(std::string(R"(
def forward(self, x, ids):
    h = torch.linear(x, self.w1, self.b1)
)") + (int8_rows ? "    h = self.rows(h)\n" : "") +
           R"(
    h = torch.linear(h, self.w2)
    h = torch.linear(h, self.shared) + self.shared.sum()
    e = torch.embedding(self.tied, ids)
    return torch.linear(h, self.w1 * 0.5), torch.linear(h + e, self.tied)
)");
  return m;
}

TEST(PanelLinear, AStageHoldsOneCopyOfEachWeightAndEqualsTheModel) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const int64_t k = 96, n = 160;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    // Two modules, not a clone: a clone shares its methods' graphs, which the rewrite changes.
    torch::jit::Module rewritten = layers(k, n, dtype), plain = layers(k, n, dtype);
    EXPECT_EQ(stage::panel_linear_weights(rewritten), 4u);  // w1, w2, shared, tied; not the computed one
    const auto& graph = *rewritten.get_method("forward").graph();
    EXPECT_EQ(count_nodes(graph, "pipe::panel_linear"), 4u);
    EXPECT_EQ(count_nodes(graph, "aten::linear"), 1u);
    EXPECT_EQ(count_nodes(graph, "pipe::panel_embedding"), 1u);
    EXPECT_EQ(count_nodes(graph, "aten::embedding"), 0u);
    // Originals gone where nothing else reads them; kept (and still right) where sum() does.
    EXPECT_EQ(rewritten.attr("w2").toTensor().numel(), 0);
    EXPECT_EQ(rewritten.attr("tied").toTensor().numel(), 0);
    EXPECT_EQ(rewritten.attr("shared").toTensor().numel(), k * k);
    EXPECT_EQ(rewritten.attr("w1").toTensor().numel(), n * k);  // w1 * 0.5 reads it
    for (int64_t rows : {1, 2, 7, 65}) {
      const at::Tensor x = at::randn({rows, k}).to(dtype);
      const at::Tensor ids = at::randint(0, 50, {rows}, at::kLong);
      const auto want = plain.forward({x, ids}).toTuple()->elements();
      const auto got = rewritten.forward({x, ids}).toTuple()->elements();
      for (size_t i = 0; i < want.size(); ++i)
        expect_close(
            got[i].toTensor(), want[i].toTensor(),
            std::string(c10::toString(dtype)) + " output " + std::to_string(i) + ", " + std::to_string(rows) + " rows");
    }
  }
}

// int8 weights: the codes and scales of quantize_int8, the product by their panels against float64 arithmetic on
// the dequantized weight (scales[:, None] * codes) and the rows quantized as the kernel's contract says, on odd
// shapes, every row count class, float32 and bfloat16 rows, with and without a bias.
at::Tensor int8_panels(const at::Tensor& codes) {
  stage::PanelArena arena({codes});
  return arena.pack(0, codes);
}

// The rows as the int8 and int4 kernels see them (panel_gemm.h's quantize_rows), computed here with tensors: per
// block of 32 k (zero-padded), scale = max |x| / 127 and code = x * (1 / scale) rounded to nearest, halves away
// from zero, in float32 as the contract's scalar code does; returned as codes x scale in float64, [m, k].
at::Tensor quantized_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), depth = (k + 31) / 32 * 32;
  const at::Tensor blocks = at::constant_pad_nd(x.to(at::kFloat), {0, depth - k}).view({m, depth / 32, 32});
  const at::Tensor scale = blocks.abs().amax(2, true) / at::full({}, 127.0f);  // a division, as the kernel's
  const at::Tensor inverse = at::where(scale > 0, 1.0f / scale, at::zeros_like(scale));
  const at::Tensor v = (blocks * inverse).to(at::kDouble);
  const at::Tensor codes = (at::sign(v) * at::floor(v.abs() + 0.5)).clamp(-127, 127);
  return (codes * scale.to(at::kDouble)).view({m, depth}).narrow(1, 0, k);
}

TEST(PanelLinearInt8, QuantizationIsWithinHalfAStepOfEachWeight) {
  const at::Tensor w = at::randn({37, 71});
  const auto q = stage::quantize_int8(w);
  ASSERT_EQ(q.codes.scalar_type(), at::kChar);
  EXPECT_LE(q.codes.abs().max().item<int>(), 127);
  const at::Tensor dequantized = q.scales.unsqueeze(1) * q.codes.to(at::kFloat);
  EXPECT_TRUE(((dequantized - w).abs() <= q.scales.unsqueeze(1) * 0.5001).all().item<bool>());
  // Each row's largest magnitude is a code of 127.
  EXPECT_TRUE((q.codes.abs().amax(1) == 127).all().item<bool>());
  const auto zeros = stage::quantize_int8(at::zeros({2, 5}));  // an all-zero row keeps a usable scale
  EXPECT_TRUE((zeros.scales == 1).all().item<bool>());
}

TEST(PanelLinearInt8, PanelsHoldTheCodesAndGiveThemBack) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const int64_t n = 70, k = 37;  // a tail panel of 6 outputs; K padded to 64
  const auto q = stage::quantize_int8(at::randn({n, k}));
  const at::Tensor panels = int8_panels(q.codes);
  EXPECT_EQ(panels.numel(), 2 * 64 * 64);
  for (int64_t row : {0, 5, 63, 64, 69}) {
    at::Tensor back = at::empty({k}, at::kChar);
    cpu::unpack_row(cpu::WeightType::kInt8, panels.data_ptr(), n, k, row, back.data_ptr());
    EXPECT_TRUE(at::equal(back, q.codes[row])) << "row " << row;
  }
}

TEST(PanelLinearInt8, ProductsEqualTheDequantizedWeightOnOddShapes) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  for (int64_t n : {1, 17, 64, 100}) {
    for (int64_t k : {1, 5, 64, 131}) {
      const at::Tensor w = at::randn({n, k});
      const auto q = stage::quantize_int8(w);
      const at::Tensor panels = int8_panels(q.codes);
      const at::Tensor dequantized = q.scales.unsqueeze(1).to(at::kDouble) * q.codes.to(at::kDouble);
      const at::Tensor bias = at::randn({n});
      for (int64_t m : {1, 3, 6, 7, 13, 50}) {
        for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
          const at::Tensor x = at::randn({m, k}).to(dtype);
          for (bool with_bias : {false, true}) {
            const std::optional<at::Tensor> b = with_bias ? std::optional<at::Tensor>(bias.to(dtype)) : std::nullopt;
            const at::Tensor got = stage::panel_linear_int8(x, panels, q.scales, b, n, k);
            ASSERT_EQ(got.scalar_type(), dtype);
            const at::Tensor want =
                at::linear(quantized_rows(x), dequantized, with_bias ? bias.to(dtype).to(at::kDouble) : at::Tensor())
                    .to(dtype);
            expect_close(got, want,
                         std::to_string(m) + " x " + std::to_string(k) + " by " + std::to_string(n) + ", " +
                             c10::toString(dtype) + (with_bias ? ", bias" : ""));
          }
        }
      }
    }
  }
}

// The int8 kernel itself (VPDPBUSD or VPMADDUBSW, prefetching or not) on the rows as quantize_rows makes them.
at::Tensor int8_kernel(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales, const at::Tensor& bias,
                       int64_t n, bool vnni, bool prefetch, int64_t unit_begin = 0, int64_t unit_end = -1,
                       at::Tensor out = {}) {
  const int64_t m = x.size(0), k = x.size(1), depth = cpu::panel_depth(cpu::WeightType::kInt8, k);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor codes = at::empty({m, depth}, at::kChar), row_scales = at::empty({m, depth / 32}),
             sums = at::empty({m, depth / 32}, at::kInt);
  cpu::quantize_rows(xf.data_ptr<float>(), k, k, depth, codes.data_ptr<int8_t>(), row_scales.data_ptr<float>(),
                     sums.data_ptr<int32_t>(), 0, m);
  if (!out.defined()) out = at::full({m, n}, 7.0);
  cpu::PanelProduct p;
  p.type = cpu::WeightType::kInt8;
  p.xq = codes.data_ptr<int8_t>();
  p.xscales = row_scales.data_ptr<float>();
  p.xsums = sums.data_ptr<int32_t>();
  p.panels = panels.data_ptr();
  p.scales = scales.data_ptr<float>();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.ldo = n;
  p.m = m;
  p.n = n;
  p.k = depth;
  cpu::KernelVariant variant;
  variant.vnni = vnni;
  variant.prefetch = prefetch;
  cpu::avx512::int8_product(p, unit_begin, unit_end < 0 ? cpu::panel_units(n) : unit_end, variant);
  return out;
}

// The same bits from either kernel, with or without prefetching, for any tiling of the rows and any sharing of the
// units between threads; codes of both extremes (-127 and 127, stored as 1 and 255) against rows of both extremes,
// where VPMADDUBSW alone would saturate.
TEST(PanelLinearInt8, EveryKernelRowCountAndSharingGivesTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(7);
  const int64_t n = 200, k = 300;  // 13 units, the last of 8 features; K padded to 320
  at::Tensor w = at::randn({n, k});
  w.narrow(1, 0, 32).copy_(at::where(at::randn({n, 32}) > 0, at::ones({n, 32}), -at::ones({n, 32})) * 10);
  const auto q = stage::quantize_int8(w);
  ASSERT_EQ(q.codes.narrow(1, 0, 32).abs().min().item<int>(), 127);
  const at::Tensor panels = int8_panels(q.codes);
  at::Tensor x = at::randn({40, k});
  x.narrow(1, 0, 32).fill_(-3.0);  // codes -127 against weights of 127: pairs of -2 x 255 x 127 in VPMADDUBSW terms
  x.narrow(1, 32, 32).fill_(2.0);
  const at::Tensor bias = at::randn({n});
  const at::Tensor whole = int8_kernel(x, panels, q.scales, bias, n, false, false);
  const at::Tensor reference = at::linear(
      quantized_rows(x), q.scales.unsqueeze(1).to(at::kDouble) * q.codes.to(at::kDouble), bias.to(at::kDouble));
  EXPECT_LE((whole - reference).abs().max().item<double>(), 1e-5 * (reference.abs().max().item<double>() + 1));
  EXPECT_TRUE(at::equal(int8_kernel(x, panels, q.scales, bias, n, false, true), whole)) << "prefetching";
  if (cpu::cpu_has_avx512_vnni()) {
    EXPECT_TRUE(at::equal(int8_kernel(x, panels, q.scales, bias, n, true, false), whole)) << "VPDPBUSD";
    EXPECT_TRUE(at::equal(int8_kernel(x, panels, q.scales, bias, n, true, true), whole)) << "VPDPBUSD, prefetching";
  }
  for (int64_t m : {1, 2, 3, 4, 5, 13}) {
    for (int64_t row = 0; row + m <= 40; row += 11) {
      EXPECT_TRUE(
          at::equal(int8_kernel(x.narrow(0, row, m), panels, q.scales, bias, n, false, false), whole.narrow(0, row, m)))
          << m << " rows from " << row;
      if (cpu::cpu_has_avx512_vnni()) {
        EXPECT_TRUE(at::equal(int8_kernel(x.narrow(0, row, m), panels, q.scales, bias, n, true, false),
                              whole.narrow(0, row, m)))
            << m << " rows from " << row << ", VPDPBUSD";
      }
    }
  }
  at::Tensor shared = at::full({40, n}, 7.0);
  const bool vnni = cpu::cpu_has_avx512_vnni();
  std::thread first([&] { int8_kernel(x, panels, q.scales, bias, n, vnni, false, 0, 5, shared); });
  std::thread second([&] { int8_kernel(x, panels, q.scales, bias, n, vnni, false, 5, 13, shared); });
  first.join();
  second.join();
  EXPECT_TRUE(at::equal(shared, whole)) << "two threads";
  at::Tensor part = at::full({40, n}, 7.0);
  int8_kernel(x, panels, q.scales, bias, n, false, false, 3, 6, part);
  EXPECT_TRUE(at::equal(part.narrow(1, 48, 48), whole.narrow(1, 48, 48)));
  EXPECT_TRUE(at::all(part.narrow(1, 0, 48) == 7).item<bool>());
  EXPECT_TRUE(at::all(part.narrow(1, 96, n - 96) == 7).item<bool>());
}

// How far int8 weights and rows move a product from float32 (printed for the record, loosely bounded): Gaussian
// weights and rows, K = 2048.
TEST(PanelLinearInt8, ErrorAgainstTheFloatWeights) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(11);
  const int64_t n = 256, k = 2048;
  const at::Tensor w = at::randn({n, k}), x = at::randn({4, k});
  const at::Tensor exact = at::linear(x.to(at::kDouble), w.to(at::kDouble));
  const auto q = stage::quantize_int8(w);
  const at::Tensor dequantized = q.scales.unsqueeze(1).to(at::kDouble) * q.codes.to(at::kDouble);
  const double product_error =
      ((stage::panel_linear_int8(x, int8_panels(q.codes), q.scales, std::nullopt, n, k).to(at::kDouble) - exact)
           .norm() /
       exact.norm())
          .item<double>();
  const double weights_only =
      ((at::linear(x.to(at::kDouble), dequantized) - exact).norm() / exact.norm()).item<double>();
  std::printf("int8: product %.5f relative RMS (%.5f from the weights alone)\n", product_error, weights_only);
  EXPECT_LT(product_error, 0.02);
}

TEST(PanelLinearInt8, WrongInputsAreRefusedWithWhatWasWrong) {
  SKIP_WITHOUT_PANELS();
  const auto q = stage::quantize_int8(at::randn({12, 8}));
  const at::Tensor panels = int8_panels(q.codes);
  EXPECT_THROW(stage::panel_linear_int8(at::randn({3, 9}), panels, q.scales, std::nullopt, 12, 8), std::exception);
  EXPECT_THROW(stage::panel_linear_int8(at::randn({3, 8}), panels, q.scales.slice(0, 0, 11), std::nullopt, 12, 8),
               std::exception);
  EXPECT_THROW(stage::panel_linear_int8(at::randn({3, 8}), panels, q.scales, std::nullopt, 13, 8), std::exception);
  EXPECT_THROW(stage::panel_linear_int8(at::ones({3, 8}, at::kLong), panels, q.scales, std::nullopt, 12, 8),
               std::exception);
  EXPECT_THROW(stage::panel_linear_int8(at::randn({3, 8}), panels, q.scales, at::randn({5}), 12, 8), std::exception);
}

// A stage rewritten with int8 weights: the weights only linear layers read become int8 panels and their
// products pipe::panel_linear_int8; a tied embedding and a weight read otherwise keep their dtype; the stage
// equals the model whose quantized weights are replaced by their dequantized values and whose rows into them are
// quantized as the kernel's are.
TEST(PanelLinearInt8, AStageWithInt8WeightsEqualsTheDequantizedModel) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const int64_t k = 96, n = 160;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    torch::jit::Module rewritten = layers(k, n, dtype), reference = layers(k, n, dtype, 1, true);
    EXPECT_EQ(stage::panel_linear_weights(rewritten, stage::WeightQuantization::Int8), 4u);
    const auto& graph = *rewritten.get_method("forward").graph();
    EXPECT_EQ(count_nodes(graph, "pipe::panel_linear_int8"), 1u);  // w2: w1 and shared are read otherwise
    EXPECT_EQ(count_nodes(graph, "pipe::panel_embedding"), 1u);    // tied keeps its dtype
    EXPECT_EQ(rewritten.attr("w2_scales").toTensor().numel(), k);  // w2 is [k, n]: k outputs
    // The reference: w2 replaced by its dequantized values, in the model's dtype.
    const auto q = stage::quantize_int8(reference.attr("w2").toTensor());
    reference.register_parameter("w2", (q.scales.unsqueeze(1) * q.codes.to(at::kFloat)).to(dtype), false);
    for (int64_t rows : {1, 7, 65}) {
      const at::Tensor x = at::randn({rows, k}).to(dtype);
      const at::Tensor ids = at::randint(0, 50, {rows}, at::kLong);
      const auto want = reference.forward({x, ids}).toTuple()->elements();
      const auto got = rewritten.forward({x, ids}).toTuple()->elements();
      for (size_t i = 0; i < want.size(); ++i)
        expect_close(got[i].toTensor(), want[i].toTensor(),
                     std::string("int8, ") + c10::toString(dtype) + " output " + std::to_string(i) + ", " +
                         std::to_string(rows) + " rows");
    }
  }
}

// Products of one input (q, k, v with and without a bias) become one pipe::panel_linear_group; its outputs have the
// bits of the products computed one by one; a product of another input stays alone.
TEST(PanelLinear, ProductsOfOneInputAreGroupedWithTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const int64_t k = 80;
  auto attention = [&](at::ScalarType dtype) {
    at::manual_seed(9);
    torch::jit::Module m("GroupTest");
    m.register_parameter("q", at::randn({96, k}).to(dtype), false);
    m.register_parameter("qb", at::randn({96}).to(dtype), false);
    m.register_parameter("k", at::randn({40, k}).to(dtype), false);
    m.register_parameter("v", at::randn({40, k}).to(dtype), false);
    m.register_parameter("o", at::randn({k, 96}).to(dtype), false);
    m.define(R"(
def forward(self, x):
    q = torch.linear(x, self.q, self.qb)
    s = q.sum()
    k = torch.linear(x, self.k)
    v = torch.linear(x, self.v)
    return torch.linear(q, self.o) + s, k * 2, v
)");
    return m;
  };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    torch::jit::Module grouped = attention(dtype), alone = attention(dtype), plain = attention(dtype);
    EXPECT_EQ(stage::panel_linear_weights(grouped), 4u);
    setenv("LIBPIPE_GROUPED_LINEAR", "0", 1);
    EXPECT_EQ(stage::panel_linear_weights(alone), 4u);
    unsetenv("LIBPIPE_GROUPED_LINEAR");
    EXPECT_EQ(count_nodes(*grouped.get_method("forward").graph(), "pipe::panel_linear_group"), 1u);
    EXPECT_EQ(count_nodes(*grouped.get_method("forward").graph(), "pipe::panel_linear"), 1u);  // o: another input
    EXPECT_EQ(count_nodes(*alone.get_method("forward").graph(), "pipe::panel_linear"), 4u);
    for (int64_t rows : {1, 3, 7, 50}) {
      const at::Tensor x = at::randn({rows, k}).to(dtype);
      const auto got = grouped.forward({x}).toTuple()->elements();
      const auto one_by_one = alone.forward({x}).toTuple()->elements();
      const auto want = plain.forward({x}).toTuple()->elements();
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string what =
            std::string(c10::toString(dtype)) + " output " + std::to_string(i) + ", " + std::to_string(rows) + " rows";
        EXPECT_TRUE(at::equal(got[i].toTensor(), one_by_one[i].toTensor())) << what;
        expect_close(got[i].toTensor(), want[i].toTensor(), what);
      }
    }
  }
}

// Under int8 and int4 the products of one input become one pipe::panel_linear_int8_group / _int4_group (the rows
// quantized once, one hand-over to the lent cores): the same bits as the products one by one, each close to its
// dequantized weight's product; a product of another input stays alone.
TEST(PanelLinear, QuantizedProductsOfOneInputAreGroupedWithTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const int64_t k = 80;  // not a multiple of 32: padded depth
  auto attention = [&] {
    at::manual_seed(11);
    torch::jit::Module m("QuantizedGroupTest");
    m.register_parameter("q", at::randn({96, k}), false);
    m.register_parameter("qb", at::randn({96}), false);
    m.register_parameter("k", at::randn({40, k}), false);  // 40: a partial unit of 16 outputs
    m.register_parameter("v", at::randn({40, k}), false);
    m.register_parameter("o", at::randn({k, 96}), false);
    // Nothing returns a product as it is: the output head's rule (int8 under int4) stays out of this test.
    m.define(R"(
def forward(self, x):
    q = torch.linear(x, self.q, self.qb)
    s = q.sum()
    k = torch.linear(x, self.k)
    v = torch.linear(x, self.v)
    return torch.linear(q, self.o) * 2 + s, k * 2, v * 3
)");
    return m;
  };
  struct Case {
    stage::WeightQuantization as;
    const char *single, *grouped;
  };
  for (const Case& c :
       {Case{stage::WeightQuantization::Int8, "pipe::panel_linear_int8", "pipe::panel_linear_int8_group"},
        Case{stage::WeightQuantization::Int4, "pipe::panel_linear_int4", "pipe::panel_linear_int4_group"}}) {
    torch::jit::Module grouped = attention(), alone = attention(), plain = attention();
    EXPECT_EQ(stage::panel_linear_weights(grouped, c.as), 4u);
    setenv("LIBPIPE_GROUPED_LINEAR", "0", 1);
    EXPECT_EQ(stage::panel_linear_weights(alone, c.as), 4u);
    unsetenv("LIBPIPE_GROUPED_LINEAR");
    EXPECT_EQ(count_nodes(*grouped.get_method("forward").graph(), c.grouped), 1u) << c.grouped;
    EXPECT_EQ(count_nodes(*grouped.get_method("forward").graph(), c.single), 1u) << c.single;  // o: another input
    EXPECT_EQ(count_nodes(*alone.get_method("forward").graph(), c.single), 4u) << c.single;
    for (int64_t rows : {1, 3, 7, 50}) {
      const at::Tensor x = at::randn({rows, k});
      const auto got = grouped.forward({x}).toTuple()->elements();
      const auto one_by_one = alone.forward({x}).toTuple()->elements();
      const auto want = plain.forward({x}).toTuple()->elements();
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string what =
            std::string(c.grouped) + " output " + std::to_string(i) + ", " + std::to_string(rows) + " rows";
        EXPECT_TRUE(at::equal(got[i].toTensor(), one_by_one[i].toTensor())) << what;
        // Against the float weights: the codes' error (4 bits: a few percent of the outputs' scale).
        const at::Tensor err = (got[i].toTensor() - want[i].toTensor()).abs().max();
        const at::Tensor scale = want[i].toTensor().abs().max();
        EXPECT_LT(err.item<double>(), 0.15 * scale.item<double>()) << what;
      }
    }
  }
}

// A product shared with a lent core gives the same bits as on one thread.
TEST(PanelLinear, SharedWithLentCoresGivesTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  const at::Tensor w = at::randn({4100, 64});  // 257 units: more than one piece per core
  const at::Tensor panels = stage::to_panels(w);
  stage::SpareCores pool(2);
  for (int64_t rows : {1, 3, 17}) {
    const at::Tensor x = at::randn({rows, 64});
    const at::Tensor alone = stage::panel_linear(x, panels, std::nullopt, 4100, 64);
    at::Tensor shared;
    {
      stage::SpareCores::Lend lend(&pool);
      stage::SpareCores::Busy busy(&pool);
      shared = stage::panel_linear(x, panels, std::nullopt, 4100, 64);
    }
    EXPECT_TRUE(at::equal(shared, alone)) << rows << " rows";
    expect_close(alone, at::linear(x, w), std::to_string(rows) + " rows");
  }
}

}  // namespace
}  // namespace libpipe
