#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/model.h"
#include "runtime/graph/plan.h"
#include "runtime/schedule/session.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;

at::Tensor eager(const Model& model, const at::Tensor& x, const at::Tensor& y) {
  return const_cast<torch::jit::Module&>(model.module()).forward({x, y}).toTensor();
}

TEST(Session, ConcurrentCallersWithRandomBatchSizesAllGetTheirOwnAnswer) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  schedule::Session session(Plan::from_markers(model), {4, 0});
  constexpr int kThreads = 4, kCalls = 12;
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int c = 0; c < kCalls; ++c) {
        const int64_t batch = 1 + static_cast<int64_t>(rng() % 9);
        at::Tensor x = at::randn({batch, 512}), y = at::randn({batch, 512});
        try {
          auto out = session.run({x, y});
          if (out.size() != 1 || out[0].name != "output" ||
              !at::allclose(out[0].tensor, eager(*model, x, y), 1e-5, 1e-5))
            ++wrong;
        } catch (const std::exception&) {
          ++failed;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
}

TEST(Session, AFailingCallFailsAloneAndTheSessionKeepsServing) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  schedule::Session session(Plan::from_markers(model), {2, 0});
  // y is read by the last stage only: a wrong width passes stages 0-2 and fails in stage 3.
  try {
    session.run({at::randn({4, 512}), at::randn({4, 100})});
    FAIL() << "a shape error in the last stage must fail the call";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Execution);
    EXPECT_NE(std::string(e.what()).find("stage 3 failed"), std::string::npos) << e.what();
  }
  at::Tensor x = at::randn({6, 512}), y = at::randn({6, 512});
  auto out = session.run({x, y});
  EXPECT_TRUE(at::allclose(out[0].tensor, eager(*model, x, y), 1e-5, 1e-5));
}

TEST(Session, TupleOutputsAreFlattenedAndMerged) {
  auto model = Model::load(test::fixture("tuple_output.traced.pt"));
  schedule::Session session(Plan::from_markers(model), {3, 0});
  at::Tensor x = at::randn({7, 512}), y = at::randn({7, 512});
  auto out = session.run({x, y});
  auto want = const_cast<torch::jit::Module&>(model->module()).forward({x, y}).toTupleRef().elements();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].name, "output.0");
  EXPECT_EQ(out[1].name, "output.1");
  EXPECT_TRUE(at::allclose(out[0].tensor, want[0].toTensor(), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(out[1].tensor, want[1].toTensor(), 1e-5, 1e-5));
}

TEST(Session, InputsOffTheCpuAreRefused) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  schedule::Session session(Plan::from_markers(model), {1, 0});
  try {
    session.run({at::randn({2, 512}).to(at::kMeta), at::randn({2, 512})});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Input);
    EXPECT_NE(std::string(e.what()).find("input 'x' is on meta"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace libpipe
