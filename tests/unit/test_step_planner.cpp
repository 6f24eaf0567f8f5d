// The step planner's rules (runtime/generate/step_planner.h), against hand-worked plans and, for random ready sets,
// against invariants computed independently from the rules: decode rows first (oldest first), then prompt chunks
// (oldest first) within prefill_chunk minus the decode rows, at most row_cap = clamp(ceil(active / D), 1, max_rows)
// rows, start = cached, never a sequence twice, completes_prompt exactly for decode rows and last chunks.
//
// Beyond the header's text, two liveness rules (the planner's own comment; to be stated in the header): a waiting
// prompt is never starved by decode rows: when row_cap >= 2 the decode rows leave it one row, and it gets at least
// one token even when the decode rows use up prefill_chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "runtime/generate/step_planner.h"

namespace libpipe::generate {
namespace {

ReadyRow decoding(uint64_t sequence, int64_t slot, int64_t cached, uint64_t since) {
  return {sequence, slot, cached, 0, since};
}

ReadyRow prompt(uint64_t sequence, int64_t slot, int64_t cached, int64_t remaining, uint64_t since) {
  return {sequence, slot, cached, remaining, since};
}

StepBudget budget(int64_t active, int64_t d, int64_t max_rows, int64_t chunk) { return {active, d, max_rows, chunk}; }

std::vector<uint64_t> sequences(const std::vector<PlannedRow>& rows) {
  std::vector<uint64_t> out;
  for (const auto& r : rows) out.push_back(r.sequence);
  return out;
}

TEST(StepPlanner, NothingReadyPlansNothing) {
  EXPECT_TRUE(plan_step({}, budget(4, 2, 4, 256)).empty());
  EXPECT_TRUE(plan_step({}, budget(0, 1, 1, 1)).empty());
}

TEST(StepPlanner, DecodeRowsComeFirstOldestFirstThenPromptsOldestFirst) {
  // Given in neither age nor kind order; every row fits (row_cap 8, budget 256).
  const std::vector<ReadyRow> ready = {
      prompt(10, 0, 0, 5, 7), decoding(11, 1, 9, 4), prompt(12, 2, 0, 3, 2),
      decoding(13, 3, 20, 1), decoding(14, 4, 6, 9), prompt(15, 5, 4, 2, 5),
  };
  const auto rows = plan_step(ready, budget(8, 1, 8, 256));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{13, 11, 14, 12, 15, 10}));
  // Decode rows: one token at start = cached, and each gives a token.
  const std::map<uint64_t, std::pair<int64_t, int64_t>> slot_start = {{13, {3, 20}}, {11, {1, 9}}, {14, {4, 6}},
                                                                      {12, {2, 0}},  {15, {5, 4}}, {10, {0, 0}}};
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(rows[i].sequence);
    EXPECT_EQ(rows[i].slot, slot_start.at(rows[i].sequence).first);
    EXPECT_EQ(rows[i].start, slot_start.at(rows[i].sequence).second);
    EXPECT_TRUE(rows[i].completes_prompt);  // decode rows, and prompts that fit whole
  }
  EXPECT_EQ(rows[0].length, 1);
  EXPECT_EQ(rows[1].length, 1);
  EXPECT_EQ(rows[2].length, 1);
  EXPECT_EQ(rows[3].length, 3);
  EXPECT_EQ(rows[4].length, 2);
  EXPECT_EQ(rows[5].length, 5);
}

TEST(StepPlanner, DecodeRowsTakeTheRowsBeforePromptsWhenFewerRowsFit) {
  // row_cap = 1 (active 3 over D 4): the oldest decode row, though an older prompt waits.
  const std::vector<ReadyRow> ready = {prompt(1, 0, 0, 4, 1), decoding(2, 1, 5, 3), decoding(3, 2, 7, 2)};
  const auto rows = plan_step(ready, budget(3, 4, 8, 256));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{3}));
  EXPECT_EQ(rows[0].start, 7);
  EXPECT_EQ(rows[0].length, 1);
}

