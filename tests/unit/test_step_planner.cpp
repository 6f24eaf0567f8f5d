// The step planner's rules (runtime/generate/step_planner.h), against hand-worked plans and, for random ready sets,
// against invariants computed independently from the rules: one kind of row per step, chosen by the oldest ready row
// (so prompts and decoding are served first come, first served and neither starves); decode steps take the oldest
// decode rows; prefill steps take the oldest prompts, padded to the oldest one's width (at most prefill_chunk), while
// rows x width fits in prefill_chunk; at most row_cap = clamp(ceil(active / D), 1, max_rows) rows, start = cached,
// never a sequence twice, completes_prompt exactly for decode rows and last chunks. Mixed steps (a decoder that skips
// padding): the oldest decode rows up to row_cap, then prompt chunks in the step's remaining token budget.
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

StepBudget mixed(int64_t active, int64_t d, int64_t max_rows, int64_t chunk) {
  return {active, d, max_rows, chunk, /*mixed=*/true};
}

std::vector<uint64_t> sequences(const std::vector<PlannedRow>& rows) {
  std::vector<uint64_t> out;
  for (const auto& r : rows) out.push_back(r.sequence);
  return out;
}

TEST(StepPlanner, NothingReadyPlansNothing) {
  EXPECT_TRUE(plan_step({}, budget(4, 2, 4, 256)).empty());
  EXPECT_TRUE(plan_step({}, budget(0, 1, 1, 1)).empty());
}

TEST(StepPlanner, TheOldestReadyRowDecidesTheKindOfTheStep) {
  // Given in neither age nor kind order; every row fits (row_cap 8, chunk 256). The oldest is decode row 13.
  std::vector<ReadyRow> ready = {
      prompt(10, 0, 0, 5, 7), decoding(11, 1, 9, 4), prompt(12, 2, 0, 3, 2),
      decoding(13, 3, 20, 1), decoding(14, 4, 6, 9), prompt(15, 5, 4, 2, 5),
  };
  auto rows = plan_step(ready, budget(8, 1, 8, 256));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{13, 11, 14}));
  for (const auto& row : rows) {
    EXPECT_EQ(row.length, 1);
    EXPECT_TRUE(row.completes_prompt);
  }
  EXPECT_EQ(rows[0].slot, 3);
  EXPECT_EQ(rows[0].start, 20);
  // Without it, prompt 12 is the oldest: the prompts, oldest first, padded to 12's width of 3 (15 fits whole, 10 is
  // cut to 3 tokens from its cached position).
  ready.erase(ready.begin() + 3);
  rows = plan_step(ready, budget(8, 1, 8, 256));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{12, 15, 10}));
  EXPECT_EQ(rows[0].length, 3);
  EXPECT_TRUE(rows[0].completes_prompt);
  EXPECT_EQ(rows[1].start, 4);
  EXPECT_EQ(rows[1].length, 2);
  EXPECT_TRUE(rows[1].completes_prompt);
  EXPECT_EQ(rows[2].start, 0);
  EXPECT_EQ(rows[2].length, 3);
  EXPECT_FALSE(rows[2].completes_prompt);
}

TEST(StepPlanner, PrefillRowsArePaddedToTheOldestPromptsWidthWithinTheChunk) {
  // chunk 16, the oldest prompt has 5 tokens left: width 5, so three rows fit (15 positions), a fourth would not
  // (20). Prompt 2 is cut to 5 tokens from its cached position 8; prompt 3 (1 token) fits whole.
  const std::vector<ReadyRow> ready = {prompt(1, 0, 0, 5, 1), prompt(2, 1, 8, 6, 2), prompt(3, 2, 0, 1, 3),
                                       prompt(4, 3, 0, 3, 4)};
  const auto rows = plan_step(ready, budget(8, 1, 8, 16));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(rows[0].length, 5);
  EXPECT_TRUE(rows[0].completes_prompt);
  EXPECT_EQ(rows[1].start, 8);
  EXPECT_EQ(rows[1].length, 5);
  EXPECT_FALSE(rows[1].completes_prompt);
  EXPECT_EQ(rows[2].length, 1);
  EXPECT_TRUE(rows[2].completes_prompt);
}

