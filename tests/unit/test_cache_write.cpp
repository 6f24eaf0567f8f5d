// pipe::cache_write_ and the rewrite of the decoder's cache writes (runtime/stage/torchscript/cache_write.h), against
// the pattern they replace run by ATen itself: aten::index_put_ with indices [where, None, at].
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdlib>
#include <string>

#include "runtime/stage/torchscript/cache_write.h"
#include "graph_nodes.h"

namespace libpipe {
namespace {

using test::count_nodes;

at::Tensor reference_write(at::Tensor cache, const at::Tensor& where, const at::Tensor& at, const at::Tensor& values) {
  c10::List<std::optional<at::Tensor>> indices;
  indices.push_back(where);
  indices.push_back(std::nullopt);
  indices.push_back(at);
  return cache.index_put_(indices, values, false);
}

bool rewriting_expected() {
  const char* env = std::getenv("LIBPIPE_CACHE_WRITE");
  return !(env && std::string(env) == "0");
}

TEST(CacheWrite, CopiesEachTokensRowsWhereIndexPutWould) {
  c10::InferenceMode guard;
  at::manual_seed(11);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    // slots x kv_heads x length x head_dim, a head_dim of odd size; tokens out of slot order, one row of a slot twice.
    const at::Tensor cache = at::randn({5, 3, 9, 7}).to(dtype);
    const at::Tensor where = at::tensor({4, 0, 2, 0}, at::kLong), at = at::tensor({8, 0, 3, 1}, at::kLong);
    const at::Tensor values = at::randn({4, 3, 7}).to(dtype);
    at::Tensor got = cache.clone();
    stage::cache_write_(got, where, at, values);
    EXPECT_TRUE(at::equal(got, reference_write(cache.clone(), where, at, values))) << dtype;
    // A view of the cache with strides of its own (the decoder writes through k_cache[:, :]), and values that are a
    // transposed view: the same writes.
    at::Tensor base = at::randn({5, 9, 3, 7}).to(dtype);
    at::Tensor view = base.transpose(1, 2);
    const at::Tensor values_t = at::randn({3, 4, 7}).to(dtype).transpose(0, 1);
    at::Tensor want = view.clone();
    reference_write(want, where, at, values_t);
    stage::cache_write_(view, where, at, values_t);
    EXPECT_TRUE(at::equal(view, want)) << dtype;
  }
  // No token: nothing written.
  const at::Tensor cache = at::randn({2, 1, 4, 8});
  at::Tensor got = cache.clone();
  const at::Tensor none = at::empty({0}, at::kLong);
  stage::cache_write_(got, none, none, at::empty({0, 1, 8}));
  EXPECT_TRUE(at::equal(got, cache));
}

TEST(CacheWrite, WhatItDoesNotCopyItselfIsIndexPutsAnswerOrError) {
  c10::InferenceMode guard;
  at::manual_seed(12);
  const at::Tensor cache = at::randn({3, 2, 6, 4});
  const at::Tensor values = at::randn({2, 2, 4});
  // Negative indices wrap; values broadcast from one token; values in another dtype: index_put_'s own results.
  const std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor>> cases = {
      {at::tensor({-1, 0}, at::kLong), at::tensor({2, -2}, at::kLong), values},
      {at::tensor({1, 2}, at::kLong), at::tensor({0, 5}, at::kLong), at::randn({1, 2, 4})},
      {at::tensor({1, 2}, at::kLong), at::tensor({0, 5}, at::kLong), values.to(at::kDouble)},
  };
  for (const auto& [where, at, v] : cases) {
    at::Tensor got = cache.clone();
    at::Tensor want = cache.clone();
    EXPECT_NO_THROW(reference_write(want, where, at, v.to(at::kFloat)));
    if (v.scalar_type() == at::kFloat) {
      stage::cache_write_(got, where, at, v);
      EXPECT_TRUE(at::equal(got, want));
    } else {
      // index_put_ refuses values of another dtype: so does the op.
      EXPECT_THROW(stage::cache_write_(got, where, at, v), c10::Error);
    }
  }
  // A slot or a position past the cache: index_put_'s error (which may have written the tokens before it).
  at::Tensor got = cache.clone();
  EXPECT_THROW(stage::cache_write_(got, at::tensor({1, 3}, at::kLong), at::tensor({0, 1}, at::kLong), values),
               c10::Error);
  EXPECT_THROW(stage::cache_write_(got, at::tensor({1, 2}, at::kLong), at::tensor({0, 6}, at::kLong), values),
               c10::Error);
}

// write_packed of libpipe.decoders.cache, reduced to the pattern: caches as buffers, written through k_cache[:, :].
torch::jit::Module writing_module() {
  at::manual_seed(13);
  torch::jit::Module m("CacheWriteTest");
  m.register_buffer("k_cache", at::zeros({4, 2, 16, 8}));
  m.register_buffer("v_cache", at::zeros({4, 2, 16, 8}));
  m.define(R"(
def forward(self, k, v, at, where):
    self.k_cache[where, :, at] = k.to(self.k_cache.dtype)
    self.v_cache[where, :, at] = v.to(self.v_cache.dtype)
    return self.k_cache.sum() + 2 * self.v_cache.sum()
)");
  return m;
}

TEST(CacheWrite, TheDecodersWritesAreRewrittenAndWriteTheSame) {
  c10::InferenceMode guard;
  torch::jit::Module fused = writing_module(), plain = writing_module();
  const size_t rewritten = stage::fuse_cache_writes(fused);
  const auto& graph = *fused.get_method("forward").graph();
  if (!rewriting_expected()) {
    EXPECT_EQ(rewritten, 0u);
    GTEST_SKIP() << "LIBPIPE_CACHE_WRITE=0: nothing is rewritten";
  }
  EXPECT_EQ(rewritten, 2u);
  EXPECT_EQ(count_nodes(graph, "pipe::cache_write_"), 2u);
  EXPECT_EQ(count_nodes(graph, "aten::index_put_"), 0u);
  EXPECT_EQ(count_nodes(graph, "aten::slice"), 0u);  // the `:` views: the writes go to the caches themselves
  // Two steps: the second's writes land beside the first's, which stay.
  for (int step = 0; step < 2; ++step) {
    const std::vector<c10::IValue> inputs{at::randn({3, 2, 8}), at::randn({3, 2, 8}),
                                          at::tensor({5 + step, 0 + step, 9 + step}, at::kLong),
                                          at::tensor({3, 1, 0}, at::kLong)};
    const at::Tensor want = plain.forward(inputs).toTensor();
    const at::Tensor got = fused.forward(inputs).toTensor();
    EXPECT_TRUE(at::equal(got, want));
  }
  EXPECT_TRUE(at::equal(fused.attr("k_cache").toTensor(), plain.attr("k_cache").toTensor()));
  EXPECT_TRUE(at::equal(fused.attr("v_cache").toTensor(), plain.attr("v_cache").toTensor()));
}

TEST(CacheWrite, OtherIndexedWritesAreLeftAlone) {
  c10::InferenceMode guard;
  torch::jit::Module m("OtherWrites");
  m.register_buffer("table", at::zeros({4, 6}));
  m.define(R"(
def forward(self, rows, cols, x):
    self.table[rows, cols] = x
    self.table[rows] += 1.0
    return self.table.sum()
)");
  EXPECT_EQ(stage::fuse_cache_writes(m), 0u);
  EXPECT_EQ(count_nodes(*m.get_method("forward").graph(), "aten::index_put_"), 2u);
}

}  // namespace
}  // namespace libpipe
