// A stage whose graphable calls replay as CUDA graphs (runtime/stage/graphed_stage.h), on the CPU with a stand-in
// for the graphs: recording runs the step's host code once and keeps it, a replay runs it again, and the stage under
// it writes every result into one buffer of its own, as a graph writes into the memory it recorded. So each answer
// is checked against the stage's own arithmetic (2x + 1), and an answer that still pointed at the recorded memory
// would change under the next replay. Checked: the first call of a shape warms up, records and answers; later ones
// replay; calls not marked graphable, shapes past the cap, and shapes that cannot be recorded run as they are; a
// failing first call leaves its shape to be recorded by the next.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "runtime/error.h"
#include "runtime/stage/graphed_stage.h"

namespace libpipe::stage {
namespace {

// Writes 2x + 1 into one buffer per shape and returns it (as a one-item tuple, like a stage that is not the last);
// refuses negative inputs, as a decoder refuses a bad call.
class AffineStage final : public Stage {
 public:
  c10::IValue forward(std::vector<c10::IValue> inputs) override {
    ++calls;
    const at::Tensor x = inputs.at(0).toTensor();
    if (x.lt(0).any().item<bool>()) throw Error(Status::Input, "negative input");
    if (!out_.defined() || out_.sizes() != x.sizes()) out_ = at::empty_like(x);
    at::mul_out(out_, x, 2).add_(1);
    return c10::ivalue::Tuple::create({out_});
  }
  int calls = 0;

 private:
  at::Tensor out_;
};

class StandInGraph final : public device::StepGraph {
 public:
  explicit StandInGraph(bool fails) : fails_(fails) {}
  void capture(const std::function<void()>& work) override {
    work();
    if (fails_) throw Error(Status::Execution, "CUDA graph: the step could not be captured (stand-in)");
    work_ = work;
  }
  void replay() override { work_(); }

 private:
  bool fails_;
  std::function<void()> work_;
};

struct Harness {
  explicit Harness(bool capture_fails = false, size_t max_graphs = GraphedStage::kMaxGraphs, bool unavailable = false) {
    auto inner = std::make_unique<AffineStage>();
    affine = inner.get();
    stage = std::make_unique<GraphedStage>(
        std::move(inner),
        [capture_fails, unavailable]() -> device::StepGraphFactory {
          if (unavailable) throw Error(Status::Unsupported, "no graphs here (stand-in)");
          return [capture_fails] { return std::make_unique<StandInGraph>(capture_fails); };
        },
        "stage 0", max_graphs);
  }
  at::Tensor call(const at::Tensor& x, bool graphable = true) {
    GraphableCall mark(graphable);
    return stage->forward({x}).toTupleRef().elements().at(0).toTensor();
  }
  AffineStage* affine = nullptr;
  std::unique_ptr<GraphedStage> stage;
};

at::Tensor expected(const at::Tensor& x) { return x * 2 + 1; }

TEST(GraphedStage, TheFirstCallOfAShapeRecordsAndLaterOnesReplayWithTheirOwnAnswers) {
  Harness h;
  const at::Tensor a = at::arange(6, at::kFloat).view({2, 3});
  const at::Tensor first = h.call(a);
  EXPECT_TRUE(at::equal(first, expected(a)));
  EXPECT_EQ(h.affine->calls, GraphedStage::kWarmups + 1);  // warm-ups, then the recording's host code
  EXPECT_EQ(h.stage->graphs(), 1u);
  EXPECT_EQ(h.stage->replays(), 0u);

  const at::Tensor b = a + 10, c = a + 20;
  const at::Tensor second = h.call(b);
  const at::Tensor third = h.call(c);
  EXPECT_EQ(h.stage->replays(), 2u);
  EXPECT_EQ(h.stage->graphs(), 1u);
  EXPECT_TRUE(at::equal(third, expected(c)));
  EXPECT_TRUE(at::equal(second, expected(b))) << "an answer changed under a later replay";
  EXPECT_TRUE(at::equal(first, expected(a))) << "an answer changed under a later replay";

  // Another shape is recorded of its own.
  const at::Tensor d = at::arange(4, at::kFloat).view({4, 1});
  EXPECT_TRUE(at::equal(h.call(d), expected(d)));
  EXPECT_TRUE(at::equal(h.call(d + 1), expected(d + 1)));
  EXPECT_EQ(h.stage->graphs(), 2u);
  EXPECT_EQ(h.stage->replays(), 3u);
}

TEST(GraphedStage, CallsNotMarkedGraphableRunAsTheyAre) {
  Harness h;
  const at::Tensor a = at::arange(6, at::kFloat).view({2, 3});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(h.call(a + i, /*graphable=*/false), expected(a + i)));
  EXPECT_EQ(h.affine->calls, 3);
  EXPECT_EQ(h.stage->graphs(), 0u);
  EXPECT_FALSE(GraphableCall::active());  // the marks are gone with their scope
}

TEST(GraphedStage, AShapeThatCannotBeRecordedRunsAsItIsFromThenOn) {
  Harness h(/*capture_fails=*/true);
  const at::Tensor a = at::arange(6, at::kFloat).view({2, 3});
  EXPECT_TRUE(at::equal(h.call(a), expected(a)));
  const int after_first = h.affine->calls;
  EXPECT_TRUE(at::equal(h.call(a + 1), expected(a + 1)));
  EXPECT_EQ(h.affine->calls, after_first + 1);  // once, unrecorded: no second attempt
  EXPECT_EQ(h.stage->graphs(), 0u);
  EXPECT_EQ(h.stage->replays(), 0u);
}

TEST(GraphedStage, WithoutGraphsHereEveryCallRunsAsItIs) {
  Harness h(false, GraphedStage::kMaxGraphs, /*unavailable=*/true);
  const at::Tensor a = at::arange(6, at::kFloat).view({2, 3});
  EXPECT_TRUE(at::equal(h.call(a), expected(a)));
  EXPECT_TRUE(at::equal(h.call(a + 1), expected(a + 1)));
  EXPECT_EQ(h.affine->calls, 2);
  EXPECT_EQ(h.stage->graphs(), 0u);
}

TEST(GraphedStage, ShapesPastTheCapRunAsTheyAre) {
  Harness h(false, /*max_graphs=*/1);
  const at::Tensor a = at::arange(6, at::kFloat).view({2, 3});
  const at::Tensor b = at::arange(3, at::kFloat);
  h.call(a);
  const int before = h.affine->calls;
  EXPECT_TRUE(at::equal(h.call(b), expected(b)));
  EXPECT_TRUE(at::equal(h.call(b + 1), expected(b + 1)));
  EXPECT_EQ(h.affine->calls, before + 2);
  EXPECT_TRUE(at::equal(h.call(a + 1), expected(a + 1)));  // the recorded one still replays
  EXPECT_EQ(h.stage->graphs(), 1u);
  EXPECT_EQ(h.stage->replays(), 1u);
}

TEST(GraphedStage, AFailingFirstCallFailsAloneAndTheNextOfItsShapeRecords) {
  Harness h;
  const at::Tensor bad = -at::ones({2, 3});
  EXPECT_THROW(h.call(bad), Error);
  EXPECT_EQ(h.stage->graphs(), 0u);
  const at::Tensor good = at::ones({2, 3});
  EXPECT_TRUE(at::equal(h.call(good), expected(good)));
  EXPECT_EQ(h.stage->graphs(), 1u);
  EXPECT_TRUE(at::equal(h.call(good * 3), expected(good * 3)));
  EXPECT_EQ(h.stage->replays(), 1u);
}

}  // namespace
}  // namespace libpipe::stage
