// Stage sharing (runtime/schedule/stage_sharing.h): which worker runs which stage, the order every stage keeps, and a
// session whose four stages run on two worker threads.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "eager_reference.h"
#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/schedule/session.h"
#include "runtime/schedule/stage_sharing.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;
using schedule::Session;
using schedule::SessionOptions;
using schedule::StageSharing;
using test::status_of;

StageSharing::Ticket ticket(uint64_t order) {
  StageSharing::Ticket t;
  t.order = order;
  return t;
}

// ---- StageSharing alone ----

TEST(StageSharing, WorkersMustBeOneToTheStages) {
  EXPECT_EQ(status_of([] { StageSharing(3, 0); }), Status::Internal);
  EXPECT_EQ(status_of([] { StageSharing(3, 4); }), Status::Internal);
  EXPECT_EQ(status_of([] { StageSharing(3, 3); }), Status::Ok);
}

TEST(StageSharing, OneWorkerPerStageSharesNothing) {
  StageSharing plain(3, 3);
  EXPECT_FALSE(plain.shares());
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(plain.owner(s), static_cast<int>(s));
  const auto t = ticket(plain.enter());
  EXPECT_FALSE(plain.keep(0, 1, t)) << "worker 0 runs stage 0 only";
  EXPECT_FALSE(plain.keep(1, 2, t)) << "worker 1 runs stage 1 only";
}

TEST(StageSharing, TheOuterStagesHaveOwnersAndTheMiddleOnesFloat) {
  StageSharing sharing(5, 2);
  EXPECT_TRUE(sharing.shares());
  EXPECT_EQ(sharing.first_stage(0), 0u);
  EXPECT_EQ(sharing.last_stage(0), 3u);
  EXPECT_EQ(sharing.first_stage(1), 1u);
  EXPECT_EQ(sharing.last_stage(1), 4u);
  EXPECT_EQ(sharing.owner(0), 0);
  EXPECT_EQ(sharing.owner(4), 1);
  for (size_t s = 1; s < 4; ++s) EXPECT_EQ(sharing.owner(s), -1) << s;
}

constexpr double kMs = 1e6;  // ns

// A micro-batch that enters and runs every stage in these times (ms).
void run_through(StageSharing& sharing, const std::vector<double>& ms) {
  auto t = ticket(sharing.enter());
  for (size_t s = 0; s < ms.size(); ++s) sharing.passed(s, ms[s] * kMs, t);
}

TEST(StageSharing, UntilStepsLikeThisOneRanTheWorkersSplitTheStagesEvenly) {
  StageSharing sharing(4, 2);
  auto t = ticket(sharing.enter());
  EXPECT_TRUE(sharing.keep(0, 1, t));   // stage 1's middle (1.5 of 4) lies in worker 0's half
  EXPECT_FALSE(sharing.keep(0, 2, t));  // stage 2's (2.5) does not
  EXPECT_FALSE(sharing.keep(0, 3, t)) << "the last stage is the last worker's";
  EXPECT_TRUE(sharing.keep(1, 2, t)) << "the last worker runs everything up to the end";
  EXPECT_TRUE(sharing.keep(1, 3, t));
  sharing.passed(0, 10 * kMs, t);
  EXPECT_LT(sharing.estimate_ns(1, t), 0) << "no micro-batch ran stage 1 yet";
  EXPECT_EQ(sharing.estimate_ns(0, t), 10 * kMs);
}

TEST(StageSharing, AStageIsKeptOnlyOnceEveryEarlierMicroBatchPassedIt) {
  StageSharing sharing(4, 2);
  auto first = ticket(sharing.enter()), second = ticket(sharing.enter());
  sharing.passed(0, 10 * kMs, first);   // first ran stage 0 and was handed on: stage 1 is the next worker's for it
  sharing.passed(0, 10 * kMs, second);  // second ran stage 0
  EXPECT_FALSE(sharing.keep(0, 1, second)) << "second would run stage 1 before first";
  sharing.passed(1, 10 * kMs, first);  // first passed stage 1 on worker 1
  EXPECT_TRUE(sharing.keep(0, 1, second));
}

