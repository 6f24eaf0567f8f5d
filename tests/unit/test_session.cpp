#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <random>
#include <set>
#include <thread>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/graph/plan.h"
#include "runtime/schedule/session.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;
using schedule::Clock;
using schedule::Session;
using schedule::SessionOptions;

SessionOptions with_microbatches(int64_t m) {
  SessionOptions o;
  o.num_microbatches = m;
  return o;
}

at::Tensor eager(const Model& model, const std::vector<c10::IValue>& inputs) {
  // No autograd: the reference needs none, and threads building grad accumulators for the same
  // parameters at once race inside LibTorch in ways ThreadSanitizer cannot see through.
  c10::InferenceMode inference;
  return const_cast<torch::jit::Module&>(model.module()).forward(inputs).toTensor();
}

using test::status_of;

TEST(Session, AThousandRequestsFromEightThreadsAllGetTheirOwnAnswer) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(4));
  constexpr int kThreads = 8, kCalls = 125;
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int c = 0; c < kCalls; ++c) {
        const int64_t batch = 1 + static_cast<int64_t>(rng() % 12);
        at::Tensor x = at::randn({batch, 512}), y = at::randn({batch, 512});
        try {
          auto out = session.run({x, y});
          if (out.size() != 1 || out[0].name != "output" || !at::allclose(out[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5))
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
  uint64_t total = 0;
  for (size_t s = 0; s < session.num_stages(); ++s) {
    auto st = session.stats(s);
    EXPECT_GT(st.busy_ms, 0) << s;
    EXPECT_EQ(st.failures, 0u) << s;
    EXPECT_EQ(st.queue_depth, 0u) << s;
    if (s == 0) total = st.microbatches;
    EXPECT_EQ(st.microbatches, total) << "every micro-batch passes every stage";
  }
  EXPECT_GE(total, 1000u);
}

TEST(Session, AFailingCallFailsAloneAndTheSessionKeepsServing) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(2));
  // y is read by the last stage only: a wrong width passes stages 0-2 and fails in stage 3,
  // while other calls run alongside.
  std::atomic<int> good{0};
  std::thread neighbour([&] {
    for (int i = 0; i < 20; ++i) {
      at::Tensor x = at::randn({4, 512}), y = at::randn({4, 512});
      good += at::allclose(session.run({x, y})[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5);
    }
  });
  std::string msg;
  EXPECT_EQ(status_of([&] { session.run({at::randn({4, 512}), at::randn({4, 100})}); }, &msg), Status::Execution);
  EXPECT_NE(msg.find("stage 3 failed"), std::string::npos) << msg;
  neighbour.join();
  EXPECT_EQ(good.load(), 20);
  EXPECT_EQ(session.stats(3).failures, 1u);
}

TEST(Session, TupleOutputsAreFlattenedAndMerged) {
  auto model = Model::load(test::fixture("tuple_output.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(3));
  at::Tensor x = at::randn({7, 512}), y = at::randn({7, 512});
  auto out = session.run({x, y});
  auto want = const_cast<torch::jit::Module&>(model->module()).forward({x, y}).toTupleRef().elements();
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].name, "output.0");
  EXPECT_EQ(out[1].name, "output.1");
  EXPECT_TRUE(at::allclose(out[0].tensor, want[0].toTensor(), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(out[1].tensor, want[1].toTensor(), 1e-5, 1e-5));
}

TEST(Session, OutputSpecsSumAndRequireEqual) {
  auto model = Model::load(test::fixture("tuple_output.traced.pt"));
  SessionOptions o = with_microbatches(4);
  o.output_specs = {{chunk::OutputSpec::Kind::Sum, 0}, {chunk::OutputSpec::Kind::Equal, 0}};
  Session session(Plan::from_markers(model), o);
  // Rows of x are identical, so every micro-batch's second output is the same: Equal holds.
  at::Tensor x = at::randn({1, 512}).expand({8, 512}).contiguous(), y = at::zeros({8, 512});
  auto out = session.run({x, y});
  auto want = const_cast<torch::jit::Module&>(model->module()).forward({x, y}).toTupleRef().elements();
  // Sum of the four 2-row micro-batches, each summed element-wise: rows of output.0 add up.
  auto parts = at::tensor_split(want[0].toTensor(), 4, 0);
  EXPECT_TRUE(at::allclose(out[0].tensor, parts[0] + parts[1] + parts[2] + parts[3], 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(out[1].tensor, at::tensor_split(want[1].toTensor(), 4, 0)[0], 1e-5, 1e-5));
  // Different rows: micro-batches disagree, and Equal names the output.
  std::string msg;
  EXPECT_EQ(status_of([&] { session.run({at::randn({8, 512}), at::zeros({8, 512})}); }, &msg), Status::Execution);
  EXPECT_NE(msg.find("output 'output.1' is specified as equal"), std::string::npos) << msg;
}

TEST(Session, InputSpecsSplitAnotherDimensionOrReplicate) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  SessionOptions o = with_microbatches(4);
  // y is given whole to every micro-batch: each micro-batch of x must then have y's rows, so a
  // batch of 1 row for x with a y of 1 row works; 4 rows of x with a 1-row y broadcast.
  o.input_specs = {{chunk::InputSpec::Kind::Split, 0}, {chunk::InputSpec::Kind::Replicate, 0}};
  Session session(Plan::from_markers(model), o);
  at::Tensor x = at::randn({8, 512}), y = at::randn({1, 512});
  auto out = session.run({x, y});
  EXPECT_TRUE(at::allclose(out[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5));
}

TEST(Session, SpecErrorsNameTheInput) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  SessionOptions o = with_microbatches(2);
  o.input_specs = {{chunk::InputSpec::Kind::Split, 1}, {chunk::InputSpec::Kind::Split, 0}};
  Session session(Plan::from_markers(model), o);
  std::string msg;
  // x split along 1 has 512 "rows", y along 0 has 16.
  EXPECT_EQ(status_of([&] { session.run({at::randn({16, 512}), at::randn({16, 512})}); }, &msg), Status::Input);
  EXPECT_NE(msg.find("input 'y' has 16 rows along dimension 0 but input 'x' has 512"), std::string::npos) << msg;
  SessionOptions bad = with_microbatches(2);
  bad.input_specs = {{chunk::InputSpec::Kind::Split, 5}};
  Session session2(Plan::from_markers(model), bad);
  EXPECT_EQ(status_of([&] { session2.run({at::randn({4, 512}), at::randn({4, 512})}); }, &msg), Status::Input);
  EXPECT_NE(msg.find("input 'x' has 2 dimensions; its spec splits dimension 5"), std::string::npos) << msg;
  SessionOptions too_many = with_microbatches(2);
  too_many.input_specs.resize(3);
  EXPECT_EQ(status_of([&] { Session s(Plan::from_markers(model), too_many); }, &msg), Status::InvalidArgument);
}

// The slow model: each stage repeats a small matmul n times.
std::vector<c10::IValue> slow_inputs(int64_t n, int64_t batch = 4) {
  return {at::randn({batch, 64}), at::scalar_tensor(n, at::kLong)};
}

TEST(Session, CancelStopsACallAndLeavesOthersAlone) {
  auto model = Model::load(test::fixture("slow_loop.scripted.pt"));
  SessionOptions fixed = with_microbatches(4);
  fixed.adaptive_microbatches = false;  // so that the counts below do not depend on timing
  Session session(Plan::from_markers(model), fixed);
  session.run(slow_inputs(2));  // warm up the TorchScript executor
  auto slow = session.submit(slow_inputs(20000));
  auto quick = session.submit(slow_inputs(2));
  slow->cancel();
  EXPECT_EQ(status_of([&] { slow->result({}); }), Status::Cancelled);
  EXPECT_NO_THROW(quick->result({}));
  slow->drain();
  // At most the slow call's first micro-batch had started in stage 0 when it was cancelled; the
  // rest were dropped unrun, and stage 1 ran none of them: only the warm-up's and the quick call's.
  const uint64_t stage0 = session.stats(0).microbatches;
  EXPECT_TRUE(stage0 == 4u + 4u || stage0 == 4u + 1u + 4u) << stage0;
  EXPECT_EQ(session.stats(1).microbatches, 4u + 4u);
}

TEST(Session, DeadlinesFailCallsThatRunLate) {
  auto model = Model::load(test::fixture("slow_loop.scripted.pt"));
  Session session(Plan::from_markers(model), with_microbatches(2));
  session.run(slow_inputs(2));
  schedule::RunOptions soon;
  soon.deadline = Clock::now() + std::chrono::milliseconds(20);
  std::string msg;
  const auto start = Clock::now();
  EXPECT_EQ(status_of([&] { session.run(slow_inputs(50000), soon); }, &msg), Status::DeadlineExceeded);
  EXPECT_NE(msg.find("deadline"), std::string::npos) << msg;
  // The call stops at its deadline plus at most the micro-batch running then, not after the
  // whole call (2 x 2 micro-batches of 50000 steps).
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
  // A deadline long enough is met.
  schedule::RunOptions later;
  later.deadline = Clock::now() + std::chrono::seconds(60);
  EXPECT_NO_THROW(session.run(slow_inputs(2), later));
}

TEST(Session, WaitWithATimeoutReturnsEarlyAndTheCallGoesOn) {
  auto model = Model::load(test::fixture("slow_loop.scripted.pt"));
  Session session(Plan::from_markers(model), with_microbatches(2));
  auto r = session.submit(slow_inputs(3000));
  EXPECT_FALSE(r->wait_until(Clock::now() + std::chrono::milliseconds(1)));
  EXPECT_TRUE(r->wait_until(Clock::time_point::max()));
  EXPECT_NO_THROW(r->result({}));
}

TEST(Session, DestroyingASessionFailsCallsInFlight) {
  auto model = Model::load(test::fixture("slow_loop.scripted.pt"));
  std::vector<std::shared_ptr<schedule::Request>> requests;
  {
    SessionOptions o = with_microbatches(4);
    o.max_inflight = 64;
    Session session(Plan::from_markers(model), o);
    for (int i = 0; i < 6; ++i) requests.push_back(session.submit(slow_inputs(3000)));
  }  // destroyed with work queued and running
  int cancelled = 0;
  for (auto& r : requests) {
    EXPECT_TRUE(r->wait_until(Clock::time_point::max()));
    const Status st = status_of([&] { r->result({}); });
    EXPECT_TRUE(st == Status::Ok || st == Status::Cancelled) << static_cast<int>(st);
    cancelled += st == Status::Cancelled;
  }
  EXPECT_GT(cancelled, 0);
}

TEST(Session, AdmissionIsBounded) {
  auto model = Model::load(test::fixture("slow_loop.scripted.pt"));
  SessionOptions o = with_microbatches(2);
  o.max_inflight = 2;
  Session session(Plan::from_markers(model), o);
  session.run(slow_inputs(2));
  auto first = session.submit(slow_inputs(2000));
  // The second call cannot enter until the first leaves room; with a short deadline it fails
  // while waiting for admission.
  schedule::RunOptions soon;
  soon.deadline = Clock::now() + std::chrono::milliseconds(5);
  auto second = session.submit(slow_inputs(2), soon);
  EXPECT_EQ(status_of([&] { second->result({}); }), Status::DeadlineExceeded);
  EXPECT_NO_THROW(first->result({}));
  for (size_t s = 0; s < session.num_stages(); ++s) EXPECT_LE(session.stats(s).queue_depth, 2u);
}

TEST(Session, TraceHasOneTrackPerStage) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(4));
  session.start_trace();
  session.run({at::randn({8, 512}), at::randn({8, 512})});
  const auto trace = nlohmann::json::parse(session.stop_trace());
  std::set<int> tracks, slices_per_track;
  std::map<int, int> slices;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks.insert(e["tid"].get<int>());
    if (e["ph"] == "X") ++slices[e["tid"].get<int>()];
  }
  EXPECT_EQ(tracks, (std::set<int>{0, 1, 2, 3}));
  for (int s = 0; s < 4; ++s) EXPECT_EQ(slices[s], 4) << "one slice per micro-batch on stage " << s;
}

TEST(Session, InputsOffTheCpuAreRefused) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(1));
  std::string msg;
  EXPECT_EQ(status_of([&] { session.run({at::randn({2, 512}).to(at::kMeta), at::randn({2, 512})}); }, &msg),
            Status::Input);
  EXPECT_NE(msg.find("input 'x' is on meta"), std::string::npos) << msg;
}

}  // namespace
}  // namespace libpipe