TEST(StepPlanner, PromptTokensStayWithinTheChunkLessTheDecodeRows) {
  // prefill_chunk 10, 3 decode rows: 7 prompt tokens. The oldest prompt (5) fits whole, the next gets the 2 left
  // (a chunk from its cached position, not its last), the third nothing.
  const std::vector<ReadyRow> ready = {
      decoding(1, 0, 3, 1),  decoding(2, 1, 3, 2),  decoding(3, 2, 3, 3),
      prompt(4, 3, 0, 5, 4), prompt(5, 4, 8, 6, 5), prompt(6, 5, 0, 1, 6),
  };
  const auto rows = plan_step(ready, budget(6, 1, 8, 10));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(rows[3].start, 0);
  EXPECT_EQ(rows[3].length, 5);
  EXPECT_TRUE(rows[3].completes_prompt);
  EXPECT_EQ(rows[4].start, 8);
  EXPECT_EQ(rows[4].length, 2);
  EXPECT_FALSE(rows[4].completes_prompt);
}

TEST(StepPlanner, WithoutDecodeRowsTheWholeChunkGoesToPrompts) {
  const std::vector<ReadyRow> ready = {prompt(1, 2, 16, 20, 1), prompt(2, 0, 0, 3, 2)};
  const auto rows = plan_step(ready, budget(2, 1, 4, 8));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1}));
  EXPECT_EQ(rows[0].slot, 2);
  EXPECT_EQ(rows[0].start, 16);
  EXPECT_EQ(rows[0].length, 8);
  EXPECT_FALSE(rows[0].completes_prompt);
}

TEST(StepPlanner, ALongPromptIsChunkedFromItsCachedPositionUntilItsLastChunk) {
  // 33 prompt tokens, chunks of 8, alone: 8, 8, 8, 8, 1 from start 0, 8, 16, 24, 32; only the last gives a token.
  ReadyRow row = prompt(7, 3, 0, 33, 1);
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::vector<bool> completes;
  for (uint64_t step = 2; row.remaining > 0; ++step) {
    const auto rows = plan_step({row}, budget(1, 2, 4, 8));
    ASSERT_EQ(rows.size(), 1u);
    ASSERT_EQ(rows[0].sequence, 7u);
    ASSERT_EQ(rows[0].slot, 3);
    chunks.emplace_back(rows[0].start, rows[0].length);
    completes.push_back(rows[0].completes_prompt);
    row.cached += rows[0].length;
    row.remaining -= rows[0].length;
    row.ready_since = step;
    ASSERT_LE(chunks.size(), 5u);
  }
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {8, 8}, {16, 8}, {24, 8}, {32, 1}}));
  EXPECT_EQ(completes, (std::vector<bool>{false, false, false, false, true}));
}

TEST(StepPlanner, DecodeRowsRideAlongWithEveryChunkOfALongPrompt) {
  // Two decoding sequences and a 20-token prompt, chunk 8: each step carries both decode rows and 6 prompt tokens
  // (no stall of the decoders while the prompt is prefilled).
  ReadyRow p = prompt(3, 2, 0, 20, 0);
  int64_t cached = 10;
  std::vector<int64_t> lengths;
  for (uint64_t step = 1; p.remaining > 0; ++step) {
    const auto rows =
        plan_step({p, decoding(1, 0, cached, 2 * step), decoding(2, 1, cached, 2 * step + 1)}, budget(3, 1, 4, 8));
    ASSERT_EQ(rows.size(), 3u);
    EXPECT_EQ(sequences(rows), (std::vector<uint64_t>{1, 2, 3}));
    EXPECT_EQ(rows[2].start, p.cached);
    lengths.push_back(rows[2].length);
    EXPECT_EQ(rows[2].completes_prompt, rows[2].length == p.remaining);
    p.cached += rows[2].length;
    p.remaining -= rows[2].length;
    ++cached;
    ASSERT_LE(lengths.size(), 4u);
  }
  EXPECT_EQ(lengths, (std::vector<int64_t>{6, 6, 6, 2}));
}

TEST(StepPlanner, RowCapIsActiveOverStepsInFlightRoundedUpWithinOneAndMaxRows) {
  std::vector<ReadyRow> ready;
  for (uint64_t s = 0; s < 16; ++s) ready.push_back(decoding(100 + s, static_cast<int64_t>(s), 4, 50 - s));
  struct Case {
    int64_t active, d, max_rows;
    size_t rows;
  };
  for (const Case c :
       {Case{8, 2, 16, 4}, Case{7, 2, 16, 4}, Case{9, 2, 16, 5}, Case{8, 3, 16, 3}, Case{16, 1, 16, 16},
        Case{16, 1, 5, 5}, Case{16, 4, 3, 3}, Case{1, 4, 16, 1}, Case{0, 2, 16, 1}, Case{16, 32, 16, 1}}) {
    SCOPED_TRACE(testing::Message() << "active " << c.active << " D " << c.d << " max_rows " << c.max_rows);
    const auto rows = plan_step(ready, budget(c.active, c.d, c.max_rows, 256));
    ASSERT_EQ(rows.size(), c.rows);
    // The oldest: ready_since 50 - s, so the largest s first.
    for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i].sequence, 115u - i);
  }
}

