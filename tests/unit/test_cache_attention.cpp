#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdlib>
#include <limits>

#include "runtime/cpu/panel_gemm.h"
#include "runtime/stage/torchscript/cache_attention.h"
#include "graph_nodes.h"

namespace libpipe {
namespace {

using test::count_nodes;

// ATen's own answer: the caches gathered for the rows' slots, then scaled_dot_product_attention.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                     int64_t context, const at::Tensor& mask, std::optional<double> scale, bool gqa) {
  const at::Tensor keys = k_cache.narrow(2, 0, context).index_select(0, slots);
  const at::Tensor values = v_cache.narrow(2, 0, context).index_select(0, slots);
  return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale, gqa);
}

// The decoder's mask (libpipe.decoders.cache.attend_cache): row b's query t at position start[b] + t sees
// positions up to its own (within `window` when > 0); rows past their length (padding) see all.
at::Tensor decoder_mask(const at::Tensor& start, const at::Tensor& lengths, int64_t t, int64_t context,
                        int64_t window) {
  const at::Tensor offsets = at::arange(t, at::kLong);
  const at::Tensor positions = start.unsqueeze(1) + offsets.unsqueeze(0);
  const at::Tensor valid = offsets.unsqueeze(0) < lengths.unsqueeze(1);
  const at::Tensor kpos = at::arange(context, at::kLong);
  at::Tensor allowed = kpos <= positions.unsqueeze(-1);
  if (window > 0) allowed = allowed & (kpos > positions.unsqueeze(-1) - window);
  return (allowed | valid.logical_not().unsqueeze(-1)).unsqueeze(1);
}

bool fusing_expected() {
  const char* env = std::getenv("LIBPIPE_CACHE_ATTENTION");
  return (at::globalContext().hasMKL() || cpu::cpu_has_panel_kernels()) && !(env && std::string(env) == "0");
}

struct Case {
  int64_t slots_held, heads, kv, d, t, window;
  std::vector<int64_t> slots, start, lengths;
};

TEST(CacheAttention, EqualsSdpaOverTheGatheredCache) {
  c10::InferenceMode guard;
  at::manual_seed(3);
  const std::vector<Case> cases = {
      // decode: one token per row, rows in slots out of order, grouped heads
      {5, 6, 2, 16, 1, 0, {3, 0, 4}, {6, 2, 0}, {1, 1, 1}},
      // prompt chunks of different lengths (row 1 padded), a sliding window
      {4, 4, 4, 8, 5, 3, {1, 2}, {0, 4}, {5, 2}},
      // one row, one head group holding every head
      {2, 8, 1, 32, 3, 0, {1}, {10}, {3}},
  };
  for (const Case& c : cases) {
    const int64_t b = static_cast<int64_t>(c.slots.size()), max_len = 24;
    const at::Tensor k_cache = at::randn({c.slots_held, c.kv, max_len, c.d});
    const at::Tensor v_cache = at::randn({c.slots_held, c.kv, max_len, c.d});
    const at::Tensor slots = at::tensor(c.slots, at::kLong), start = at::tensor(c.start, at::kLong),
                     lengths = at::tensor(c.lengths, at::kLong);
    const int64_t context = (start + lengths).max().item<int64_t>();
    const at::Tensor mask = decoder_mask(start, lengths, c.t, context, c.window);
    // q as the decoder makes it: [B, T, H, D] seen as [B, H, T, D] (not contiguous).
    const at::Tensor q = at::randn({b, c.t, c.heads, c.d}).transpose(1, 2);
    for (std::optional<double> scale : {std::optional<double>(), std::optional<double>(0.3)}) {
      const bool gqa = c.heads != c.kv;
      const at::Tensor want = reference(q, k_cache, v_cache, slots, context, mask, scale, gqa);
      const at::Tensor got = stage::cache_attention(q, k_cache, v_cache, slots, context, mask, scale, gqa);
      ASSERT_EQ(got.sizes(), want.sizes());
      EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << "heads " << c.heads << " kv " << c.kv << " t " << c.t
                                                       << " max error " << (got - want).abs().max().item<double>();
    }
  }
}