TEST(StageSharing, KeepsWhileTheNextWorkerIsBusyAndTheCutStaysNearTheHalf) {
  // Four stages of 10 ms: worker 0's share is 20 (half), the margin 5 (an eighth of 40).
  StageSharing sharing(4, 2);
  run_through(sharing, {10, 10, 10, 10});
  auto t = ticket(sharing.enter());
  sharing.passed(0, 10 * kMs, t);
  EXPECT_EQ(sharing.estimate_ns(3, t), 10 * kMs);
  // Stage 1's middle (15) lies a margin below the share: kept whatever the next worker does.
  EXPECT_TRUE(sharing.keep(0, 1, t));
  sharing.passed(1, 10 * kMs, t);
  // Stage 2's middle (25) lies within the margin above: kept only while worker 1 has work of its own.
  EXPECT_FALSE(sharing.keep(0, 2, t)) << "worker 1 is idle: hand the stage over";
  sharing.given(1);
  EXPECT_TRUE(sharing.keep(0, 2, t)) << "worker 1 is busy: handing over would leave worker 0 waiting";
  sharing.done(1);
  EXPECT_FALSE(sharing.keep(0, 2, t));
}

TEST(StageSharing, EachStepIsCutByTheShapeOfStepsOfItsOwnSize) {
  // Two kinds of step alternate, as prefill and decode steps do: small ones (10 ms in stage 0) spend most in the last
  // stage (a language model's head), large ones (100 ms) in the first. Estimates scale the step's own first stage by
  // the stages' ratios in steps of about its size, so each kind gets its own cut.
  StageSharing sharing(4, 2);
  run_through(sharing, {10, 10, 10, 30});
  run_through(sharing, {100, 10, 10, 10});
  auto large = ticket(sharing.enter());
  sharing.passed(0, 90 * kMs, large);
  EXPECT_NEAR(sharing.estimate_ns(3, large), 9 * kMs, 1);
  // Its stage 1 (middle 94.5 of 117) lies beyond the share even with the margin: handed on although worker 1 is busy.
  sharing.given(1);
  EXPECT_FALSE(sharing.keep(0, 1, large));
  sharing.done(1);
  sharing.passed(1, 9 * kMs, large);  // worker 1 ran it
  sharing.passed(2, 9 * kMs, large);
  sharing.passed(3, 9 * kMs, large);
  auto small = ticket(sharing.enter());
  sharing.passed(0, 12 * kMs, small);  // a size between the two: the small steps' class is the nearest
  EXPECT_NEAR(sharing.estimate_ns(3, small), 36 * kMs, 1);
  // Stage 1 (middle 18 of 72) lies a margin below the share: kept although worker 1 is idle; stage 2 (middle 30)
  // within the margin above: kept while worker 1 is busy only.
  EXPECT_TRUE(sharing.keep(0, 1, small));
  sharing.passed(1, 12 * kMs, small);
  EXPECT_FALSE(sharing.keep(0, 2, small));
  sharing.given(1);
  EXPECT_TRUE(sharing.keep(0, 2, small));
  sharing.done(1);
}

TEST(StageSharing, RatiosFollowTheLatestStepsOfASize) {
  // Equal stages: stage 2's middle (25 of 40) lies within the margin above the half, so it is handed to an idle
  // worker 1. After many steps whose last stage got slow (70), the same stage lies far below the half (25 of 100)
  // and worker 0 keeps it.
  StageSharing sharing(4, 2);
  run_through(sharing, {10, 10, 10, 10});
  auto before = ticket(sharing.enter());
  sharing.passed(0, 10 * kMs, before);
  sharing.passed(1, 10 * kMs, before);
  EXPECT_FALSE(sharing.keep(0, 2, before));
  sharing.passed(2, 10 * kMs, before);
  sharing.passed(3, 10 * kMs, before);
  for (int i = 0; i < 30; ++i) run_through(sharing, {10, 10, 10, 70});
  auto after = ticket(sharing.enter());
  sharing.passed(0, 10 * kMs, after);
  sharing.passed(1, 10 * kMs, after);
  EXPECT_NEAR(sharing.estimate_ns(3, after), 70 * kMs, 0.1 * kMs);
  EXPECT_TRUE(sharing.keep(0, 2, after));
}

// ---- a session on shared stages ----

