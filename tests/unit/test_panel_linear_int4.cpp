// 4-bit weights (runtime/cpu/panel_gemm.h's int4 panels, runtime/stage/panel_linear.h's quantize_int4 and
// pipe::panel_linear_int4) against a reference computed here from the codes: the weight dequantized, the rows
// quantized to int8 per block of 32 as the kernel's contract says, multiplied in float64. Every group size, K
// not a multiple of the group (padded), N not a multiple of 64, rows 1 .. 40; the same bits from either kernel
// (VPDPBUSD or VPMADDUBSW), with or without prefetching, for any sharing of the units between threads and
// whatever the other rows of the product.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cmath>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "runtime/cpu/panel_gemm.h"
#include "runtime/cpu/panel_gemm_kernels.h"
#include "graph_nodes.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage.h"
#include "runtime/stage/torchscript/panel_rewrite.h"

namespace libpipe {
namespace {

#define SKIP_WITHOUT_PANELS()                                                                            \
  if (!stage::panel_linear_available())                                                                  \
  GTEST_SKIP() << "this CPU has no AVX-512 (or LIBPIPE_PACKED_LINEAR=0 / LIBPIPE_CPU_ISA=none): linear " \
                  "layers stay aten::linear"

// The rows as the kernel sees them, computed independently of cpu::quantize_rows: per block of 32 k, scale =
// max |x| / 127, codes round(x / scale), in float64.
at::Tensor quantized_rows(const at::Tensor& x, int64_t depth) {
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor padded = at::constant_pad_nd(x.to(at::kDouble), {0, depth - k}).view({m, depth / 32, 32});
  const at::Tensor scale = padded.abs().amax(2, true) / 127.0;
  const at::Tensor codes = at::where(scale > 0, at::round(padded / scale), at::zeros_like(padded));
  return (codes * scale).view({m, depth}).narrow(1, 0, k);
}

struct Quantized {
  stage::Int4Weight q;
  at::Tensor panels;
  at::Tensor weight;  // dequantized, [n, k] float64
};

Quantized quantize(const at::Tensor& w, int64_t group) {
  Quantized out;
  out.q = stage::quantize_int4(w, group);
  stage::PanelArena arena(std::vector<size_t>{stage::PanelArena::int4_bytes(w.size(0), w.size(1), group)});
  out.panels = arena.pack_int4(0, out.q, w.size(1));
  // The weight from the codes and scales as quantize_int4 returned them (not through dequantize_int4).
  const int64_t n = w.size(0), depth = out.q.codes.size(1);
  out.weight = (out.q.codes.to(at::kDouble).view({n, depth / group, group}) * out.q.scales.to(at::kDouble).unsqueeze(2))
                   .view({n, depth})
                   .narrow(1, 0, w.size(1));
  return out;
}

at::Tensor kernel(const at::Tensor& x, const Quantized& w, const at::Tensor& bias, bool vnni, bool prefetch,
                  int64_t unit_begin = 0, int64_t unit_end = -1, at::Tensor out = {}) {
  const int64_t m = x.size(0), k = x.size(1), n = w.q.codes.size(0), depth = w.q.codes.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor codes = at::empty({m, depth}, at::kChar), scales = at::empty({m, depth / 32}),
             sums = at::empty({m, depth / 32}, at::kInt);
  cpu::quantize_rows(xf.data_ptr<float>(), k, k, depth, codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                     sums.data_ptr<int32_t>(), 0, m);
  if (!out.defined()) out = at::full({m, n}, 7.0);
  cpu::PanelProduct p;
  p.type = cpu::WeightType::kInt4;
  p.xq = codes.data_ptr<int8_t>();
  p.xscales = scales.data_ptr<float>();
  p.xsums = sums.data_ptr<int32_t>();
  p.group = w.q.group;
  p.panels = w.panels.data_ptr();
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.ldo = n;
  p.m = m;
  p.n = n;
  p.k = depth;
  cpu::KernelVariant variant;
  variant.vnni = vnni;
  variant.prefetch = prefetch;
  cpu::avx512::int4_product(p, unit_begin, unit_end < 0 ? cpu::panel_units(n) : unit_end, variant);
  return out;
}

// The rows' codes, scales and sums from the AVX-512 code equal the scalar code's bit for bit: random rows, halves
// (x * inverse exactly k + 0.5, either sign), zeros, a NaN, tails of K and padded blocks.
TEST(PanelLinearInt4, RowQuantizationIsTheSameInAVX512AndScalarCode) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(5);
  for (int64_t k : {1, 31, 32, 100, 576}) {
    const int64_t depth = (k + 127) / 128 * 128, blocks = depth / 32, m = 9;
    at::Tensor x = at::randn({m, k}) * at::rand({m, 1}) * 10;
    x[1].fill_(0);
    x[2] = at::randint(-254, 255, {k}).to(at::kFloat) * 0.5f;  // halves: the largest magnitude 127 maps to 127
    x[2][0] = 127;
    x[3] = -x[2];
    x[4][k / 2] = std::nanf("");
    x[5] = x[5] * 1e-30;
    std::vector<at::Tensor> got, want;
    for (bool vector : {true, false}) {
      at::Tensor codes = at::full({m, depth}, 99, at::kChar), scales = at::empty({m, blocks}),
                 sums = at::empty({m, blocks}, at::kInt);
      (vector ? cpu::quantize_rows : cpu::quantize_rows_scalar)(x.data_ptr<float>(), k, k, depth,
                                                                codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                                                sums.data_ptr<int32_t>(), 0, m);
      (vector ? got : want) = {codes, scales, sums};
    }
    EXPECT_TRUE(at::equal(got[0], want[0])) << "codes, k " << k;
    EXPECT_TRUE(at::equal(got[1].view(at::kInt), want[1].view(at::kInt))) << "scales, k " << k;
    EXPECT_TRUE(at::equal(got[2], want[2])) << "sums, k " << k;
  }
}

TEST(PanelLinearInt4, QuantizationIsQ4_0sWithFloat16Scales) {
  c10::InferenceMode guard;
  // One group of 32: the largest magnitude (-3.2) is code -8, so the scale is 0.4; 3.0 rounds to 7.5 -> clamps at 7.
  at::Tensor w = at::zeros({1, 40});
  w[0][0] = -3.2;
  w[0][1] = 3.0;
  w[0][2] = 0.41;
  w[0][33] = 1.0;  // the second group, padded to 64 with zeros: 1.0 is code -8, scale -0.125
  const stage::Int4Weight q = stage::quantize_int4(w, 32);
  ASSERT_EQ(q.codes.sizes(), (at::IntArrayRef{1, 64}));
  ASSERT_EQ(q.scales.sizes(), (at::IntArrayRef{1, 2}));
  EXPECT_EQ(q.scales.scalar_type(), at::kHalf);
  EXPECT_FLOAT_EQ(q.scales[0][0].item<float>(), static_cast<float>(c10::Half(0.4f)));
  EXPECT_EQ(q.codes[0][0].item<int>(), -8);
  EXPECT_EQ(q.codes[0][1].item<int>(), 7);
  EXPECT_EQ(q.codes[0][2].item<int>(), 1);
  EXPECT_EQ(q.codes[0][33].item<int>(), -8);
  EXPECT_FLOAT_EQ(q.scales[0][1].item<float>(), -0.125f);
  EXPECT_EQ(q.codes.narrow(1, 40, 24).abs().sum().item<int>(), 0);
  EXPECT_THROW(stage::quantize_int4(w, 48), std::exception);
  EXPECT_TRUE(at::allclose(stage::dequantize_int4(q, 40), quantize(w, 32).weight.to(at::kFloat)));
}

TEST(PanelLinearInt4, KernelEqualsTheDequantizedReference) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(42);
  for (int64_t group : {32, 64, 128}) {
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{64, 256}, {130, 200}, {17, 33}, {200, 576}}) {
      const at::Tensor w = at::randn({n, k}) * 0.05, bias = at::randn({n});
      const Quantized q = quantize(w, group);
      for (int64_t m : {1, 2, 3, 4, 7, 40}) {
        const at::Tensor x = at::randn({m, k});
        const at::Tensor reference =
            at::linear(quantized_rows(x, q.q.codes.size(1)), q.weight, bias.to(at::kDouble)).to(at::kFloat);
        const std::string what = "group " + std::to_string(group) + ", " + std::to_string(m) + " x " +
                                 std::to_string(k) + " by " + std::to_string(n);
        for (bool vnni : {false, true}) {
          if (vnni && !cpu::cpu_has_avx512_vnni()) continue;
          const at::Tensor got = kernel(x, q, bias, vnni, false);
          // float32 sums of float64-exact block products: a few ulps of the largest terms; a row code that rounds
          // the other way (x * (1 / scale) against x / scale) moves a block by one code's worth.
          const double tolerance = 1e-4 * (reference.abs().max().item<double>() + 1);
          EXPECT_LE((got - reference).abs().max().item<double>(), tolerance) << what << (vnni ? " VPDPBUSD" : "");
        }
      }
    }
  }
}