TEST(StepPlanner, RowCapSpreadsTheActiveSequencesOverTheStepsInFlight) {
  // 8 sequences hold slots and all are ready, D = 2: the first step takes the 4 oldest, the step formed while it
  // flies takes the other 4; no step takes everyone.
  std::vector<ReadyRow> ready;
  for (uint64_t s = 0; s < 8; ++s) ready.push_back(decoding(s, static_cast<int64_t>(s), 10, s));
  const auto first = plan_step(ready, budget(8, 2, 8, 256));
  ASSERT_EQ(sequences(first), (std::vector<uint64_t>{0, 1, 2, 3}));
  std::vector<ReadyRow> rest;
  for (const auto& r : ready)
    if (std::none_of(first.begin(), first.end(), [&](const PlannedRow& p) { return p.sequence == r.sequence; }))
      rest.push_back(r);
  EXPECT_EQ(sequences(plan_step(rest, budget(8, 2, 8, 256))), (std::vector<uint64_t>{4, 5, 6, 7}));
}

TEST(StepPlanner, PromptRowsCountAgainstTheRowCap) {
  // row_cap 4: one decode row and the three oldest of five short prompts.
  const std::vector<ReadyRow> ready = {
      prompt(1, 0, 0, 2, 1), prompt(2, 1, 0, 2, 2), prompt(3, 2, 0, 2, 3),
      prompt(4, 3, 0, 2, 4), prompt(5, 4, 0, 2, 5), decoding(6, 5, 3, 9),
  };
  EXPECT_EQ(sequences(plan_step(ready, budget(4, 1, 8, 256))), (std::vector<uint64_t>{6, 1, 2, 3}));
}

// ---- liveness: a waiting prompt is not starved by decode rows (see the top of this file) ----

TEST(StepPlanner, DecodeRowsLeaveAWaitingPromptOneRowWhenTwoOrMoreFit) {
  // row_cap 2 (active 4 over D 2), three decode rows ready: the oldest decodes and the prompt gets the other row.
  const std::vector<ReadyRow> ready = {decoding(1, 0, 5, 1), decoding(2, 1, 5, 2), decoding(3, 2, 5, 3),
                                       prompt(4, 3, 0, 6, 4)};
  const auto rows = plan_step(ready, budget(4, 2, 4, 256));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1, 4}));
  EXPECT_EQ(rows[1].length, 6);
  EXPECT_TRUE(rows[1].completes_prompt);
  // Without a waiting prompt the decode rows take both rows.
  EXPECT_EQ(sequences(plan_step({ready[0], ready[1], ready[2]}, budget(4, 2, 4, 256))), (std::vector<uint64_t>{1, 2}));
}

TEST(StepPlanner, AWaitingPromptGetsATokenEvenWhenDecodeRowsUseUpTheChunk) {
  // prefill_chunk 2, four decode rows: the chunk is used up, yet the prompt advances by one token.
  const std::vector<ReadyRow> ready = {decoding(1, 0, 5, 1), decoding(2, 1, 5, 2), decoding(3, 2, 5, 3),
                                       decoding(4, 3, 5, 4), prompt(5, 4, 3, 10, 5)};
  const auto rows = plan_step(ready, budget(5, 1, 8, 2));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(rows[4].start, 3);
  EXPECT_EQ(rows[4].length, 1);
  EXPECT_FALSE(rows[4].completes_prompt);
}

// ---- random ready sets against the rules' invariants ----