TEST(StepPlanner, APromptLongerThanTheChunkTakesTheStepAlone) {
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

TEST(StepPlanner, PrefillAndDecodeStepsTakeTurnsFirstComeFirstServed) {
  // A 20-token prompt ready first, two decoding sequences after it, chunk 8, one step at a time (each step's rows
  // are ready again after it, younger than everything that waited): prefill and decode steps alternate, so the
  // decoders never wait more than one chunk and the prompt never more than one decode step.
  ReadyRow p = prompt(3, 2, 0, 20, 0);
  ReadyRow d1 = decoding(1, 0, 10, 1), d2 = decoding(2, 1, 10, 2);
  std::vector<std::vector<uint64_t>> steps;
  for (uint64_t clock = 3; steps.size() < 5; ++clock) {
    const auto rows = plan_step({p, d1, d2}, budget(3, 1, 4, 8));
    ASSERT_FALSE(rows.empty());
    steps.push_back(sequences(rows));
    for (const auto& row : rows) {
      ReadyRow& r = row.sequence == 3 ? p : row.sequence == 1 ? d1 : d2;
      EXPECT_EQ(row.start, r.cached);
      r.cached += row.length;
      r.remaining -= row.sequence == 3 ? row.length : 0;
      r.ready_since = clock;
    }
  }
  EXPECT_EQ(steps, (std::vector<std::vector<uint64_t>>{{3}, {1, 2}, {3}, {1, 2}, {3}}));
  EXPECT_EQ(p.remaining, 0);  // 8 + 8 + 4: its last chunk gave its first token
  EXPECT_EQ(p.cached, 20);
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
  // row_cap 4: the four oldest of five short prompts (a prompt is the oldest ready row), not the decode row.
  const std::vector<ReadyRow> ready = {
      prompt(1, 0, 0, 2, 1), prompt(2, 1, 0, 2, 2), prompt(3, 2, 0, 2, 3),
      prompt(4, 3, 0, 2, 4), prompt(5, 4, 0, 2, 5), decoding(6, 5, 3, 9),
  };
  EXPECT_EQ(sequences(plan_step(ready, budget(4, 1, 8, 256))), (std::vector<uint64_t>{1, 2, 3, 4}));
}

// ---- liveness: neither kind starves the other ----

TEST(StepPlanner, AWaitingPromptGoesBeforeDecodeRowsThatReturnedAfterIt) {
  // The prompt became ready at 4: decode rows ready since 5 and 6 wait behind it; rows ready since 1 and 2 go first.
  const auto later =
      plan_step({decoding(1, 0, 5, 5), decoding(2, 1, 5, 6), prompt(4, 3, 0, 6, 4)}, budget(4, 2, 4, 256));
  ASSERT_EQ(sequences(later), (std::vector<uint64_t>{4}));
  EXPECT_EQ(later[0].length, 6);
  EXPECT_TRUE(later[0].completes_prompt);
  const auto earlier =
      plan_step({decoding(1, 0, 5, 1), decoding(2, 1, 5, 2), prompt(4, 3, 0, 6, 4)}, budget(4, 2, 4, 256));
  EXPECT_EQ(sequences(earlier), (std::vector<uint64_t>{1, 2}));
}

// ---- random ready sets against the rules' invariants ----

TEST(StepPlanner, APromptAloneIsCutIntoChunksThatFillThePipeline) {
  // One sequence, two steps in flight: 128 tokens go as 64 + 64, so that both stages work on the prompt at once.
  auto rows = plan_step({prompt(1, 0, 0, 128, 1)}, budget(1, 2, 4, 256));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].length, 64);
  EXPECT_FALSE(rows[0].completes_prompt);
  // Its rest (the engine passes cached = what was handed to steps): no chunk shorter than kMinPipelinedChunk.
  rows = plan_step({prompt(1, 0, 64, 100, 1)}, budget(1, 2, 4, 256));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].start, 64);
  EXPECT_EQ(rows[0].length, 64);
  rows = plan_step({prompt(1, 0, 128, 36, 1)}, budget(1, 2, 4, 256));
  EXPECT_EQ(rows[0].length, 36);
  EXPECT_TRUE(rows[0].completes_prompt);
  // Four stages: a quarter, within the chunk.
  EXPECT_EQ(plan_step({prompt(1, 0, 0, 512, 1)}, budget(1, 4, 4, 1000))[0].length, 128);
  EXPECT_EQ(plan_step({prompt(1, 0, 0, 2048, 1)}, budget(1, 4, 4, 256))[0].length, 256);
  // As many sequences as steps in flight fill the pipeline themselves: the prompt stays whole.
  EXPECT_EQ(plan_step({prompt(1, 0, 0, 128, 1)}, budget(2, 2, 4, 256))[0].length, 128);
}