TEST(PanelLinearInt4, EveryKernelRowCountAndSharingGivesTheSameBits) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(7);
  const int64_t n = 200, k = 320;  // 13 units, the last of 8 features; group 64 pads nothing, 128 pads to 384
  for (int64_t group : {32, 128}) {
    const Quantized q = quantize(at::randn({n, k}), group);
    const at::Tensor bias = at::randn({n}), x = at::randn({40, k});
    const at::Tensor whole = kernel(x, q, bias, false, false);
    EXPECT_TRUE(at::equal(kernel(x, q, bias, false, true), whole)) << "prefetching";
    if (cpu::cpu_has_avx512_vnni()) {
      EXPECT_TRUE(at::equal(kernel(x, q, bias, true, false), whole)) << "VPDPBUSD";
      EXPECT_TRUE(at::equal(kernel(x, q, bias, true, true), whole)) << "VPDPBUSD, prefetching";
    }
    // Each row alone, and in tiles of other heights, as in the product of 40.
    for (int64_t m : {1, 2, 3, 5, 13}) {
      for (int64_t row = 0; row + m <= 40; row += 11) {
        EXPECT_TRUE(at::equal(kernel(x.narrow(0, row, m), q, bias, false, false), whole.narrow(0, row, m)))
            << m << " rows from " << row;
      }
    }
    // Two threads, each a range of units, as the stage's threads or lent cores share a product.
    at::Tensor shared = at::full({40, n}, 7.0);
    std::thread first([&] { kernel(x, q, bias, cpu::cpu_has_avx512_vnni(), false, 0, 5, shared); });
    std::thread second([&] { kernel(x, q, bias, cpu::cpu_has_avx512_vnni(), false, 5, 13, shared); });
    first.join();
    second.join();
    EXPECT_TRUE(at::equal(shared, whole)) << "two threads";
    // A range writes only its own outputs.
    at::Tensor part = at::full({40, n}, 7.0);
    kernel(x, q, bias, false, false, 3, 6, part);
    EXPECT_TRUE(at::equal(part.narrow(1, 48, 48), whole.narrow(1, 48, 48)));
    EXPECT_TRUE(at::all(part.narrow(1, 0, 48) == 7).item<bool>());
    EXPECT_TRUE(at::all(part.narrow(1, 96, n - 96) == 7).item<bool>());
  }
}

