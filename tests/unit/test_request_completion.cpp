// A request tells that its call finished without anybody waiting on it: its callback runs exactly
// once with the call's status, and its eventfd becomes readable and stays so. Calls are held at the
// test gate (tests/gate) so that each test knows where the call is, never how long it takes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "../gate/gate.h"
#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/io/safetensors.h"
#include "runtime/schedule/session.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;
using schedule::Clock;
using schedule::Request;
using schedule::Session;
using schedule::SessionOptions;
using test::status_of;

// What a callback saw: every call, with its status and thread.
class Told {
 public:
  Request::DoneFn callback() {
    return [this](Status status) {
      std::lock_guard lock(mutex_);
      ++calls_;
      status_ = status;
      thread_ = std::this_thread::get_id();
      changed_.notify_all();
    };
  }
  // The calls once there is at least one; the bound only ends a hung test.
  int wait() {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, std::chrono::seconds(GATE_WAIT_LIMIT_S), [&] { return calls_ > 0; });
    return calls_;
  }
  int calls() {
    std::lock_guard lock(mutex_);
    return calls_;
  }
  Status status() {
    std::lock_guard lock(mutex_);
    return status_;
  }
  std::thread::id thread() {
    std::lock_guard lock(mutex_);
    return thread_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int calls_ = 0;
  Status status_ = Status::Internal;
  std::thread::id thread_;
};

bool readable(int fd, int timeout_ms = 0) {
  pollfd p{fd, POLLIN, 0};
  const int n = ::poll(&p, 1, timeout_ms);
  if (n < 0) throw std::runtime_error("poll failed");
  return n == 1 && (p.revents & POLLIN);
}

class RequestCompletion : public ::testing::Test {
 protected:
  void SetUp() override {
    // gate_init sets an environment variable: once, before the first session starts its threads.
    static const bool ready = gate_init() == 0;
    ASSERT_TRUE(ready) << "the test gate is not available (see the message above)";
    model_ = Model::load(test::fixture("gated.scripted.pt"));
    for (auto& t : io::read_safetensors(test::fixture("gated.inputs.safetensors")))
      if (t.name == "x") x_ = t.tensor;
    for (auto& t : io::read_safetensors(test::fixture("gated.expected.safetensors")))
      if (t.name == "output") expected_ = t.tensor;
    ASSERT_TRUE(x_.defined() && expected_.defined());
    SessionOptions o;
    o.num_microbatches = 2;
    o.adaptive_microbatches = false;
    session_ = std::make_unique<Session>(Plan::from_markers(model_), o);
  }
  void TearDown() override {
    for (int64_t key : keys_) gate_open(key, nullptr);  // also after a failed assertion
    session_.reset();
  }
  // A gate key opened when the test ends at the latest.
  int64_t new_key() {
    keys_.push_back(gate_new_key());
    return keys_.back();
  }
  std::vector<c10::IValue> call(int64_t key) { return {x_, at::scalar_tensor(key, at::kLong)}; }
  void expect_fixture_output(Request& r) {
    auto out = r.result({});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(at::allclose(out[0].tensor, expected_, 1e-5, 1e-5));
  }

  std::shared_ptr<const Model> model_;
  at::Tensor x_, expected_;
  std::unique_ptr<Session> session_;
  std::vector<int64_t> keys_;
};

TEST_F(RequestCompletion, SuccessTellsOnceWithOkOnTheFinishingThread) {
  const int64_t key = new_key();
  auto r = session_->submit(call(key));
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  const int fd = r->event_fd();
  EXPECT_EQ(r->event_fd(), fd);  // the same descriptor every time
  EXPECT_FALSE(readable(fd));
  EXPECT_EQ(told.calls(), 0);
  Told second;
  EXPECT_FALSE(r->on_done(second.callback()));  // one callback per request
  gate_open(key, nullptr);
  EXPECT_TRUE(readable(fd, GATE_WAIT_LIMIT_S * 1000));
  EXPECT_EQ(told.wait(), 1);
  EXPECT_EQ(told.status(), Status::Ok);
  EXPECT_NE(told.thread(), std::this_thread::get_id());  // a stage's
  expect_fixture_output(*r);
  EXPECT_TRUE(readable(fd));  // stays readable
  r->abandon();
  EXPECT_EQ(told.calls(), 1);
  EXPECT_EQ(second.calls(), 0);
}

TEST_F(RequestCompletion, AStageFailureTellsItsStatus) {
  // x with 63 columns instead of 64 fails in stage 0's matmul.
  auto r = session_->submit({x_.narrow(1, 0, 63).contiguous(), at::scalar_tensor(0, at::kLong)});
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  EXPECT_EQ(told.wait(), 1);
  EXPECT_EQ(told.status(), Status::Execution);
  EXPECT_EQ(status_of([&] { r->result({}); }), Status::Execution);
  EXPECT_TRUE(readable(r->event_fd()));  // made after the call finished: readable at once
  r->drain();
  EXPECT_EQ(told.calls(), 1);
}

