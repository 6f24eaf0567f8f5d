#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "../conformance/worker_threads.h"
#include "../gate/gate.h"
#include "eager_reference.h"
#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/graph/plan.h"
#include "runtime/schedule/session.h"
#include "runtime/stage/spare_cores.h"

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

using test::eager;

using test::status_of;

// Creates LibTorch's default CPU generator on this thread before a test starts threads that draw
// random inputs: LibTorch creates it lazily, and ThreadSanitizer cannot see the synchronisation
// inside (uninstrumented) LibTorch that publishes it to the other threads.
void create_generator_before_threads() { (void)at::randn({1}); }

TEST(Session, AThousandRequestsFromEightThreadsAllGetTheirOwnAnswer) {
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  Session session(Plan::from_markers(model), with_microbatches(4));
  constexpr int kThreads = 8, kCalls = 125;
  std::atomic<int> wrong{0}, failed{0};
  create_generator_before_threads();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int c = 0; c < kCalls; ++c) {
        const int64_t batch = 1 + static_cast<int64_t>(rng() % 12);
        at::Tensor x = at::randn({batch, 512}), y = at::randn({batch, 512});
        try {
          auto out = session.run({x, y});
          if (out.size() != 1 || out[0].name != "output" ||
              !at::allclose(out[0].tensor, eager(*model, {x, y}), 1e-5, 1e-5))
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
  create_generator_before_threads();
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

// The gated model (tests/gate): each of its two stages holds a micro-batch at a gate until the
// test opens it, so that a test knows where every micro-batch is instead of guessing how long some
// work takes. A call's key (input n, replicated to every micro-batch) names its gate; key 0 passes.
std::shared_ptr<const Model> gated_model() {
  // gate_init sets an environment variable: it runs before the first gated test creates its
  // session, while no stage thread can read the environment.
  static const bool ready = gate_init() == 0;
  if (!ready) throw std::runtime_error("the test gate is not available (see the message above)");
  return Model::load(test::fixture("gated.scripted.pt"));
}

std::vector<c10::IValue> gated(const at::Tensor& x, int64_t key) { return {x, at::scalar_tensor(key, at::kLong)}; }

// The gated model's output for x, computed eagerly (gates do not change values).
at::Tensor gated_eager(const Model& model, const at::Tensor& x) { return eager(model, gated(x, 0)); }

SessionOptions fixed_microbatches(int64_t m) {
  SessionOptions o = with_microbatches(m);
  o.adaptive_microbatches = false;  // every call gets m: the counts the tests assert are known
  return o;
}

// Opens a gate when the test leaves, also after a failed assertion, so that a broken test ends
// instead of holding its session's destructor until the gate's own limit. Declare it after the
// session (it must open before the session is destroyed).
struct OpenAtExit {
  int64_t key;
  ~OpenAtExit() { gate_open(key, nullptr); }
};

// Returns once the clock is past `t`: a wait for a condition, the deadline's passing.
void wait_until_past(Clock::time_point t) {
  while (Clock::now() <= t) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Each stage thread runs with its session's count of intra-op threads, also when another session
// of the process, with another count, starts its threads after it (ATen's count of a thread is
// set on its first parallel operation from the count any thread set last).
TEST(Session, StagesKeepTheirSessionsThreadCount) {
  auto model = gated_model();
  SessionOptions one = fixed_microbatches(1), two = fixed_microbatches(1);
  one.threads_per_stage = 1;
  two.threads_per_stage = 2;
  Session first(Plan::from_markers(model), one);
  Session second(Plan::from_markers(model), two);  // its stage threads set 2 after first's set 1
  const int64_t a = gate_new_key(), b = gate_new_key();
  OpenAtExit open_a{a}, open_b{b};
  gate_open(a, nullptr);
  gate_open(b, nullptr);
  at::Tensor x = at::randn({4, 64});
  EXPECT_TRUE(at::allclose(first.run(gated(x, a)).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(second.run(gated(x, b)).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
  EXPECT_EQ(gate_arrived_threads(a, "stage0"), 1);
  EXPECT_EQ(gate_arrived_threads(a, "stage1"), 1);
  EXPECT_EQ(gate_arrived_threads(b, "stage0"), 2);
  EXPECT_EQ(gate_arrived_threads(b, "stage1"), 2);
}

TEST(Session, CancelStopsACallAndLeavesOthersAlone) {
  auto model = gated_model();
  Session session(Plan::from_markers(model), fixed_microbatches(4));
  const int64_t key = gate_new_key();
  OpenAtExit open_at_exit{key};
  at::Tensor x = at::randn({4, 64}), y = at::randn({4, 64});
  auto held = session.submit(gated(x, key));
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));  // its first micro-batch runs in stage 0
  auto other = session.submit(gated(y, 0));             // queued behind the held call's other three
  held->cancel();
  std::string msg;
  EXPECT_EQ(status_of([&] { held->result({}); }, &msg), Status::Cancelled);
  EXPECT_NE(msg.find("cancelled"), std::string::npos) << msg;
  gate_open(key, nullptr);
  auto out = other->result({});
  EXPECT_TRUE(at::allclose(out.at(0).tensor, gated_eager(*model, y), 1e-5, 1e-5));
  held->drain();
  // The held call's first micro-batch finished the stage it was running when cancelled; its other
  // three were dropped unrun and none of its micro-batches reached stage 1.
  EXPECT_EQ(session.stats(0).microbatches, 1u + 4u);
  EXPECT_EQ(session.stats(1).microbatches, 4u);
  EXPECT_EQ(gate_count(key, "stage1", "arrived"), 0);
}

TEST(Session, DeadlinesFailCallsThatRunLate) {
  auto model = gated_model();
  Session session(Plan::from_markers(model), fixed_microbatches(2));
  const int64_t key = gate_new_key();
  OpenAtExit open_at_exit{key};
  at::Tensor x = at::randn({4, 64}), y = at::randn({4, 64});
  // A call holds stage 0, so the call behind it cannot finish before the test opens the gate, which
  // it does only once the clock is past the late call's deadline.
  auto blocker = session.submit(gated(x, key));
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  schedule::RunOptions soon;
  soon.deadline = Clock::now() + std::chrono::milliseconds(10);
  std::thread opener([&] {
    wait_until_past(soon.deadline);
    gate_open(key, nullptr);
  });
  std::string msg;
  EXPECT_EQ(status_of([&] { session.run(gated(y, 0), soon); }, &msg), Status::DeadlineExceeded);
  opener.join();
  EXPECT_NE(msg.find("the call did not finish before its deadline"), std::string::npos) << msg;
  EXPECT_TRUE(at::allclose(blocker->result({}).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
  // The late call ran in no stage: its micro-batches came up after its deadline and were dropped.
  EXPECT_EQ(session.stats(0).microbatches, 2u);
  EXPECT_EQ(session.stats(1).microbatches, 2u);
  // A deadline far enough away is met (10 minutes: a bound that only a hung call reaches).
  schedule::RunOptions later;
  later.deadline = Clock::now() + std::chrono::minutes(10);
  EXPECT_TRUE(at::allclose(session.run(gated(y, 0), later).at(0).tensor, gated_eager(*model, y), 1e-5, 1e-5));
}

TEST(Session, WaitWithATimeoutReturnsEarlyAndTheCallGoesOn) {
  auto model = gated_model();
  Session session(Plan::from_markers(model), fixed_microbatches(2));
  const int64_t key = gate_new_key();
  OpenAtExit open_at_exit{key};
  at::Tensor x = at::randn({4, 64});
  auto r = session.submit(gated(x, key));
  EXPECT_FALSE(r->wait_until(Clock::now() + std::chrono::milliseconds(1)));  // its gate is closed
  gate_open(key, nullptr);
  EXPECT_TRUE(r->wait_until(Clock::time_point::max()));
  EXPECT_TRUE(at::allclose(r->result({}).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
}

TEST(Session, DestroyingASessionCancelsCallsInFlightAndFinishedCallsKeepTheirResults) {
  auto model = gated_model();
  SessionOptions o = fixed_microbatches(2);
  o.max_inflight = 64;
  worker_threads before, after, workers;
  worker_threads_now(&before);
  auto session = std::make_unique<Session>(Plan::from_markers(model), o);
  worker_threads_now(&after);
  worker_threads_started(&before, &after, &workers);
  ASSERT_GT(workers.count, 0u);
  const int64_t key = gate_new_key();
  OpenAtExit open_at_exit{key};
  at::Tensor x = at::randn({4, 64});
  auto finished = session->submit(gated(x, 0));
  ASSERT_TRUE(finished->wait_until(Clock::time_point::max()));
  std::vector<std::shared_ptr<schedule::Request>> in_flight{session->submit(gated(x, key))};
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  for (int i = 0; i < 5; ++i) in_flight.push_back(session->submit(gated(x, 0)));  // queued behind it
  // Destroy waits for the micro-batch held in stage 0. The gate opens once destroy has begun: once
  // the idle stage 1 worker has ended (worker_threads.h says why that shows it).
  std::thread destroyer([&] { session.reset(); });
  const bool began = worker_threads_wait_one_ended(&workers);
  gate_open(key, nullptr);
  destroyer.join();
  ASSERT_TRUE(began) << "none of the session's threads ended while it was being destroyed";
  for (auto& r : in_flight) {
    EXPECT_TRUE(r->wait_until(Clock::time_point::max()));
    std::string msg;
    EXPECT_EQ(status_of([&] { r->result({}); }, &msg), Status::Cancelled);
    EXPECT_NE(msg.find("the session was destroyed while the call was running"), std::string::npos) << msg;
  }
  EXPECT_TRUE(at::allclose(finished->result({}).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
}

TEST(Session, AdmissionIsBounded) {
  auto model = gated_model();
  SessionOptions o = fixed_microbatches(2);
  o.max_inflight = 2;
  Session session(Plan::from_markers(model), o);
  const int64_t key = gate_new_key();
  OpenAtExit open_at_exit{key};
  at::Tensor x = at::randn({4, 64}), y = at::randn({4, 64});
  auto first = session.submit(gated(x, key));  // both its micro-batches are admitted: no room left
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  EXPECT_EQ(session.stats(0).queue_depth, 1u);
  // The second call cannot enter while the first holds both places; with a deadline it fails
  // waiting for admission, and none of its micro-batches entered the pipeline.
  schedule::RunOptions soon;
  soon.deadline = Clock::now() + std::chrono::milliseconds(10);
  auto second = session.submit(gated(y, 0), soon);
  std::string msg;
  EXPECT_EQ(status_of([&] { second->result({}); }, &msg), Status::DeadlineExceeded);
  EXPECT_NE(msg.find("deadline passed while it waited for room in the pipeline"), std::string::npos) << msg;
  EXPECT_EQ(session.stats(0).queue_depth, 1u);
  gate_open(key, nullptr);
  EXPECT_TRUE(at::allclose(first->result({}).at(0).tensor, gated_eager(*model, x), 1e-5, 1e-5));
  // Once the first call has left, there is room again.
  EXPECT_TRUE(at::allclose(session.run(gated(y, 0)).at(0).tensor, gated_eager(*model, y), 1e-5, 1e-5));
  EXPECT_EQ(session.stats(0).microbatches, 2u + 2u);
  EXPECT_EQ(session.stats(1).microbatches, 2u + 2u);
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

// A call of one micro-batch, alone in the pipeline, runs every stage on the first stage's thread with the other cores
// lent to it (Session::run_alone_); a call cut into micro-batches keeps a thread per stage: its first micro-batch is
// never alone (the others are admitted or promised before it leaves stage 0). LIBPIPE_RUN_ALONE=0 keeps the stages'
// own threads. The answers are eager PyTorch's either way. The trace names the worker that ran a stage off its own.
TEST(Session, AMicroBatchAloneInThePipelineRunsEveryStageOnOneThread) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (!stage::SpareCores::enabled() || cores < 2 || cores / 4 > 1)
    GTEST_SKIP() << "4 stages on " << cores << " cores get no pool of spare cores here (an OpenMP team each, or one "
                 << "core): nothing runs alone";
  if (const char* env = std::getenv("LIBPIPE_RUN_ALONE"); env && std::string(env) == "0")
    GTEST_SKIP() << "LIBPIPE_RUN_ALONE=0: nothing runs alone";
  auto model = Model::load(test::fixture("multi_mlp.traced.pt"));
  const auto workers_of = [](const nlohmann::json& trace, int64_t microbatch) {
    std::map<int, int> worker;  // stage -> the worker that ran it
    for (const auto& e : trace["traceEvents"])
      if (e["ph"] == "X" && e["args"]["microbatch"] == microbatch)
        worker[e["tid"].get<int>()] = e["args"].value("worker", e["tid"].get<int>());
    return worker;
  };
  const std::map<int, int> one_thread{{0, 0}, {1, 0}, {2, 0}, {3, 0}}, own_threads{{0, 0}, {1, 1}, {2, 2}, {3, 3}};
  for (const bool alone : {true, false}) {
    SessionOptions o = fixed_microbatches(1);
    o.stage_workers = 4;  // a thread per stage, none shared
    if (!alone) setenv("LIBPIPE_RUN_ALONE", "0", 1);
    Session session(Plan::from_markers(model), o);
    unsetenv("LIBPIPE_RUN_ALONE");
    const at::Tensor x = at::randn({6, 512}), y = at::randn({6, 512});
    session.start_trace();
    auto out = session.run({x, y});
    EXPECT_TRUE(at::allclose(out.at(0).tensor, eager(*model, {x, y}), 1e-5, 1e-5));
    EXPECT_EQ(workers_of(nlohmann::json::parse(session.stop_trace()), 0), alone ? one_thread : own_threads);
  }
  SessionOptions o = fixed_microbatches(4);
  o.stage_workers = 4;
  Session session(Plan::from_markers(model), o);
  const at::Tensor x = at::randn({8, 512}), y = at::randn({8, 512});
  session.start_trace();
  auto out = session.run({x, y});
  EXPECT_TRUE(at::allclose(out.at(0).tensor, eager(*model, {x, y}), 1e-5, 1e-5));
  EXPECT_EQ(workers_of(nlohmann::json::parse(session.stop_trace()), 0), own_threads);
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