TEST(StepPlanner, RandomReadySetsFollowEveryRule) {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 3000; ++trial) {
    SCOPED_TRACE(trial);
    const int n = static_cast<int>(rng() % 12);
    const int64_t d = 1 + rng() % 4, max_rows = 1 + rng() % 10, chunk = 1 + rng() % 300;
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
                       decode ? 0 : static_cast<int64_t>(1 + rng() % 200), ages[i]});
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
    for (const auto& row : rows) {
      ASSERT_TRUE(by_sequence.count(row.sequence)) << "row of a sequence that was not ready: " << row.sequence;
      EXPECT_TRUE(seen.insert(row.sequence).second) << "sequence " << row.sequence << " twice";
      EXPECT_TRUE(seen_slots.insert(row.slot).second) << "slot " << row.slot << " twice";
      EXPECT_EQ(row.slot, by_sequence[row.sequence].slot);
      EXPECT_EQ(row.start, by_sequence[row.sequence].cached);
    }
    // The oldest ready row decides the kind; the step takes the oldest rows of that kind, in age order.
    const ReadyRow oldest = *std::min_element(ready.begin(), ready.end(), older);
    const std::vector<ReadyRow>& kind = oldest.remaining == 0 ? decoders : prompts;
    ASSERT_LE(rows.size(), kind.size());
    for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i].sequence, kind[i].sequence) << "row " << i;
    if (oldest.remaining == 0) {
      for (const auto& row : rows) {
        EXPECT_EQ(row.length, 1);
        EXPECT_TRUE(row.completes_prompt);
      }
      EXPECT_EQ(static_cast<int64_t>(rows.size()), std::min<int64_t>(static_cast<int64_t>(kind.size()), row_cap));
      continue;
    }
    // Prefill: the oldest prompt's width (at most the chunk; with fewer sequences than steps in flight, a D-th of it
    // but no less than kMinPipelinedChunk); every row cut to it; rows x width within the chunk; a prompt left out
    // means the rows ran out or one more row would not fit.
    int64_t width = std::min<int64_t>(kind[0].remaining, chunk);
    if (active < d) width = std::min(width, std::max(kMinPipelinedChunk, (kind[0].remaining + d - 1) / d));
    for (const auto& row : rows) {
      const ReadyRow& from = by_sequence[row.sequence];
      EXPECT_EQ(row.length, std::min(from.remaining, width));
      EXPECT_EQ(row.completes_prompt, row.length == from.remaining);
    }
    EXPECT_LE(static_cast<int64_t>(rows.size()) * width, chunk);
    if (rows.size() < kind.size()) {
      EXPECT_TRUE(static_cast<int64_t>(rows.size()) == row_cap ||
                  (static_cast<int64_t>(rows.size()) + 1) * width > chunk)
          << "prompt " << kind[rows.size()].sequence << " left out with rows and positions to spare";
    }
  }
}

// ---- mixed steps (a decoder that skips padding) ----

TEST(StepPlanner, MixedStepsTakeTheDecodeRowsFirstThenPromptChunksWithinTheTokenBudget) {
  // A prompt older than every decode row still rides behind them: the 3 decode rows (oldest first), then the oldest
  // prompt whole (77 of the 80 tokens are left, it has 50), then the next prompt cut to what is left (27 of its 30),
  // from its cached position.
  const std::vector<ReadyRow> ready = {
      prompt(10, 0, 0, 50, 1), decoding(11, 1, 9, 4), prompt(12, 2, 5, 30, 2),
      decoding(13, 3, 20, 3),  decoding(14, 4, 6, 9),
  };
  const auto rows = plan_step(ready, mixed(8, 2, 8, 80));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{13, 11, 14, 10, 12}));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(rows[i].length, 1);
  EXPECT_EQ(rows[3].length, 50);
  EXPECT_TRUE(rows[3].completes_prompt);
  EXPECT_EQ(rows[4].start, 5);
  EXPECT_EQ(rows[4].length, 27);
  EXPECT_FALSE(rows[4].completes_prompt);
}