TEST_F(RequestCompletion, CancelTellsCancelledOnTheCancellingThread) {
  const int64_t key = new_key();
  auto r = session_->submit(call(key));
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  const int fd = r->event_fd();
  r->cancel();
  EXPECT_EQ(told.calls(), 1);
  EXPECT_EQ(told.status(), Status::Cancelled);
  EXPECT_EQ(told.thread(), std::this_thread::get_id());
  EXPECT_TRUE(readable(fd));
  r->cancel();  // finished: nothing more to tell
  gate_open(key, nullptr);
  r->drain();
  EXPECT_EQ(told.calls(), 1);
  EXPECT_EQ(status_of([&] { r->result({}); }), Status::Cancelled);
}

TEST_F(RequestCompletion, ADeadlineFiresByItselfWhileAStageHoldsTheCall) {
  const int64_t key = new_key();
  schedule::RunOptions soon;
  soon.deadline = Clock::now() + std::chrono::milliseconds(10);
  auto r = session_->submit(call(key), soon);
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  const int fd = r->event_fd();
  // Nobody waits on the request and its gate stays closed: only the session's timer can finish it.
  EXPECT_TRUE(readable(fd, GATE_WAIT_LIMIT_S * 1000));
  EXPECT_EQ(told.wait(), 1);
  EXPECT_EQ(told.status(), Status::DeadlineExceeded);
  EXPECT_EQ(gate_count(key, "stage0", "left"), 0);
  EXPECT_EQ(gate_count(key, "stage1", "arrived"), 0);
  std::string msg;
  EXPECT_EQ(status_of([&] { r->result({}); }, &msg), Status::DeadlineExceeded);
  EXPECT_NE(msg.find("did not finish before its deadline"), std::string::npos) << msg;
  gate_open(key, nullptr);
  r->drain();
  EXPECT_EQ(told.calls(), 1);
}

TEST_F(RequestCompletion, ACallbackSetAfterTheCallFinishedRunsAtOnceOnTheCallingThread) {
  auto r = session_->submit(call(0));
  expect_fixture_output(*r);
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  EXPECT_EQ(told.calls(), 1);
  EXPECT_EQ(told.status(), Status::Ok);
  EXPECT_EQ(told.thread(), std::this_thread::get_id());
  EXPECT_TRUE(readable(r->event_fd()));
  Told second;
  EXPECT_FALSE(r->on_done(second.callback()));
  EXPECT_EQ(second.calls(), 0);
}

TEST_F(RequestCompletion, AbandonTellsAHeldCallCancelledOnItsThread) {
  const int64_t key = new_key();
  auto r = session_->submit(call(key));
  ASSERT_TRUE(gate_wait(key, "stage0", "arrived", 1));
  Told told;
  ASSERT_TRUE(r->on_done(told.callback()));
  (void)r->event_fd();
  r->abandon();
  EXPECT_EQ(told.calls(), 1);
  EXPECT_EQ(told.status(), Status::Cancelled);
  EXPECT_EQ(told.thread(), std::this_thread::get_id());
  gate_open(key, nullptr);
  r->drain();
  EXPECT_EQ(told.calls(), 1);
}

// abandon() returns only once a callback running on another thread returned: the callback below
// is held inside (on the stage thread that finished the call) while abandon() is called, and what
// the abandoning thread sees when abandon() returns is recorded then. (Whether abandon() had
// begun waiting before the callback was let go is up to the scheduler: a library that did not
// wait fails this test only in the runs where it had.)
TEST_F(RequestCompletion, AbandonWaitsForACallbackRunningOnAnotherThread) {
  auto r = session_->submit(call(0));
  std::mutex m;
  std::condition_variable cv;
  bool inside = false, let_go = false, returned = false;
  ASSERT_TRUE(r->on_done([&](Status) {
    std::unique_lock lock(m);
    inside = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(GATE_WAIT_LIMIT_S), [&] { return let_go; });
    returned = true;
  }));
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(GATE_WAIT_LIMIT_S), [&] { return inside; }));
  }
  bool returned_before_abandon_did = false;
  std::thread abandoner([&] {
    r->abandon();
    std::lock_guard lock(m);
    returned_before_abandon_did = returned;
  });
  {
    std::lock_guard lock(m);
    let_go = true;
  }
  cv.notify_all();
  abandoner.join();
  EXPECT_TRUE(returned_before_abandon_did);
}

}  // namespace
}  // namespace libpipe