// The kernels (runtime/cpu/cache_attention.h) in every cache dtype, on the head sizes models have, contexts that
// are not multiples of 16 and a context of 1, single queries and prompt chunks: against SDPA in float32 on the same
// (rounded) values, within one rounding of the result to the dtype.
TEST(CacheAttention, KernelsEqualSdpaInEveryDtype) {
  if (!cpu::cpu_has_panel_kernels()) GTEST_SKIP() << "this CPU has no AVX-512: the kernels do not run";
  c10::InferenceMode guard;
  at::manual_seed(6);
  const std::vector<Case> cases = {
      {5, 9, 3, 64, 1, 0, {3, 0, 4}, {190, 0, 37}, {1, 1, 1}},  // decode, contexts 191, 1 and 38
      {3, 4, 2, 128, 7, 0, {2, 0}, {0, 20}, {7, 3}},            // prompt chunks, one padded
      {2, 6, 6, 16, 5, 4, {1}, {30}, {5}},                      // a sliding window
      {2, 2, 1, 48, 3, 0, {0, 1}, {17, 0}, {1, 3}},             // a head of 3 vectors
      // a prompt chunk of more queries than a task takes (kQueriesPerTask), one row padded, pieces with a tail
      {3, 9, 3, 64, 40, 0, {2, 0}, {0, 100}, {40, 21}},
  };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Case& c : cases) {
      const int64_t b = static_cast<int64_t>(c.slots.size()), max_len = 200;
      const at::Tensor k_cache = at::randn({c.slots_held, c.kv, max_len, c.d}).to(dtype);
      const at::Tensor v_cache = at::randn({c.slots_held, c.kv, max_len, c.d}).to(dtype);
      const at::Tensor slots = at::tensor(c.slots, at::kLong), start = at::tensor(c.start, at::kLong),
                       lengths = at::tensor(c.lengths, at::kLong);
      const int64_t context = (start + lengths).max().item<int64_t>();
      const at::Tensor mask = decoder_mask(start, lengths, c.t, context, c.window);
      const at::Tensor q = at::randn({b, c.t, c.heads, c.d}).to(dtype).transpose(1, 2);
      const bool gqa = c.heads != c.kv;
      const at::Tensor want = reference(q.to(at::kFloat), k_cache.to(at::kFloat), v_cache.to(at::kFloat), slots,
                                        context, mask, std::nullopt, gqa);
      const at::Tensor got = stage::cache_attention(q, k_cache, v_cache, slots, context, mask, std::nullopt, gqa);
      ASSERT_EQ(got.scalar_type(), dtype);
      ASSERT_EQ(got.sizes(), want.sizes());
      const double tol = dtype == at::kFloat ? 1e-5 : dtype == at::kHalf ? 2e-3 : 1.6e-2;
      EXPECT_TRUE(at::allclose(got.to(at::kFloat), want, tol, tol))
          << c10::toString(dtype) << " heads " << c.heads << " d " << c.d << " t " << c.t << " max error "
          << (got.to(at::kFloat) - want).abs().max().item<double>();
    }
  }
}

