// A first stage cut before its first layer (runtime/stage/preamble_split.h), on the tiny decoder fixture: the
// preamble (the call's checks and packing) and the layers run one after the other give what the whole stage gives,
// for a prompt step of two rows and the decode step after it, in a one-stage pipeline (logits) and as the first of
// two (the values it hands on); the layers are the part handed to the wrapper; a first stage that holds no layer
// start after its first node is not cut.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "fixtures.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/planner/planner.h"
#include "runtime/stage/preamble_split.h"

namespace libpipe::stage {
namespace {

std::shared_ptr<const graph::Plan> decoder_plan(const std::vector<std::string>& points) {
  PlanRequest request;
  request.split_points = points;
  return make_plan(graph::Model::load(test::fixture("tiny_decoder.pt")), request);
}

at::Tensor longs(std::vector<int64_t> v, std::vector<int64_t> shape) { return at::tensor(v, at::kLong).view(shape); }

void expect_same(const c10::IValue& whole, const c10::IValue& split, const std::string& what) {
  SCOPED_TRACE(what);
  if (whole.isTensor()) {
    ASSERT_TRUE(split.isTensor());
    const at::Tensor a = whole.toTensor(), b = split.toTensor();
    ASSERT_EQ(a.sizes(), b.sizes());
    ASSERT_EQ(a.scalar_type(), b.scalar_type());
    if (a.is_floating_point())
      EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-6)) << "largest difference " << (a - b).abs().max().item<double>();
    else EXPECT_TRUE(at::equal(a, b));
    return;
  }
  ASSERT_TRUE(whole.isTuple() && split.isTuple()) << whole.tagKind() << " / " << split.tagKind();
  const auto& a = whole.toTupleRef().elements();
  const auto& b = split.toTupleRef().elements();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].isTensor()) expect_same(a[i], b[i], what + ", value " + std::to_string(i));
    else EXPECT_EQ(a[i], b[i]) << what << ", value " << i;
  }
}

TEST(PreambleSplit, TheFirstStageRunAsPreambleThenLayersGivesWhatTheWholeStageGives) {
  for (const auto& points : {std::vector<std::string>{}, std::vector<std::string>{"model.layers.1:begin"}}) {
    SCOPED_TRACE(points.empty() ? "one stage" : "the first of two stages");
    const auto plan = decoder_plan(points);
    StageOptions options;
    BuildOptions build;
    build.options = &options;
    auto whole = build_stage(*plan, 0, build);
    bool body_wrapped = false;
    auto split = PreambleSplitStage::build(*plan, build, [&](std::unique_ptr<Stage> body) {
      body_wrapped = true;
      return body;
    });
    ASSERT_NE(split, nullptr) << "the decoder's first stage was not cut";
    EXPECT_TRUE(body_wrapped);
    // A prompt step of two rows (5 and 3 tokens), then the decode step that follows it, on each stage's own caches.
    const std::vector<std::vector<c10::IValue>> steps{
        {longs({1, 2, 3, 4, 5, 6, 7, 8, 0, 0}, {2, 5}), longs({0, 0}, {2}), longs({5, 3}, {2}), longs({0, 2}, {2})},
        {longs({9, 10}, {2, 1}), longs({5, 3}, {2}), longs({1, 1}, {2}), longs({0, 2}, {2})}};
    for (size_t i = 0; i < steps.size(); ++i)
      expect_same(whole->forward(steps[i]), split->forward(steps[i]), i == 0 ? "prompt step" : "decode step");
  }
}

TEST(PreambleSplit, AFirstStageWithoutALayerStartAfterItsFirstNodeIsNotCut) {
  const auto plan = decoder_plan({"model.layers.0:begin"});  // stage 0 is the preamble alone
  StageOptions options;
  BuildOptions build;
  build.options = &options;
  EXPECT_EQ(PreambleSplitStage::build(*plan, build, [](std::unique_ptr<Stage> body) { return body; }), nullptr);
}

}  // namespace
}  // namespace libpipe::stage
