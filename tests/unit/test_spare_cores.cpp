#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "runtime/stage/panel_linear.h"
#include "runtime/stage/spare_cores.h"
#include "runtime/stage/warm_ahead.h"

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

// Reading ahead (SpareCores::warm) happens on an idle helper while it waits: each round runs a job, which wakes the
// helper and leaves it spinning, then posts; the rounds end when it has read what was asked (the bound only guards
// against a hang: one round in which the helper is scheduled while it spins is enough).
template <typename Post>
void wait_for_read_ahead(SpareCores& pool, uint64_t bytes, Post post) {
  const uint64_t before = pool.read_ahead_bytes();
  for (int round = 0; round < 200000 && pool.read_ahead_bytes() - before < bytes; ++round) {
    SpareCores::for_each(2, [](int64_t) {});
    post();
    for (int spin = 0; spin < 1000 && pool.read_ahead_bytes() - before < bytes; ++spin) std::this_thread::yield();
  }
}

TEST(SpareCores, AnIdleHelperReadsWarmedTensorsAndHoldsThemWhileItReads) {
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  SpareCores::Busy busy(&pool);
  const uint64_t bytes = 1 << 20;
  // Each round posts a tensor that only the pool holds: it must keep it while a helper reads it (ASan reports a read
  // of freed memory otherwise).
  wait_for_read_ahead(pool, bytes, [&] {
    SpareCores::warm(std::make_shared<std::vector<at::Tensor>>(1, at::ones({static_cast<int64_t>(bytes / 4)})));
  });
  EXPECT_GE(pool.read_ahead_bytes(), bytes) << "no helper read the tensors ahead while a core was idle";
}

TEST(SpareCores, NothingIsReadAheadWithoutASpareCoreOrWhenTurnedOff) {
  const auto tensors = std::make_shared<std::vector<at::Tensor>>(1, at::ones({1 << 18}));
  SpareCores::warm(tensors);  // no pool lent: nothing to do, nothing to crash
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  {
    SpareCores::Busy me(&pool), other_stage(&pool);  // every core has a busy stage
    for (int i = 0; i < 100; ++i) {
      SpareCores::for_each(2, [](int64_t) {});
      SpareCores::warm(tensors);
    }
  }
  SpareCores::Busy me(&pool);
  const bool was = SpareCores::warm_ahead();
  SpareCores::set_warm_ahead(false);
  for (int i = 0; i < 100; ++i) {
    SpareCores::for_each(2, [](int64_t) {});
    SpareCores::warm(tensors);
  }
  SpareCores::set_warm_ahead(was);
  // A helper spinning after the last job has nothing posted to read.
  for (int i = 0; i < 1000; ++i) std::this_thread::yield();
  EXPECT_EQ(pool.read_ahead_bytes(), 0u);
}

// A stage runs the same products in the same order every step: after a product, the next one's weights are read
// ahead, and nothing a product returns changes.
TEST(SpareCores, ProductsReadTheNextProductsWeightsAheadAndKeepTheirBits) {
  if (!stage::panel_linear_available()) GTEST_SKIP() << "no panels on this CPU";
  at::manual_seed(0);
  std::vector<at::Tensor> panels;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{96, 80}, {33, 96}, {200, 33}};
  for (auto [n, k] : shapes) panels.push_back(stage::to_panels(at::randn({n, k})));
  const at::Tensor x = at::randn({1, 80});
  auto step = [&] {
    at::Tensor h = x;
    for (size_t i = 0; i < panels.size(); ++i)
      h = stage::panel_linear(h, panels[i], std::nullopt, shapes[i].first, shapes[i].second);
    return h;
  };
  const at::Tensor alone = step();  // no pool lent: computed here without any reading ahead
  SpareCores pool(2);
  SpareCores::Lend lend(&pool);
  SpareCores::Busy busy(&pool);
  at::Tensor shared;
  wait_for_read_ahead(pool, 1, [&] { shared = step(); });
  EXPECT_GT(pool.read_ahead_bytes(), 0u) << "no product's successor was read ahead";
  EXPECT_TRUE(at::equal(shared, alone));
  const bool was = SpareCores::warm_ahead();
  SpareCores::set_warm_ahead(false);
  EXPECT_TRUE(at::equal(step(), alone));
  SpareCores::set_warm_ahead(was);
}

}  // namespace
}  // namespace libpipe
