// The engine's choice of steps in flight (runtime/generate/in_flight_policy.h), driven with made-up step times:
// it measures both limits, keeps the faster one per workload class, and tries the other again now and then.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

#include "runtime/generate/in_flight_policy.h"

namespace libpipe {
namespace {

using generate::InFlightPolicy;
using std::chrono::milliseconds;
using Time = std::chrono::steady_clock::time_point;

// Runs about `windows` windows of a steady workload in which a step of `tokens` tokens takes `one_ms` alone and,
// with more steps in flight, `pipelined_ms` each, overlapping (a step then completes every pipelined_ms / limit),
// as an engine would: launching up to the limit, completing the oldest step. Returns the steps launched under
// each limit meanwhile: {one at a time, pipelined}.
std::pair<uint64_t, uint64_t> drive(InFlightPolicy& policy, int windows, double one_ms, double pipelined_ms,
                                    int64_t active = 8, bool prompts = false, int64_t tokens = 8) {
  static Time now{};
  static uint64_t next = 1;
  const uint64_t one0 = policy.steps_one_at_a_time(), pipelined0 = policy.steps_pipelined();
  std::vector<uint64_t> flying;
  for (int64_t done = 0; done < windows * policy.window_size();) {
    while (static_cast<int64_t>(flying.size()) < policy.limit(active, prompts)) {
      policy.launched(next, tokens);
      flying.push_back(next++);
    }
    const double ms = flying.size() == 1 ? one_ms : pipelined_ms / static_cast<double>(flying.size());
    now += std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
    policy.completed(flying.front(), now);
    flying.erase(flying.begin());
    ++done;
  }
  while (!flying.empty()) {
    now += milliseconds(1);
    policy.completed(flying.front(), now);
    flying.erase(flying.begin());
  }
  policy.idle();
  return {policy.steps_one_at_a_time() - one0, policy.steps_pipelined() - pipelined0};
}

TEST(InFlightPolicy, NotAdaptiveKeepsOneStepPerStage) {
  InFlightPolicy policy(2, false);
  EXPECT_FALSE(policy.adaptive());
  EXPECT_EQ(drive(policy, 10, 5, 100).first, 0);
  EXPECT_EQ(policy.limit(8, false), 2);
  InFlightPolicy single(1, true);  // one stage: nothing to choose
  EXPECT_FALSE(single.adaptive());
  EXPECT_EQ(single.limit(1, false), 1);
}

TEST(InFlightPolicy, KeepsTheFasterLimitAndTriesTheOtherNowAndThen) {
  for (bool one_is_faster : {true, false}) {
    InFlightPolicy policy(2, true);
    // One at a time: 10 ms a step; pipelined: 30 ms each with two overlapping (15 ms a step), or 12 (6 ms).
    const auto [one, pipelined] = drive(policy, 48, 10, one_is_faster ? 30 : 12);
    EXPECT_GT(policy.rate(8, false, 1), 0);
    EXPECT_GT(policy.rate(8, false, 2), 0);
    EXPECT_EQ(policy.rate(8, false, 1) > policy.rate(8, false, 2), one_is_faster);
    const uint64_t faster = one_is_faster ? one : pipelined, slower = one_is_faster ? pipelined : one;
    // Both measured first, then the faster one but for one window in kExploreEvery.
    EXPECT_GT(slower, 0u);
    EXPECT_GT(faster, 4 * slower) << "one at a time " << one << ", pipelined " << pipelined;
  }
}

// Each try that confirms the faster limit doubles the wait before the next: over 120 windows of a steady workload
// the slower limit runs in its first window and a handful of tries (8, 16, 32, 64 windows apart), not in one
// window of every kExploreEvery (15).
TEST(InFlightPolicy, ConfirmedTriesOfTheSlowerLimitComeLessOften) {
  InFlightPolicy policy(2, true);
  const auto [one, pipelined] = drive(policy, 120, 10, 30);  // one at a time is faster
  const uint64_t slower_windows = pipelined / static_cast<uint64_t>(policy.window_size());
  EXPECT_GE(slower_windows, 3u) << "the slower limit must still be tried now and then";
  EXPECT_LE(slower_windows, 6u) << "one at a time " << one << ", pipelined " << pipelined;
}

// When the workload changes so that the other limit becomes faster, the policy follows: a try finds it faster,
// the waits start over, and the new faster limit takes most windows.
TEST(InFlightPolicy, FollowsAWorkloadWhoseFasterLimitChanges) {
  InFlightPolicy policy(2, true);
  drive(policy, 100, 10, 30);                                // one at a time faster: tries back off
  const auto [one, pipelined] = drive(policy, 200, 10, 12);  // now pipelined is faster (6 ms a step)
  EXPECT_GT(policy.rate(8, false, 2), policy.rate(8, false, 1));
  EXPECT_GT(pipelined, 2 * one) << "one at a time " << one << ", pipelined " << pipelined;
}

TEST(InFlightPolicy, EachWorkloadClassLearnsItsOwnChoice) {
  InFlightPolicy policy(2, true);
  drive(policy, 12, 10, 40, /*active=*/1);   // one sequence: one at a time wins
  drive(policy, 12, 40, 30, /*active=*/32);  // 32 sequences: pipelined wins
  EXPECT_GT(policy.rate(1, false, 1), policy.rate(1, false, 2));
  EXPECT_LT(policy.rate(32, false, 1), policy.rate(32, false, 2));
  // 2 and 32 are other classes than 1 and 3 (powers of two), prompts waiting another again.
  EXPECT_EQ(policy.rate(2, false, 1), 0);
  EXPECT_EQ(policy.rate(32, true, 1), 0);
  EXPECT_GT(policy.rate(17, false, 2), 0);  // 17 .. 32 share a class
}

TEST(InFlightPolicy, AnIdleGapIsNeverMeasured) {
  InFlightPolicy policy(2, true);
  Time now{};
  ASSERT_EQ(policy.limit(1, false), 1);  // unmeasured: one at a time first
  policy.launched(1000001, 1);
  now += milliseconds(10);
  policy.completed(1000001, now);
  policy.idle();  // the workload ended before the window did; a minute passes
  EXPECT_EQ(policy.rate(1, false, 1), 0);
  drive(policy, 4, 10, 40, 1, false, 1);
  // One token per 10 ms: about 100 tokens/s (a timed gap would have given well under 1).
  EXPECT_GT(policy.rate(1, false, 1), 50);
  EXPECT_LT(policy.rate(1, false, 1), 200);
}

TEST(InFlightPolicy, StepsAreCountedUnderTheLimitTheyWereLaunchedWith) {
  InFlightPolicy policy(3, true);
  drive(policy, 6, 10, 20);
  EXPECT_GT(policy.steps_one_at_a_time(), 0u);
  EXPECT_GT(policy.steps_pipelined(), 0u);
}

}  // namespace
}  // namespace libpipe