// A float32 model's caches kept in bfloat16 or float16 (export_llm --cache-dtype): the kernels read them as the
// decoder's .to(q.dtype) does, float32 attention over the rounded keys and values.
TEST(CacheAttention, CachesInASmallerDtypeThanTheQueries) {
  if (!cpu::cpu_has_panel_kernels()) GTEST_SKIP() << "this CPU has no AVX-512: the kernels do not run";
  c10::InferenceMode guard;
  at::manual_seed(7);
  for (at::ScalarType cache : {at::kBFloat16, at::kHalf}) {
    const at::Tensor k_cache = at::randn({3, 2, 40, 64}).to(cache), v_cache = at::randn({3, 2, 40, 64}).to(cache);
    const at::Tensor slots = at::tensor({2, 0}, at::kLong), start = at::tensor({30, 0}, at::kLong),
                     lengths = at::tensor({1, 4}, at::kLong);
    const at::Tensor mask = decoder_mask(start, lengths, 4, 31, 0);
    const at::Tensor q = at::randn({2, 4, 6, 64}).transpose(1, 2);
    const at::Tensor want =
        reference(q, k_cache.to(at::kFloat), v_cache.to(at::kFloat), slots, 31, mask, std::nullopt, true);
    const at::Tensor got = stage::cache_attention(q, k_cache, v_cache, slots, 31, mask, std::nullopt, true);
    ASSERT_EQ(got.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max().item<double>();
  }
}

// A query that may see no key comes out NaN from the kernels, as from SDPA; the others are unaffected.
TEST(CacheAttention, AQuerySeeingNothingIsNaN) {
  if (!cpu::cpu_has_panel_kernels()) GTEST_SKIP() << "this CPU has no AVX-512: the kernels do not run";
  c10::InferenceMode guard;
  const at::Tensor k_cache = at::randn({2, 1, 8, 16}), v_cache = at::randn({2, 1, 8, 16});
  const at::Tensor slots = at::tensor({1, 0}, at::kLong);
  const at::Tensor q = at::randn({2, 1, 1, 16});
  at::Tensor mask = at::ones({2, 1, 1, 5}, at::kBool);
  mask[0].fill_(false);
  const at::Tensor got = stage::cache_attention(q, k_cache, v_cache, slots, 5, mask, std::nullopt, false);
  EXPECT_TRUE(at::isnan(got[0]).all().item<bool>());
  const at::Tensor want = reference(q, k_cache, v_cache, slots, 5, mask, std::nullopt, false);
  EXPECT_TRUE(at::allclose(got[1], want[1], 1e-5, 1e-5));
}

// The kernels compute the query heads that share a key-value head together (grouped-query attention reads each key
// once for them): every head's answer is bit for bit what it is over a cache holding its own copy of the key-value
// head (no grouping), in every dtype, for one query per head (a decode step: the group in one block), for
// prompt chunks whose (head, query) pairs cross the kernel's blocks and whose queries span several tasks
// (kQueriesPerTask), with a per-head mask and rows of one token.
TEST(CacheAttention, GroupedHeadsEqualTheirUngroupedSelvesBitForBit) {
  if (!cpu::cpu_has_panel_kernels()) GTEST_SKIP() << "this CPU has no AVX-512: the kernels do not run";
  c10::InferenceMode guard;
  at::manual_seed(8);
  struct Shape {
    int64_t heads, kv, d, t;
  };
  for (const Shape& s : {Shape{9, 3, 64, 1}, Shape{32, 8, 64, 1}, Shape{6, 2, 64, 5}, Shape{8, 2, 32, 3},
                         Shape{4, 1, 128, 1}, Shape{10, 5, 16, 7}, Shape{6, 2, 64, 37}}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const int64_t group = s.heads / s.kv, max_len = 80;
      const at::Tensor k_cache = at::randn({3, s.kv, max_len, s.d}).to(dtype);
      const at::Tensor v_cache = at::randn({3, s.kv, max_len, s.d}).to(dtype);
      const at::Tensor slots = at::tensor({2, 0}, at::kLong), start = at::tensor({40, 3}, at::kLong),
                       lengths = at::tensor({s.t, int64_t{1}}, at::kLong);
      const int64_t context = (start + lengths).max().item<int64_t>();
      // A mask per head: the decoder's, with a different key hidden from each head.
      at::Tensor mask = decoder_mask(start, lengths, s.t, context, 0).expand({2, s.heads, s.t, context}).clone();
      for (int64_t h = 0; h < s.heads; ++h) mask.select(1, h).select(2, h % context).fill_(false);
      const at::Tensor q = at::randn({2, s.t, s.heads, s.d}).to(dtype).transpose(1, 2);
      const at::Tensor grouped = stage::cache_attention(q, k_cache, v_cache, slots, context, mask, std::nullopt, true);
      const at::Tensor each =
          stage::cache_attention(q, k_cache.repeat_interleave(group, 1), v_cache.repeat_interleave(group, 1), slots,
                                 context, mask, std::nullopt, false);
      EXPECT_TRUE(at::equal(grouped, each))
          << c10::toString(dtype) << " heads " << s.heads << " kv " << s.kv << " t " << s.t << " max difference "
          << (grouped.to(at::kFloat) - each.to(at::kFloat)).abs().max().item<double>();
      const at::Tensor want = reference(q.to(at::kFloat), k_cache.to(at::kFloat), v_cache.to(at::kFloat), slots,
                                        context, mask, std::nullopt, true);
      const double tol = dtype == at::kFloat ? 1e-5 : dtype == at::kHalf ? 2e-3 : 1.6e-2;
      EXPECT_TRUE(at::allclose(grouped.to(at::kFloat), want, tol, tol)) << c10::toString(dtype) << " heads " << s.heads;
    }
  }
}

