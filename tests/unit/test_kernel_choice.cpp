// cpu::KernelChoice: each class of products runs every variant in turn until each has its samples, then keeps
// the one that streamed the most bytes per second; a variant clearly slower at the first look stops being tried;
// classes decide apart; timings from many threads at once.
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
    // Slot `fast` streams 1.1 GB/s, the others 1 (too close to drop any early): it must win whichever slot it is.
    const int fast = variants - 1;
    std::vector<int> seen(variants, 0);
    for (int i = 0; i < KernelChoice::kSamples * variants; ++i) {
      EXPECT_EQ(choice.decided(type, KernelChoice::row_class(4)), -1) << "decided after " << i << " samples";
      const KernelChoice::Pick pick = choice.pick(type, 4);
      ASSERT_GE(pick.slot, 0);
      ASSERT_LT(pick.slot, variants);
      ++seen[pick.slot];
      choice.record(type, 4, pick.slot, pick.slot == fast ? 1100 : 1000, 1e-6);
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
    choice.record(type, 1, pick.slot, pick.slot == 0 ? 1200 : 1000, 1e-6);
  }
  EXPECT_EQ(choice.decided(type, 0), 0);
}

TEST(KernelChoice, AClearlySlowerVariantStopsAtTheFirstLook) {
  if (environment_fixes_a_choice()) GTEST_SKIP() << "LIBPIPE_PANEL_PREFETCH or LIBPIPE_BF16_KERNEL fixes a choice";
  for (WeightType type : {WeightType::kFloat32, WeightType::kBFloat16}) {
    const int variants = KernelChoice::variants(type);
    KernelChoice choice;
    // Slot 0 streams 2 GB/s, the others 1: past kClearlySlower, so the class decides once each has its first look.
    std::vector<int> seen(variants, 0);
    for (int i = 0; i < KernelChoice::kFirstLook * variants; ++i) {
      EXPECT_EQ(choice.decided(type, KernelChoice::row_class(64)), -1) << "decided after " << i << " samples";
      const KernelChoice::Pick pick = choice.pick(type, 64);
      ASSERT_GE(pick.slot, 0);
      ++seen[pick.slot];
      choice.record(type, 64, pick.slot, pick.slot == 0 ? 2000 : 1000, 1e-6);
    }
    for (int s = 0; s < variants; ++s) EXPECT_EQ(seen[s], KernelChoice::kFirstLook) << "slot " << s;
    EXPECT_EQ(choice.decided(type, KernelChoice::row_class(64)), 0);
    EXPECT_EQ(choice.pick(type, 64).slot, -1);
  }
}

TEST(KernelChoice, CloseVariantsGoOnWithoutTheDroppedOnes) {
  if (environment_fixes_a_choice()) GTEST_SKIP() << "LIBPIPE_PANEL_PREFETCH or LIBPIPE_BF16_KERNEL fixes a choice";
  const WeightType type = WeightType::kBFloat16;
  const int variants = KernelChoice::variants(type);
  if (variants < 4) GTEST_SKIP() << "needs four bfloat16 variants (a CPU with AVX-512 BF16)";
  KernelChoice choice;
  // Slots 0 and 1 (VDPBF16PS off) stream 0.5 GB/s, 2 and 3 stream 1.0 and 1.05: the first two are dropped at the
  // first look, the last two go on to kSamples each, and slot 3 wins.
  auto rate = [](int slot) { return slot < 2 ? 500 : slot == 2 ? 1000 : 1050; };
  std::vector<int> seen(variants, 0);
  for (int i = 0; i < 2 * KernelChoice::kSamples + 2 * KernelChoice::kFirstLook; ++i) {
    EXPECT_EQ(choice.decided(type, KernelChoice::row_class(32)), -1) << "decided after " << i << " samples";
    const KernelChoice::Pick pick = choice.pick(type, 32);
    ASSERT_GE(pick.slot, 0);
    ++seen[pick.slot];
    choice.record(type, 32, pick.slot, rate(pick.slot), 1e-6);
  }
  EXPECT_EQ(seen[0], KernelChoice::kFirstLook);
  EXPECT_EQ(seen[1], KernelChoice::kFirstLook);
  EXPECT_EQ(seen[2], KernelChoice::kSamples);
  EXPECT_EQ(seen[3], KernelChoice::kSamples);
  EXPECT_EQ(choice.decided(type, KernelChoice::row_class(32)), 3);
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