TEST(StepPlanner, MixedStepsGiveEachPromptWhatTheBudgetStillHolds) {
  // The oldest prompt has 2 tokens left: the prompts behind it are not cut to its width (nothing is padded), each
  // takes what the budget still holds. 2 decode rows, budget 100: 2, then 60 (whole), then 36 of 90.
  const std::vector<ReadyRow> ready = {
      decoding(1, 1, 9, 1),     decoding(2, 2, 9, 2),     prompt(10, 10, 126, 2, 3),
      prompt(11, 11, 0, 60, 4), prompt(12, 12, 0, 90, 5),
  };
  const auto rows = plan_step(ready, mixed(5, 1, 8, 100));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{1, 2, 10, 11, 12}));
  EXPECT_EQ(rows[2].length, 2);
  EXPECT_TRUE(rows[2].completes_prompt);
  EXPECT_EQ(rows[3].length, 60);
  EXPECT_TRUE(rows[3].completes_prompt);
  EXPECT_EQ(rows[4].length, 36);
  EXPECT_FALSE(rows[4].completes_prompt);
}

TEST(StepPlanner, MixedStepsKeepTheRowCapForDecodeRowsAndNeverStarveAPrompt) {
  // 6 decode rows, row_cap 3 (active 6, D 2): the 3 oldest. The budget (2 tokens) is below the decode rows' own
  // tokens, yet the waiting prompt still gets min(budget, kMinPipelinedChunk) tokens: 2.
  std::vector<ReadyRow> ready;
  for (uint64_t s = 0; s < 6; ++s) ready.push_back(decoding(s, static_cast<int64_t>(s), 10, 10 + s));
  ready.push_back(prompt(9, 9, 0, 100, 1));
  auto rows = plan_step(ready, mixed(6, 2, 16, 2));
  ASSERT_EQ(sequences(rows), (std::vector<uint64_t>{0, 1, 2, 9}));
  EXPECT_EQ(rows[3].length, 2);
  // With a budget of 300, the prompt takes at least kMinPipelinedChunk even beside more decode tokens than that.
  ready.clear();
  for (uint64_t s = 0; s < 300; ++s) ready.push_back(decoding(s, static_cast<int64_t>(s), 10, 10 + s));
  ready.push_back(prompt(999, 999, 0, 1000, 1));
  rows = plan_step(ready, mixed(300, 1, 400, 300));
  ASSERT_EQ(rows.size(), 301u);
  EXPECT_EQ(rows.back().sequence, 999u);
  EXPECT_EQ(rows.back().length, kMinPipelinedChunk);
}

TEST(StepPlanner, MixedStepsSpreadALongPromptOverTheStepsInFlight) {
  // Two groups decode (4 + 3 rows, D = 2) when a 500-token prompt arrives, budget 128: the step of each group takes
  // its decode rows and a chunk of the prompt (the chunk may follow the previous one into the pipeline), so both
  // steps in flight carry 128 tokens and neither stage waits for the other.
  ReadyRow p = prompt(100, 7, 0, 500, 0);
  std::vector<ReadyRow> group_a, group_b;
  for (uint64_t s = 0; s < 4; ++s) group_a.push_back(decoding(s, static_cast<int64_t>(s), 10, 1));
  for (uint64_t s = 4; s < 7; ++s) group_b.push_back(decoding(s, static_cast<int64_t>(s), 10, 2));
  std::vector<int64_t> tokens_per_step;
  for (int step = 0; step < 4; ++step) {
    std::vector<ReadyRow> ready = step % 2 == 0 ? group_a : group_b;
    ready.push_back(p);
    const auto rows = plan_step(ready, mixed(8, 2, 8, 128));
    int64_t tokens = 0;
    for (const auto& r : rows) {
      tokens += r.length;
      if (r.sequence == 100) {
        EXPECT_EQ(r.start, p.cached);
        p.cached += r.length;
        p.remaining -= r.length;
      }
    }
    tokens_per_step.push_back(tokens);
  }
  EXPECT_EQ(tokens_per_step, (std::vector<int64_t>{128, 128, 128, 128}));
  EXPECT_EQ(p.cached, 124 + 125 + 124 + 125);
}