TEST(CacheAttention, WhatItDoesNotComputeItselfIsSdpasAnswerOrError) {
  c10::InferenceMode guard;
  at::manual_seed(4);
  const at::Tensor k_cache = at::randn({3, 2, 8, 4}), v_cache = at::randn({3, 2, 8, 4});
  const at::Tensor slots = at::tensor({2, 0}, at::kLong);
  const at::Tensor q = at::randn({2, 4, 1, 4});
  const at::Tensor mask = decoder_mask(at::tensor({3, 5}, at::kLong), at::tensor({1, 1}, at::kLong), 1, 6, 0);
  // An additive (float) mask, and bfloat16 caches of a head size the kernels do not take (4): computed as the
  // gathered pattern.
  const at::Tensor additive = at::zeros({2, 1, 1, 6}).masked_fill(mask.logical_not(), -1e9);
  EXPECT_TRUE(at::allclose(stage::cache_attention(q, k_cache, v_cache, slots, 6, additive, std::nullopt, true),
                           reference(q, k_cache, v_cache, slots, 6, additive, std::nullopt, true), 1e-5, 1e-5));
  const at::Tensor kb = k_cache.to(at::kBFloat16), vb = v_cache.to(at::kBFloat16), qb = q.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(stage::cache_attention(qb, kb, vb, slots, 6, mask, std::nullopt, true),
                        reference(qb, kb, vb, slots, 6, mask, std::nullopt, true)));
  // A slot outside the cache, and grouped heads without enable_gqa: ATen's errors, not a wrong answer.
  EXPECT_THROW(stage::cache_attention(q, k_cache, v_cache, at::tensor({2, 3}, at::kLong), 6, mask, std::nullopt, true),
               c10::Error);
  EXPECT_THROW(stage::cache_attention(q, k_cache, v_cache, slots, 6, mask, std::nullopt, false), c10::Error);
}

// attend_cache of libpipe.decoders.cache, reduced to the pattern: caches as buffers, the slots' context gathered.
torch::jit::Module attending_module(int64_t narrow_dim) {
  at::manual_seed(5);
  torch::jit::Module m("CacheAttentionTest");
  m.register_buffer("k_cache", at::randn({4, 2, 16, 8}));
  m.register_buffer("v_cache", at::randn({4, 2, 16, 8}));
  m.define(std::string(R"(
def forward(self, q, slots, end):
    context = int(end.max())
    keys = self.k_cache.narrow()") +
           std::to_string(narrow_dim) + R"(, 0, context).index_select(0, slots)
    values = self.v_cache.narrow()" +
           std::to_string(narrow_dim) + R"(, 0, context).index_select(0, slots)
    allowed = (torch.arange(context) < end.unsqueeze(-1)).unsqueeze(1).unsqueeze(1)
    out = torch.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed, dropout_p=0.0, is_causal=False, scale=0.25, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)
)");
  return m;
}

