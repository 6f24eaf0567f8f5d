// Decode steps padded for CUDA graphs (runtime/generate/graph_padding.h), against the rules worked out here: rows to
// the smallest 2^k + 1 above the step's, so that every padded step has a padding row; the longest context to a
// multiple of kContextBucket, never below the step's own and never past the caches; padding slots taken from the
// free ones in the order given, and no padding without enough of them.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "runtime/generate/graph_padding.h"

namespace libpipe::generate {
namespace {

TEST(GraphPadding, RowsGoToTheSmallestPowerOfTwoPlusOneAboveThem) {
  for (int64_t rows = 1; rows <= 300; ++rows) {
    const int64_t padded = padded_rows(rows);
    SCOPED_TRACE(rows);
    EXPECT_GT(padded, rows);
    const int64_t power = padded - 1;
    EXPECT_EQ(power & (power - 1), 0) << padded << " is no power of two plus one";
    EXPECT_LT(power / 2, rows) << "a smaller shape " << power / 2 + 1 << " holds " << rows << " rows and a pad";
  }
  EXPECT_EQ(padded_rows(1), 2);
  EXPECT_EQ(padded_rows(2), 3);
  EXPECT_EQ(padded_rows(3), 5);
  EXPECT_EQ(padded_rows(8), 9);
  EXPECT_EQ(padded_rows(9), 17);
}

TEST(GraphPadding, ContextsGoUpInBucketsCappedAtTheCacheLength) {
  const int64_t max_len = 3 * kContextBucket + 7;
  for (int64_t context = 1; context <= max_len; ++context) {
    const int64_t padded = padded_context(context, max_len);
    SCOPED_TRACE(context);
    EXPECT_GE(padded, context);
    EXPECT_LE(padded, max_len);
    EXPECT_TRUE(padded % kContextBucket == 0 || padded == max_len) << padded;
    EXPECT_LT(padded - context, kContextBucket);
  }
  EXPECT_EQ(padded_context(1, 64), 64);  // caches shorter than a bucket: one shape
  EXPECT_EQ(padded_context(kContextBucket + 1, 4096), 2 * kContextBucket);
}

TEST(GraphPadding, PaddingRowsTakeFreeSlotsInOrderAndSitAtThePaddedContextsEnd) {
  const std::vector<int64_t> free{7, 3, 5, 1};
  auto p = pad_decode_step(3, 300, 1024, free);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->rows, 5);
  EXPECT_EQ(p->slots, (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(p->start, padded_context(300, 1024) - 1);

  p = pad_decode_step(1, 1, 1024, free);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->rows, 2);
  EXPECT_EQ(p->slots, (std::vector<int64_t>{7}));
  EXPECT_EQ(p->start, kContextBucket - 1);
}

TEST(GraphPadding, TooFewFreeSlotsMeanNoPadding) {
  EXPECT_FALSE(pad_decode_step(6, 10, 64, {0, 1}).has_value());  // 9 rows: 3 padding rows
  EXPECT_FALSE(pad_decode_step(1, 10, 64, {}).has_value());
  EXPECT_TRUE(pad_decode_step(6, 10, 64, {0, 1, 2}).has_value());
  EXPECT_TRUE(pad_decode_step(5, 10, 64, {0, 1, 2, 3}).has_value());  // 9 rows: 4 padding rows
}

}  // namespace
}  // namespace libpipe::generate
