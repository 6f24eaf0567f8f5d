#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "runtime/stage/spare_cores.h"

namespace libpipe {
namespace {

using stage::SpareCores;

// Records which thread ran each index.
struct Runs {
  explicit Runs(int64_t n) : count(n), thread(n) {
    for (auto& c : count) c = 0;
  }
  void record(int64_t i) {
    count[i].fetch_add(1);
    std::lock_guard lock(mutex);
    thread[i] = std::this_thread::get_id();
  }
  std::vector<std::atomic<int>> count;
  std::vector<std::thread::id> thread;
  std::mutex mutex;
};

TEST(SpareCores, WithoutALentPoolEveryIndexRunsHereInOrder) {
  std::vector<int64_t> order;
  SpareCores::for_each(5, [&](int64_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(SpareCores, AnIdleCoreTakesPartOfTheWork) {
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  SpareCores::Busy busy(&pool);  // this thread is the one busy stage of two
  const auto me = std::this_thread::get_id();
  std::mutex mutex;
  std::condition_variable cv;
  bool other_ran = false;
  Runs runs(64);
  // Index 0, if this thread takes it, waits until an index ran on another thread: it returns only
  // if a helper joined (the deadline is a guard against a hang, far beyond any scheduling delay).
  SpareCores::for_each(64, [&](int64_t i) {
    runs.record(i);
    std::unique_lock lock(mutex);
    if (std::this_thread::get_id() != me) {
      other_ran = true;
      cv.notify_all();
    } else if (i == 0) {
      cv.wait_for(lock, std::chrono::seconds(60), [&] { return other_ran; });
    }
  });
  EXPECT_TRUE(other_ran) << "no index ran on a helper while a core was idle";
  for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(runs.count[i].load(), 1) << "index " << i;
}

TEST(SpareCores, NoHelperJoinsWhileEveryCoreIsBusy) {
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  SpareCores::Busy me(&pool), other_stage(&pool);
  std::vector<int64_t> order;
  const auto here = std::this_thread::get_id();
  bool elsewhere = false;
  SpareCores::for_each(100, [&](int64_t i) {
    order.push_back(i);  // unsynchronized on purpose: a helper here would be a race TSan reports
    elsewhere |= std::this_thread::get_id() != here;
  });
  EXPECT_FALSE(elsewhere);
  ASSERT_EQ(order.size(), 100u);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(SpareCores, AnExceptionReachesTheCallerAndThePoolKeepsWorking) {
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  Runs runs(32);
  EXPECT_THROW(SpareCores::for_each(32,
                                    [&](int64_t i) {
                                      runs.record(i);
                                      if (i == 5) throw std::runtime_error("chunk 5 failed");
                                    }),
               std::runtime_error);
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(runs.count[i].load(), 1) << "index " << i;
  Runs again(32);
  SpareCores::for_each(32, [&](int64_t i) { again.record(i); });
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(again.count[i].load(), 1) << "index " << i;
}

TEST(SpareCores, CallersAtOnceEachGetEveryIndexOnce) {
  SpareCores pool(3);
  std::atomic<bool> ok{true};
  std::vector<std::thread> callers;
  // Not marked busy: every call finds spare cores, and the callers contend for the helpers.
  for (int t = 0; t < 3; ++t)
    callers.emplace_back([&] {
      SpareCores::Lend lend(&pool);
      for (int round = 0; round < 200; ++round) {
        Runs runs(7);
        SpareCores::for_each(7, [&](int64_t i) { runs.record(i); });
        for (int64_t i = 0; i < 7; ++i)
          if (runs.count[i].load() != 1) ok = false;
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_TRUE(ok);
}

}  // namespace
}  // namespace libpipe