TEST(PanelLinearInt4, TheOperatorThroughTheDispatcher) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  stage::register_panel_ops();
  at::manual_seed(3);
  const int64_t n = 96, k = 100;
  const at::Tensor w = at::randn({n, k}), bias = at::randn({n});
  const Quantized q = quantize(w, 64);
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pipe::panel_linear_int4", "");
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = at::randn({2, 3, k}).to(dtype);
    std::vector<c10::IValue> stack{x, q.panels, bias, n, k, int64_t{64}};
    op.callBoxed(&stack);
    const at::Tensor got = stack[0].toTensor();
    EXPECT_EQ(got.scalar_type(), dtype);
    EXPECT_EQ(got.sizes(), (at::IntArrayRef{2, 3, n}));
    const at::Tensor reference =
        at::linear(quantized_rows(x.to(at::kFloat).view({6, k}), 128), q.weight, bias.to(at::kDouble)).view({2, 3, n});
    const double tolerance = (dtype == at::kFloat ? 1e-4 : 1e-2) * (reference.abs().max().item<double>() + 1);
    EXPECT_LE((got.to(at::kDouble) - reference).abs().max().item<double>(), tolerance) << c10::toString(dtype);
  }
  // Refusals name what was wrong.
  auto message = [&](int64_t features, int64_t group) {
    try {
      stage::panel_linear_int4(at::randn({1, features}), q.panels, std::nullopt, n, k, group);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(k + 1, 64).find("takes 100 features"), std::string::npos);
  EXPECT_NE(message(k, 32).find("groups of 32"), std::string::npos);  // panels of another group: other bytes
  EXPECT_NE(message(k, 16).find("not 32, 64 or 128"), std::string::npos);
}