TEST(StepPlanner, RandomReadySetsFollowEveryRuleOfMixedSteps) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 3000; ++trial) {
    SCOPED_TRACE(trial);
    const int n = static_cast<int>(rng() % 12);
    const int64_t d = 1 + rng() % 4, max_rows = 1 + rng() % 12, chunk = 1 + rng() % 300;
    const int64_t active = n + static_cast<int64_t>(rng() % 6);
    std::vector<ReadyRow> ready;
    for (int i = 0; i < n; ++i) {
      const bool decode = rng() % 2;
      ready.push_back({static_cast<uint64_t>(1000 + i), i, static_cast<int64_t>(rng() % 30),
                       decode ? 0 : static_cast<int64_t>(1 + rng() % 200),
                       static_cast<uint64_t>(rng() % 1000) * 16 + i});
    }
    std::shuffle(ready.begin(), ready.end(), rng);
    const auto rows = plan_step(ready, mixed(active, d, max_rows, chunk));
    if (ready.empty()) {
      EXPECT_TRUE(rows.empty());
      continue;
    }
    ASSERT_FALSE(rows.empty());
    std::vector<ReadyRow> decoders, prompts;
    std::map<uint64_t, ReadyRow> by_sequence;
    for (const auto& r : ready) {
      by_sequence[r.sequence] = r;
      (r.remaining == 0 ? decoders : prompts).push_back(r);
    }
    const auto older = [](const ReadyRow& a, const ReadyRow& b) { return a.ready_since < b.ready_since; };
    std::sort(decoders.begin(), decoders.end(), older);
    std::sort(prompts.begin(), prompts.end(), older);
    const int64_t row_cap = std::clamp<int64_t>((active + d - 1) / d, 1, max_rows);
    // The oldest decode rows up to row_cap, then the oldest prompts.
    const size_t decode_rows = std::min<size_t>(decoders.size(), static_cast<size_t>(row_cap));
    ASSERT_GE(rows.size(), decode_rows);
    std::set<uint64_t> seen;
    for (size_t i = 0; i < rows.size(); ++i) {
      const PlannedRow& row = rows[i];
      EXPECT_TRUE(seen.insert(row.sequence).second);
      EXPECT_EQ(row.start, by_sequence[row.sequence].cached);
      if (i < decode_rows) {
        EXPECT_EQ(row.sequence, decoders[i].sequence);
        EXPECT_EQ(row.length, 1);
        EXPECT_TRUE(row.completes_prompt);
      } else {
        ASSERT_LT(i - decode_rows, prompts.size());
        EXPECT_EQ(row.sequence, prompts[i - decode_rows].sequence);
        EXPECT_GE(row.length, 1);
        EXPECT_LE(row.length, by_sequence[row.sequence].remaining);
        EXPECT_EQ(row.completes_prompt, row.length == by_sequence[row.sequence].remaining);
      }
    }
    EXPECT_LE(static_cast<int64_t>(rows.size()), std::max<int64_t>(max_rows, static_cast<int64_t>(decode_rows)));
    int64_t prompt_tokens = 0;
    const int64_t room =
        std::max<int64_t>(chunk - static_cast<int64_t>(decode_rows), std::min<int64_t>(chunk, kMinPipelinedChunk));
    // Each prompt row as long as the budget left holds (with fewer sequences than steps in flight, at most its share
    // of the pipeline: kMinPipelinedChunk or more).
    for (size_t i = decode_rows; i < rows.size(); ++i) {
      const int64_t remaining = by_sequence[rows[i].sequence].remaining;
      int64_t expected = std::min(remaining, room - prompt_tokens);
      if (active < d) expected = std::min(expected, std::max(kMinPipelinedChunk, (remaining + d - 1) / d));
      EXPECT_EQ(rows[i].length, expected);
      prompt_tokens += rows[i].length;
    }
    EXPECT_LE(prompt_tokens, room);
    // A waiting prompt left out: the rows ran out or the budget did.
    if (rows.size() - decode_rows < prompts.size()) {
      EXPECT_TRUE(static_cast<int64_t>(rows.size()) >= max_rows || prompt_tokens == room)
          << "a prompt left out with rows and tokens to spare";
    }
  }
}

}  // namespace
}  // namespace libpipe::generate
