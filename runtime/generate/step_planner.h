// Step planning: which sequences go into the next step and with how many tokens each. A pure function over a
// snapshot of the ready sequences, so the batching rules are unit-tested without threads or a model.
//
// Rules (docs/DESIGN.md, "Generation"): at most row_cap decode rows, where row_cap = clamp(ceil(active /
// steps_in_flight), 1, max_rows), so that the active sequences spread over the steps in flight instead of one step
// taking everyone and the other stages idling. Prompts are cut into chunks within the step's token budget
// (prefill_chunk), and the next chunk of a cut prompt starts where this one ends (start = cached) and may follow it
// into the pipeline at once. With fewer sequences than steps in flight, a prompt is cut into steps_in_flight chunks of
// at least kMinPipelinedChunk tokens, so that a lone prompt keeps every stage busy.
//
// How a step mixes them depends on what a padded row costs the decoder:
// - mixed (a decoder that skips padding, DecoderInfo::skips_padding): every step takes the ready decode rows
//   first, then fills its token budget with prompt chunks, oldest first, each as long as the budget left holds (at
//   least kMinPipelinedChunk prompt tokens in all, so prompts never starve behind decode rows). Decode rows never wait
//   behind a prompt, and while prompts are waiting every step carries about the same work, so the steps in flight cost
//   the same and no stage waits for another.
// - one kind of row per step (a decoder that computes B x T): the oldest ready row decides whether it is a decode
//   step (the oldest decode rows) or a prefill step (the oldest prompt sets the padded width, its remaining tokens
//   within prefill_chunk, and later prompts join cut to it while rows x width fits), first come, first served, so
//   neither starves.
#pragma once

#include <cstdint>
#include <vector>

namespace libpipe::generate {

// A sequence that is in no step and has input to give.
struct ReadyRow {
  uint64_t sequence = 0;  // the engine's id, passed through
  int64_t slot = 0;
  int64_t cached = 0;        // tokens already in the cache or on their way: the next row's start
  int64_t remaining = 0;     // prompt tokens not yet prefilled; 0 for a decoding sequence (its next input is 1 token)
  uint64_t ready_since = 0;  // ordering: smaller goes first (the engine's step counter when it became ready)
};

struct PlannedRow {
  uint64_t sequence = 0;
  int64_t slot = 0;
  int64_t start = 0;
  int64_t length = 0;             // tokens this row carries
  bool completes_prompt = false;  // its logits give a token: a decode row, or a prompt's last chunk
};

// The shortest chunk a lone prompt is cut into for pipelining: from 64 rows on, a linear layer costs about the
// same per row as with 128 (bench/linear_gemm, bench/RESULTS.md); fewer rows cost more each.
constexpr int64_t kMinPipelinedChunk = 64;

struct StepBudget {
  int64_t active = 0;           // sequences holding a slot (ready or in flight)
  int64_t steps_in_flight = 1;  // D
  int64_t max_rows = 1;         // rows per step at most
  int64_t prefill_chunk = 256;  // tokens per step, all rows together (mixed: decode rows included)
  bool mixed = false;           // decode rows and prompt chunks share steps (a decoder that skips padding)
};

// The rows of the next step (empty when `ready` is empty). Never takes a sequence twice.
std::vector<PlannedRow> plan_step(const std::vector<ReadyRow>& ready, const StepBudget& budget);

}  // namespace libpipe::generate
