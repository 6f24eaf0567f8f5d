// cpu::KernelChoice: each class of products runs every variant in turn until each has its samples, then keeps
// the one that streamed the most bytes per second; classes decide apart; timings from many threads at once.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <thread>
#include <vector>

#include "runtime/cpu/kernel_choice.h"

namespace libpipe {
namespace {

using cpu::KernelChoice;
using cpu::WeightType;

bool environment_fixes_a_choice() {
  return std::getenv("LIBPIPE_PANEL_PREFETCH") || std::getenv("LIBPIPE_BF16_KERNEL");
}

TEST(KernelChoice, RowCountsFallInTheirClasses) {
  EXPECT_EQ(KernelChoice::row_class(1), 0);
  EXPECT_EQ(KernelChoice::row_class(2), 1);
  EXPECT_EQ(KernelChoice::row_class(3), 1);
  EXPECT_EQ(KernelChoice::row_class(4), 2);
  EXPECT_EQ(KernelChoice::row_class(5), 2);
  EXPECT_EQ(KernelChoice::row_class(6), 3);
  EXPECT_EQ(KernelChoice::row_class(11), 3);
  EXPECT_EQ(KernelChoice::row_class(12), 4);
  EXPECT_EQ(KernelChoice::row_class(47), 4);
  EXPECT_EQ(KernelChoice::row_class(48), 5);
  EXPECT_EQ(KernelChoice::row_class(4096), 5);
}

TEST(KernelChoice, TriesEveryVariantInTurnThenKeepsTheFastest) {
  if (environment_fixes_a_choice()) GTEST_SKIP() << "LIBPIPE_PANEL_PREFETCH or LIBPIPE_BF16_KERNEL fixes a choice";
  for (WeightType type : {WeightType::kFloat32, WeightType::kBFloat16}) {
    const int variants = KernelChoice::variants(type);
    ASSERT_GE(variants, 2);  // prefetching or not, at least
    KernelChoice choice;
    // Slot `fast` streams 3 GB/s, the others 1: it must win whichever slot it is.
    const int fast = variants - 1;
    std::vector<int> seen(variants, 0);
    for (int i = 0; i < KernelChoice::kSamples * variants; ++i) {
      EXPECT_EQ(choice.decided(type, KernelChoice::row_class(4)), -1) << "decided after " << i << " samples";
      const KernelChoice::Pick pick = choice.pick(type, 4);
      ASSERT_GE(pick.slot, 0);
      ASSERT_LT(pick.slot, variants);
      ++seen[pick.slot];
      choice.record(type, 4, pick.slot, pick.slot == fast ? 3000 : 1000, 1e-6);
    }
    for (int s = 0; s < variants; ++s) EXPECT_EQ(seen[s], KernelChoice::kSamples) << "slot " << s;
    EXPECT_EQ(choice.decided(type, KernelChoice::row_class(4)), fast);
    const KernelChoice::Pick after = choice.pick(type, 5);  // the same class
    EXPECT_EQ(after.slot, -1) << "a decided class times nothing more";
    EXPECT_EQ(after.variant.prefetch, KernelChoice::variant(type, fast).prefetch);
    EXPECT_EQ(after.variant.native_bf16, KernelChoice::variant(type, fast).native_bf16);
    // Other classes and the other weight types are still measuring.
    EXPECT_EQ(choice.decided(type, KernelChoice::row_class(1)), -1);
    EXPECT_GE(choice.pick(type, 1).slot, 0);
  }
}

TEST(KernelChoice, TheSlowerVariantLosesWhereverItStands) {
  if (environment_fixes_a_choice()) GTEST_SKIP() << "LIBPIPE_PANEL_PREFETCH or LIBPIPE_BF16_KERNEL fixes a choice";
  KernelChoice choice;
  const WeightType type = WeightType::kFloat32;
  // Slot 0 fast: the first slot must win as well as the last.
  for (int i = 0; i < KernelChoice::kSamples * KernelChoice::variants(type); ++i) {
    const KernelChoice::Pick pick = choice.pick(type, 1);
    choice.record(type, 1, pick.slot, pick.slot == 0 ? 5000 : 1000, 1e-6);
  }
  EXPECT_EQ(choice.decided(type, 0), 0);
}

TEST(KernelChoice, ThreadsRecordingAtOnceStillDecideOnce) {
  if (environment_fixes_a_choice()) GTEST_SKIP() << "LIBPIPE_PANEL_PREFETCH or LIBPIPE_BF16_KERNEL fixes a choice";
  KernelChoice choice;
  const WeightType type = WeightType::kFloat32;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 10 * KernelChoice::kSamples; ++i) {
        const KernelChoice::Pick pick = choice.pick(type, 8);
        if (pick.slot >= 0) choice.record(type, 8, pick.slot, pick.slot == 1 ? 2000 : 1000, 1e-6);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(choice.decided(type, KernelChoice::row_class(8)), 1);
  std::set<int> slots;
  for (int i = 0; i < 10; ++i) slots.insert(choice.pick(type, 8).slot);
  EXPECT_EQ(slots, std::set<int>{-1});
}

}  // namespace
}  // namespace libpipe