using test::eager;

SessionOptions two_workers(int64_t microbatches) {
  SessionOptions o;
  o.num_microbatches = microbatches;
  o.stage_workers = 2;
  return o;
}

TEST(SharedStages, FourStagesOnTwoWorkersAnswerEveryCallFromFourThreads) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), two_workers(4));
  ASSERT_EQ(session.num_stages(), 4u);
  EXPECT_EQ(session.concurrent_stages(), 2u);
  (void)at::randn({1});  // LibTorch's generator, created before the threads (see test_session.cpp)
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int c = 0; c < 50; ++c) {
        const int64_t batch = 1 + static_cast<int64_t>(rng() % 12);
        at::Tensor x = at::randn({batch, 512}), y = at::randn({batch, 512});
        try {
          auto out = session.run({x, y});
          if (out.size() != 1 || !at::allclose(out[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5)) ++wrong;
        } catch (const std::exception&) {
          ++failed;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  const uint64_t total = session.stats(0).microbatches;
  EXPECT_GE(total, 200u);
  for (size_t s = 0; s < 4; ++s) {
    const auto st = session.stats(s);
    EXPECT_EQ(st.microbatches, total) << "every micro-batch passes every stage, stage " << s;
    EXPECT_GT(st.busy_ms, 0) << s;
    EXPECT_EQ(st.queue_depth, 0u) << s;
  }
  // The shared stages report no waiting of their own: their workers' waiting is the outer stages'.
  EXPECT_EQ(session.stats(1).idle_ms, 0);
  EXPECT_EQ(session.stats(2).idle_ms, 0);
}

TEST(SharedStages, AFailingCallPassesTheLaterStagesAndTheNextCallsStillRunInOrder) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), two_workers(2));
  // y is read by the last stage only: a wrong width fails there. Calls after it must still pass every stage (a
  // stage that lost count of the order would never run them: this would hang, and the hang guard is ctest's).
  std::string msg;
  EXPECT_EQ(status_of([&] { session.run({at::randn({4, 512}), at::randn({4, 100})}); }, &msg), Status::Execution);
  EXPECT_NE(msg.find("stage 3 failed"), std::string::npos) << msg;
  for (int i = 0; i < 10; ++i) {
    at::Tensor x = at::randn({6, 512}), y = at::randn({6, 512});
    EXPECT_TRUE(at::allclose(session.run({x, y})[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5)) << i;
  }
  EXPECT_EQ(session.stats(3).failures, 1u);
}

TEST(SharedStages, TheTraceKeepsOneTrackPerStageAndNamesTheWorker) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), two_workers(4));
  session.start_trace();
  session.run({at::randn({8, 512}), at::randn({8, 512})});
  const auto trace = nlohmann::json::parse(session.stop_trace());
  std::map<int, int> slices;
  std::map<int, std::set<int>> workers;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || !e["args"].contains("microbatch")) continue;
    ++slices[e["tid"].get<int>()];
    workers[e["tid"].get<int>()].insert(e["args"]["worker"].get<int>());
  }
  for (int s = 0; s < 4; ++s) EXPECT_EQ(slices[s], 4) << "one slice per micro-batch on stage " << s;
  EXPECT_EQ(workers[0], std::set<int>{0}) << "stage 0 is worker 0's";
  EXPECT_EQ(workers[3], std::set<int>{1}) << "the last stage is the last worker's";
}

TEST(SharedStages, WorkerCountsOutsideOneToTheStagesAreRefused) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  for (int workers : {-1, 5}) {
    SessionOptions o;
    o.stage_workers = workers;
    std::string msg;
    EXPECT_EQ(status_of([&] { Session(Plan::from_markers(model), o); }, &msg), Status::InvalidArgument) << workers;
    EXPECT_NE(msg.find("stage_workers must be 0 (automatic) or 1 .. the 4 stages"), std::string::npos) << msg;
  }
  SessionOptions one;
  one.stage_workers = 1;  // every stage on one thread
  Session session(Plan::from_markers(model), one);
  at::Tensor x = at::randn({3, 512}), y = at::randn({3, 512});
  EXPECT_TRUE(at::allclose(session.run({x, y})[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5));
}

}  // namespace
}  // namespace libpipe
