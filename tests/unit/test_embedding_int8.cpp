// 8-bit embeddings (StageOptions::quantize_embedding, runtime/stage/torchscript/panel_rewrite.h's
// quantize_embeddings and pipe::embedding_int8): the rows a lookup returns against a reference dequantized here
// in float64 from the float weights, indices out of range refused, a table tied to a linear layer left alone, and
// stored_bytes counting the codes and scales. The lookup is plain C++: no AVX-512 is needed.

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <string>
#include <vector>

#include "graph_nodes.h"
#include "runtime/error.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage.h"
#include "runtime/stage/torchscript/panel_rewrite.h"

namespace libpipe {
namespace {

// The issue's rule, computed independently of quantize_int8: per row, scale = max |w| / 127, codes = round(w /
// scale), the row dequantized as codes * scale; in float64, then the table's dtype.
at::Tensor dequantized_reference(const at::Tensor& weight) {
  const at::Tensor w = weight.to(at::kDouble);
  at::Tensor scale = w.abs().amax(1, true) / 127.0;
  scale = at::where(scale > 0, scale, at::ones_like(scale));  // an all-zero row stays zero whatever its scale
  return (at::round(w / scale) * scale).to(weight.scalar_type());
}

torch::jit::Module lookup_model(at::ScalarType dtype) {
  at::manual_seed(11);
  torch::jit::Module m("EmbeddingInt8Test");
  at::Tensor table = at::randn({50, 24}).to(dtype);
  table[7].zero_();  // a padding row
  m.register_parameter("embed", table, false);
  m.register_parameter("head", at::randn({30, 24}).to(dtype), false);
  m.define(R"(
def forward(self, ids):
    e = torch.embedding(self.embed, ids)
    return e, torch.linear(e, self.head)
)");
  return m;
}

uint64_t held(const torch::jit::Module& m) {
  uint64_t bytes = 0;
  for (const auto& p : m.named_parameters()) bytes += p.value.nbytes();
  for (const auto& b : m.named_buffers()) bytes += b.value.nbytes();
  return bytes;
}

TEST(EmbeddingInt8, RowsAreTheDequantizedReference) {
  c10::InferenceMode guard;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const std::string what = c10::toString(dtype);
    torch::jit::Module m = lookup_model(dtype);
    const at::Tensor reference = dequantized_reference(m.attr("embed").toTensor());
    EXPECT_EQ(stage::quantize_embeddings(m), 1u) << what;
    const auto& graph = *m.get_method("forward").graph();
    EXPECT_EQ(test::count_nodes(graph, "pipe::embedding_int8"), 1u) << what;
    EXPECT_EQ(test::count_nodes(graph, "aten::embedding"), 0u) << what;
    EXPECT_EQ(m.attr("embed").toTensor().numel(), 0) << what << ": the original is dropped";
    const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 7, 49, 0, 3, 12}).view({2, 3});
    const at::Tensor rows = m.forward({ids}).toTuple()->elements()[0].toTensor();
    ASSERT_EQ(rows.scalar_type(), dtype) << what;
    ASSERT_EQ(rows.sizes(), (std::vector<int64_t>{2, 3, 24})) << what;
    // float32 codes * scale against float64's: equal but for the last bit of float32 at most.
    const at::Tensor want = reference.index({ids});
    EXPECT_TRUE(at::allclose(rows.to(at::kDouble), want.to(at::kDouble), dtype == at::kFloat ? 1e-6 : 1e-2, 0))
        << what << ": largest difference " << (rows.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    EXPECT_TRUE(rows[0][1].eq(0).all().item<bool>()) << what << ": the zero row";
    // int32 indices too, as aten::embedding takes them.
    EXPECT_TRUE(at::equal(m.forward({ids.to(at::kInt)}).toTuple()->elements()[0].toTensor(), rows)) << what;
  }
}

TEST(EmbeddingInt8, IndicesOutOfRangeAreRefused) {
  c10::InferenceMode guard;
  torch::jit::Module m = lookup_model(at::kFloat);
  ASSERT_EQ(stage::quantize_embeddings(m), 1u);
  for (int64_t bad : {int64_t{50}, int64_t{-1}}) {
    try {
      m.forward({at::tensor(std::vector<int64_t>{1, bad})});
      ADD_FAILURE() << bad << " was looked up";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("index out of range in self"), std::string::npos) << e.what();
    }
  }
  const stage::Int8Weight q = stage::quantize_int8(at::randn({4, 8}));
  EXPECT_THROW(stage::embedding_int8(q.codes, q.scales, at::tensor(std::vector<int64_t>{4}), at::kFloat), Error);
  EXPECT_THROW(stage::embedding_int8(q.codes, q.scales, at::tensor(std::vector<double>{0.5}), at::kFloat), Error);
}

// A table the stage's linear layer also reads (a head tied to the embedding) keeps today's storage: the option
// leaves it to panel_linear_weights. So does a table anything else reads.
TEST(EmbeddingInt8, ATiedTableIsLeftAlone) {
  c10::InferenceMode guard;
  torch::jit::Module m("TiedEmbeddingTest");
  m.register_parameter("shared", at::randn({40, 16}), false);
  m.register_parameter("other", at::randn({20, 16}), false);
  m.define(R"(
def forward(self, ids):
    e = torch.embedding(self.shared, ids)
    f = torch.embedding(self.other, ids) * self.other.sum()
    return torch.linear(e + f, self.shared)
)");
  const at::Tensor ids = at::tensor(std::vector<int64_t>{1, 5, 19});
  const at::Tensor before = m.forward({ids}).toTensor();
  EXPECT_EQ(stage::quantize_embeddings(m), 0u);
  const auto& graph = *m.get_method("forward").graph();
  EXPECT_EQ(test::count_nodes(graph, "aten::embedding"), 2u);
  EXPECT_EQ(test::count_nodes(graph, "pipe::embedding_int8"), 0u);
  EXPECT_TRUE(at::equal(m.forward({ids}).toTensor(), before));
  stage::StageOptions options;
  const uint64_t without = stage::stored_bytes(m, options);
  options.quantize_embedding = stage::WeightQuantization::Int8;
  EXPECT_EQ(stage::stored_bytes(m, options), without);
}

// stored_bytes (pipe_plan_stage_weight_bytes) predicts the bytes the stage holds once rewritten: a byte per weight
// and a float32 scale per row for the table instead of the table in its dtype; the head as the panels store it.
TEST(EmbeddingInt8, StoredBytesCountCodesAndScales) {
  c10::InferenceMode guard;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    torch::jit::Module m = lookup_model(dtype);
    stage::StageOptions options;
    const uint64_t without = stage::stored_bytes(m, options);
    options.quantize_embedding = stage::WeightQuantization::Int8;
    const uint64_t predicted = stage::stored_bytes(m, options);
    EXPECT_EQ(without - predicted, 50u * 24u * c10::elementSize(dtype) - (50u * 24u + 50u * 4u));
    stage::quantize_embeddings(m);
    stage::panel_linear_weights(m);
    EXPECT_EQ(predicted, held(m)) << c10::toString(dtype);
  }
}

}  // namespace
}  // namespace libpipe