// How far int4 weights move a product from the float32 weights (printed for the record, loosely bounded):
// Gaussian weights and rows, K = 2048.
TEST(PanelLinearInt4, ErrorAgainstTheFloatWeights) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  at::manual_seed(11);
  const int64_t n = 256, k = 2048;
  const at::Tensor w = at::randn({n, k}), x = at::randn({4, k});
  const at::Tensor exact = at::linear(x.to(at::kDouble), w.to(at::kDouble));
  for (int64_t group : {32, 64, 128}) {
    const Quantized q = quantize(w, group);
    const double weight_error = ((q.weight - w.to(at::kDouble)).norm() / w.norm()).item<double>();
    const double product_error =
        ((kernel(x, q, {}, false, false).to(at::kDouble) - exact).norm() / exact.norm()).item<double>();
    const double weights_only =
        ((at::linear(x.to(at::kDouble), q.weight) - exact).norm() / exact.norm()).item<double>();
    std::printf("int4 group %3lld: weights %.4f relative RMS; product %.4f (%.4f from the weights alone)\n",
                static_cast<long long>(group), weight_error, product_error, weights_only);
    EXPECT_LT(weight_error, 0.12);
    EXPECT_LT(product_error, 0.13);
    EXPECT_LT(product_error, weights_only * 1.05);  // the rows' int8 codes add little beside the weights'
  }
}