TEST(StepPlanner, RandomReadySetsFollowEveryRule) {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 3000; ++trial) {
    SCOPED_TRACE(trial);
    const int n = static_cast<int>(rng() % 12);
    const int64_t d = 1 + rng() % 4, max_rows = 1 + rng() % 10, chunk = 1 + rng() % 40;
    const int64_t active = n + static_cast<int64_t>(rng() % 6);  // the ready ones and some in flight
    // Distinct sequences, slots and ages, in random order.
    std::vector<uint64_t> ages(n);
    for (int i = 0; i < n; ++i) ages[i] = static_cast<uint64_t>(i) * 3 + 1;
    std::shuffle(ages.begin(), ages.end(), rng);
    std::vector<int64_t> slots(n);
    for (int i = 0; i < n; ++i) slots[i] = i;
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<ReadyRow> ready;
    for (int i = 0; i < n; ++i) {
      const bool decode = rng() % 2;
      ready.push_back({static_cast<uint64_t>(1000 + i), slots[i], static_cast<int64_t>(rng() % 30),
                       decode ? 0 : static_cast<int64_t>(1 + rng() % 50), ages[i]});
    }
    const auto rows = plan_step(ready, budget(active, d, max_rows, chunk));

    std::map<uint64_t, ReadyRow> by_sequence;
    std::vector<ReadyRow> decoders, prompts;
    for (const auto& r : ready) {
      by_sequence[r.sequence] = r;
      (r.remaining == 0 ? decoders : prompts).push_back(r);
    }
    const auto older = [](const ReadyRow& a, const ReadyRow& b) { return a.ready_since < b.ready_since; };
    std::sort(decoders.begin(), decoders.end(), older);
    std::sort(prompts.begin(), prompts.end(), older);
    const int64_t row_cap = std::clamp<int64_t>((active + d - 1) / d, 1, max_rows);

    if (ready.empty()) {
      EXPECT_TRUE(rows.empty());
      continue;
    }
    ASSERT_FALSE(rows.empty()) << "something is ready, so a step has a row";
    ASSERT_LE(static_cast<int64_t>(rows.size()), row_cap);
    std::set<uint64_t> seen;
    std::set<int64_t> seen_slots;
    size_t decode_rows = 0;
    int64_t prompt_tokens = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& row = rows[i];
      ASSERT_TRUE(by_sequence.count(row.sequence)) << "row of a sequence that was not ready: " << row.sequence;
      EXPECT_TRUE(seen.insert(row.sequence).second) << "sequence " << row.sequence << " twice";
      EXPECT_TRUE(seen_slots.insert(row.slot).second) << "slot " << row.slot << " twice";
      const ReadyRow& from = by_sequence[row.sequence];
      EXPECT_EQ(row.slot, from.slot);
      EXPECT_EQ(row.start, from.cached);
      if (from.remaining == 0) {
        EXPECT_EQ(decode_rows, i) << "a decode row after a prompt row";
        ++decode_rows;
        EXPECT_EQ(row.length, 1);
        EXPECT_TRUE(row.completes_prompt);
      } else {
        EXPECT_GE(row.length, 1);
        EXPECT_LE(row.length, from.remaining);
        EXPECT_EQ(row.completes_prompt, row.length == from.remaining);
        prompt_tokens += row.length;
      }
    }
    const size_t prompt_rows = rows.size() - decode_rows;
    // The oldest of each kind, in age order.
    for (size_t i = 0; i < decode_rows; ++i) EXPECT_EQ(rows[i].sequence, decoders[i].sequence);
    for (size_t i = 0; i < prompt_rows; ++i) EXPECT_EQ(rows[decode_rows + i].sequence, prompts[i].sequence);
    // Decode rows: as many as fit, less the one row a waiting prompt keeps when two or more fit.
    const int64_t reserve = !prompts.empty() && row_cap > 1 ? 1 : 0;
    EXPECT_EQ(static_cast<int64_t>(decode_rows),
              std::min<int64_t>(static_cast<int64_t>(decoders.size()), row_cap - reserve));
    // Prompt tokens within the chunk less the decode rows (at least one token); every prompt row but the last is
    // whole; a prompt left out means the rows or the tokens ran out.
    const int64_t prompt_budget = std::max<int64_t>(chunk - static_cast<int64_t>(decode_rows), 1);
    EXPECT_LE(prompt_tokens, prompt_budget);
    for (size_t i = 0; i + 1 < prompt_rows; ++i) EXPECT_TRUE(rows[decode_rows + i].completes_prompt);
    if (prompt_rows < prompts.size()) {
      EXPECT_TRUE(static_cast<int64_t>(rows.size()) == row_cap || prompt_tokens == prompt_budget)
          << "prompt " << prompts[prompt_rows].sequence << " left out with rows and tokens to spare";
    }
    if (prompt_rows > 0 && !rows.back().completes_prompt) {
      EXPECT_EQ(prompt_tokens, prompt_budget);
    }
  }
}

}  // namespace
}  // namespace libpipe::generate