TEST(CacheAttention, TheDecodersPatternIsRewrittenAndComputesTheSame) {
  c10::InferenceMode guard;
  torch::jit::Module fused = attending_module(2), plain = attending_module(2);
  const size_t rewritten = stage::fuse_cache_attention(fused);
  const auto& graph = *fused.get_method("forward").graph();
  if (!fusing_expected()) {
    EXPECT_EQ(rewritten, 0u);
    GTEST_SKIP() << "this LibTorch has no MKL (or LIBPIPE_CACHE_ATTENTION=0): nothing is rewritten";
  }
  EXPECT_EQ(rewritten, 1u);
  EXPECT_EQ(count_nodes(graph, "pipe::cache_attention"), 1u);
  EXPECT_EQ(count_nodes(graph, "aten::scaled_dot_product_attention"), 0u);
  EXPECT_EQ(count_nodes(graph, "aten::index_select"), 0u);  // the gathers are gone
  const std::vector<c10::IValue> inputs{at::randn({3, 6, 1, 8}), at::tensor({3, 1, 0}, at::kLong),
                                        at::tensor({5, 9, 2}, at::kLong)};
  const at::Tensor want = plain.forward(inputs).toTensor();
  const at::Tensor got = fused.forward(inputs).toTensor();
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max().item<double>();
}

// The decoder's read of a cache kept in another dtype: the gather converted to the queries' dtype.
TEST(CacheAttention, AGatherConvertedToTheQueriesDtypeIsRewrittenToo) {
  if (!fusing_expected()) GTEST_SKIP() << "nothing is rewritten here";
  c10::InferenceMode guard;
  auto module = [] {
    at::manual_seed(8);
    torch::jit::Module m("CastCacheAttentionTest");
    m.register_buffer("k_cache", at::randn({4, 2, 16, 16}).to(at::kBFloat16));
    m.register_buffer("v_cache", at::randn({4, 2, 16, 16}).to(at::kBFloat16));
    m.define(R"(
def forward(self, q, slots, end):
    context = int(end.max())
    keys = self.k_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    values = self.v_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    allowed = (torch.arange(context) < end.unsqueeze(-1)).unsqueeze(1).unsqueeze(1)
    return torch.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed, dropout_p=0.0, is_causal=False, scale=0.25, enable_gqa=True)
)");
    return m;
  };
  torch::jit::Module fused = module(), plain = module();
  EXPECT_EQ(stage::fuse_cache_attention(fused), 1u);
  const auto& graph = *fused.get_method("forward").graph();
  EXPECT_EQ(count_nodes(graph, "aten::index_select"), 0u);
  EXPECT_EQ(count_nodes(graph, "aten::to"), 0u);  // the casts went with the gathers
  const std::vector<c10::IValue> inputs{at::randn({3, 6, 1, 16}), at::tensor({3, 1, 0}, at::kLong),
                                        at::tensor({5, 9, 2}, at::kLong)};
  const at::Tensor want = plain.forward(inputs).toTensor();
  const at::Tensor got = fused.forward(inputs).toTensor();
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max().item<double>();
}

TEST(CacheAttention, OtherGathersAreLeftAlone) {
  c10::InferenceMode guard;
  torch::jit::Module m = attending_module(1);  // a narrow along another dimension: not a cache read
  EXPECT_EQ(stage::fuse_cache_attention(m), 0u);
  EXPECT_EQ(count_nodes(*m.get_method("forward").graph(), "aten::scaled_dot_product_attention"), 1u);
}

}  // namespace
}  // namespace libpipe