// The output head (the linear layer whose result the forward returns, through a cast) is stored as
// StageOptions::quantize_head says (pipe_stage_options.quantize_head), through head_quantization: by default as the
// other weights under int8 and int8 under int4, as llama.cpp's Q4_0 models keep theirs in 8 or 6 bits. A linear
// layer whose result goes on to other operators is no head.
TEST(PanelLinearInt4, TheOutputHeadIsInt8UnlessAskedOtherwise) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  auto model = [] {
    at::manual_seed(5);
    torch::jit::Module m("Int4HeadTest");
    m.register_parameter("body", at::randn({64, 96}), false);
    m.register_parameter("inner", at::randn({64, 64}), false);
    m.register_parameter("head", at::randn({160, 64}), false);
    m.define(R"(
def forward(self, x):
    h = torch.linear(x, self.body)
    h = torch.relu(torch.linear(h, self.inner))
    return torch.linear(h, self.head).float()
)");
    return m;
  };
  using Q = stage::WeightQuantization;
  struct Case {
    Q quantize;
    std::optional<Q> head;
    const char* what;
    size_t int4, int8, plain;
  };
  for (const Case& c :
       {Case{Q::Int4, std::nullopt, "int4, head default", 2, 1, 0}, Case{Q::Int4, Q::Int8, "int4, head int8", 2, 1, 0},
        Case{Q::Int4, Q::Int4, "int4, head int4", 3, 0, 0}, Case{Q::Int4, Q::None, "int4, head none", 2, 0, 1},
        Case{Q::Int8, std::nullopt, "int8, head default", 0, 3, 0}, Case{Q::Int8, Q::Int4, "int8, head int4", 1, 2, 0},
        Case{Q::Int8, Q::None, "int8, head none", 0, 2, 1}}) {
    stage::StageOptions options;
    options.quantize = c.quantize;
    options.quantize_head = c.head;
    torch::jit::Module m = model();
    EXPECT_EQ(stage::panel_linear_weights(m, options.quantize, 0, options.quantize_head), 3u) << c.what;
    const auto& graph = *m.get_method("forward").graph();
    EXPECT_EQ(test::count_nodes(graph, "pipe::panel_linear_int4"), c.int4) << c.what;
    EXPECT_EQ(test::count_nodes(graph, "pipe::panel_linear_int8"), c.int8) << c.what;
    EXPECT_EQ(test::count_nodes(graph, "pipe::panel_linear"), c.plain) << c.what;
  }
  // Without quantized weights there is no head to store otherwise.
  stage::StageOptions plain;
  plain.quantize_head = Q::Int4;
  EXPECT_EQ(stage::head_quantization(plain), Q::None);
}

// stored_bytes (pipe_plan_stage_weight_bytes) predicts, before the rewrite, the bytes the stage's tensors hold after
// it: the panels, int8 scales and biases, the originals freed (a weight read by anything else stays beside its
// panels); for each storage of the weights and the head.
TEST(PanelLinearInt4, StoredBytesAreTheRewrittenStagesTensors) {
  SKIP_WITHOUT_PANELS();
  c10::InferenceMode guard;
  auto model = [] {
    at::manual_seed(6);
    torch::jit::Module m("StoredBytesTest");
    m.register_parameter("body", at::randn({72, 100}), false);
    m.register_parameter("body_bias", at::randn({72}), false);
    m.register_parameter("shared", at::randn({40, 72}), false);  // also read by sum(): stays beside its panels
    m.register_parameter("head", at::randn({130, 40}), false);
    m.define(R"(
def forward(self, x):
    h = torch.relu(torch.linear(x, self.body, self.body_bias))
    h = torch.linear(h, self.shared) + self.shared.sum()
    return torch.linear(h, self.head)
)");
    return m;
  };
  auto held = [](const torch::jit::Module& m) {
    uint64_t bytes = 0;
    for (const auto& p : m.named_parameters()) bytes += p.value.nbytes();
    for (const auto& b : m.named_buffers()) bytes += b.value.nbytes();
    return bytes;
  };
  using Q = stage::WeightQuantization;
  for (const auto& [quantize, head, group] : {std::tuple<Q, std::optional<Q>, int64_t>{Q::None, std::nullopt, 0},
                                              {Q::Int8, std::nullopt, 0},
                                              {Q::Int8, Q::Int4, 64},
                                              {Q::Int4, std::nullopt, 0},
                                              {Q::Int4, Q::Int4, 128},
                                              {Q::Int4, Q::None, 32}}) {
    stage::StageOptions options;
    options.quantize = quantize;
    options.quantize_head = head;
    options.quantize_group = group;
    torch::jit::Module m = model();
    const uint64_t predicted = stage::stored_bytes(m, options);
    stage::panel_linear_weights(m, quantize, group, head);
    const std::string what = "quantize " + std::to_string(static_cast<int>(quantize)) + ", head " +
                             (head ? std::to_string(static_cast<int>(*head)) : "default") + ", group " +
                             std::to_string(group);
    EXPECT_EQ(predicted, held(m)) << what;
  }
}

}  // namespace
}  // namespace libpipe
