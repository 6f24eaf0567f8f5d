// Sampling: the next token of each sequence from the logits of its last token (float32 [B, vocab], the decoder
// contract's result), with each sequence's own parameters and random state. Greedy (temperature 0), temperature,
// top-k and top-p (nucleus), applied in that order as Hugging Face's warpers do (top-p within the top-k renormalized).
//
// Reproducibility: every sequence owns a TokenRng seeded by its caller, which the sampler advances by exactly one
// draw per token it picks for that sequence (greedy rows included, so draw n always belongs to token n). A row's
// token therefore depends on its logits, its parameters and its own generator only: never on which other sequences
// share the batch or where the row sits in it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace libpipe::generate {

struct SamplingParams {
  double temperature = 0;  // 0: greedy (argmax); otherwise logits are divided by it before the softmax
  int64_t top_k = 0;       // keep the k most likely tokens; 0: off (1 is greedy)
  double top_p = 1;        // keep the smallest most-likely set whose probability reaches top_p; 1: off
};

// Throws Error(InvalidArgument) naming the field and its allowed range: temperature must be finite and >= 0, top_k
// >= 0, 0 < top_p <= 1.
void validate(const SamplingParams& params);

// A sequence's random numbers: counter-based (SplitMix64 over the seed and the number of draws so far), so the state
// is two integers, draw n is a pure function of (seed, n), and the same seed gives the same stream on every machine.
class TokenRng {
 public:
  explicit TokenRng(uint64_t seed = 0);
  // A uniform double in [0, 1) with 53 random bits; advances the stream by one.
  double next_uniform();
  uint64_t seed() const { return seed_; }
  uint64_t draws() const { return draws_; }

 private:
  uint64_t seed_;
  uint64_t key_;  // the seed mixed once, so that nearby seeds start far apart in the stream
  uint64_t draws_ = 0;
};

// Picks tokens. Holds scratch buffers reused from call to call (no allocation per step once they have grown to the
// vocabulary), so one Sampler serves one thread; sequences' state lives in their TokenRngs.
//
// Cost per row with vocabulary V: greedy one pass; temperature alone one exp pass and one cumulative walk
// (no sort); top-k a single pass keeping a heap of the k best (nth_element when k is large), then a sort of the k;
// top-p alone finds the nucleus among the 64, then 256, then 1024 most likely tokens (a heap pass each), and sorts the
// whole row only when the nucleus is larger than that (nearly flat distributions).
class Sampler {
 public:
  // One token per row of `logits` (float32 [B, vocab], any device; non-CPU or non-contiguous logits are copied).
  // params[b] and *rngs[b] belong to row b's sequence; each rngs[b] advances by one. Every row's parameters are
  // validated before any generator advances. Throws Error(InvalidArgument) for a wrong shape, dtype or list length,
  // a null generator or bad parameters (naming the row), and Error(Execution) for a row whose logits hold a NaN or
  // whose largest logit is not finite where it samples (+inf, or every logit -inf). With `row_errors`, such a row
  // gets token -1 and its message there instead (one string per row, empty where the row went well), so one
  // sequence's broken logits fail that sequence only; argument errors still throw.
  //
  // Logits on a GPU stay there: greedy rows are reduced on the device and only their largest logit and its token come
  // back ([B] each), where copying the rows would move [B, vocab] floats per step; a sampled row, or a greedy row
  // whose largest logit is not finite (a NaN, an infinity: the errors and ties of the host's pass), comes back whole.
  // The tokens, errors and generators' draws are those of the host's path.
  std::vector<int64_t> sample(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                              const std::vector<TokenRng*>& rngs, std::vector<std::string>* row_errors = nullptr);
  // sample()'s path for logits off the CPU, on logits anywhere (tests run it on the CPU). Same contract.
  std::vector<int64_t> sample_reducing_on_device(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                                                 const std::vector<TokenRng*>& rngs,
                                                 std::vector<std::string>* row_errors = nullptr);
  // One row of `vocab` logits; parameters already validated. Advances `rng` by one.
  int64_t sample_row(const float* logits, int64_t vocab, const SamplingParams& params, TokenRng& rng);

 private:
  using Candidate = std::pair<float, int32_t>;  // logit, token
  // The `k` largest logits of the row into candidates_, best first (ties: lower token first).
  void select_top(const float* logits, int64_t vocab, int64_t k);
  // Samples among candidates_[0, n) given their weights_ (exp of scaled logits), by the uniform draw `u`.
  int64_t pick_candidate(size_t n, double u) const;
  // Throws what sample() throws for its arguments.
  static void check_arguments(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                              const std::vector<TokenRng*>& rngs);
  // sample_row on row b of host logits [rows, vocab], its error into row_errors (or thrown).
  int64_t sample_host_row(const float* row, int64_t b, int64_t vocab, const SamplingParams& params, TokenRng& rng,
                          std::vector<std::string>* row_errors);

  std::vector<Candidate> candidates_;
  std::vector<int32_t> order_;      // token ids for nth_element when k is large
  std::vector<double> weights_;     // of candidates_
  std::vector<float> row_weights_;  // exp((logit - max) / T) of a whole row
};

}  // namespace libpipe::generate
