#include "runtime/generate/sampling.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "runtime/error.h"

namespace libpipe::generate {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Up to this k, one pass with a heap of the k best beats nth_element over an index array of the whole row.
constexpr int64_t kHeapLimit = 1024;
// top-p alone: the first candidate set, widened by kWiden until it holds the nucleus.
constexpr int64_t kFirstNucleus = 64;
constexpr int64_t kWiden = 4;

// Ranks a above b: the larger logit, or for equal logits the lower token (so the order is total and deterministic).
bool better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Cumulative walk over `n` weights: the first index whose running sum exceeds `target`; the last index with a
// positive weight if rounding leaves the sum short of it.
template <typename W>
int64_t walk(const W* w, int64_t n, double target) {
  double cum = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] <= 0) continue;
    cum += w[i];
    last = i;
    if (cum > target) return i;
  }
  return last;
}

}  // namespace

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(static_cast<float>(p.temperature)))
    throw Error(Status::InvalidArgument, "sampling: temperature is " + std::to_string(p.temperature) +
                                             "; it must be a finite number >= 0 (0 picks the most likely token)");
  if (p.top_k < 0)
    throw Error(Status::InvalidArgument,
                "sampling: top_k is " + std::to_string(p.top_k) + "; it must be >= 0 (0 keeps every token)");
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw Error(Status::InvalidArgument,
                "sampling: top_p is " + std::to_string(p.top_p) + "; it must be in (0, 1] (1 keeps every token)");
}

TokenRng::TokenRng(uint64_t seed) : seed_(seed), key_(mix64(seed ^ 0x5DEECE66Dull)) {}

double TokenRng::next_uniform() {
  ++draws_;
  const uint64_t z = mix64(key_ + draws_ * kGolden);
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

void Sampler::select_top(const float* logits, int64_t vocab, int64_t k) {
  k = std::min(k, vocab);
  candidates_.clear();
  if (k <= kHeapLimit) {
    // A heap whose top is the worst of the k best so far; tokens come in increasing order, so a later token enters
    // only with a strictly larger logit than the worst kept (ties keep the lower token).
    candidates_.reserve(static_cast<size_t>(k));
    for (int32_t i = 0; i < static_cast<int32_t>(k); ++i) {
      candidates_.emplace_back(logits[i], i);
      std::push_heap(candidates_.begin(), candidates_.end(), better);
    }
    float worst = candidates_.front().first;
    for (int64_t i = k; i < vocab; ++i) {
      if (!(logits[i] > worst)) continue;
      std::pop_heap(candidates_.begin(), candidates_.end(), better);
      candidates_.back() = {logits[i], static_cast<int32_t>(i)};
      std::push_heap(candidates_.begin(), candidates_.end(), better);
      worst = candidates_.front().first;
    }
  } else {
    order_.resize(static_cast<size_t>(vocab));
    std::iota(order_.begin(), order_.end(), 0);
    auto by_rank = [logits](int32_t a, int32_t b) { return better({logits[a], a}, {logits[b], b}); };
    if (k < vocab) std::nth_element(order_.begin(), order_.begin() + k, order_.end(), by_rank);
    candidates_.reserve(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) candidates_.emplace_back(logits[order_[i]], order_[i]);
  }
  std::sort(candidates_.begin(), candidates_.end(), better);
}

int64_t Sampler::pick_candidate(size_t n, double u) const {
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += weights_[i];
  return candidates_[static_cast<size_t>(walk(weights_.data(), static_cast<int64_t>(n), u * total))].second;
}

int64_t Sampler::sample_row(const float* logits, int64_t vocab, const SamplingParams& p, TokenRng& rng) {
  const double u = rng.next_uniform();  // one draw per token whatever the path, so draw n belongs to token n
  const bool greedy = p.temperature == 0 || static_cast<float>(p.temperature) == 0 || p.top_k == 1;

  // The largest logit (the first such token) and a NaN check, in one pass.
  float max = -std::numeric_limits<float>::infinity();
  int64_t argmax = 0;
  bool nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = logits[i];
    nan |= v != v;
    if (v > max) max = v, argmax = i;
  }
  if (nan) throw Error(Status::Execution, "sampling: the logits hold a NaN (the model's output is not a number)");
  if (greedy) return argmax;
  if (!std::isfinite(max))
    throw Error(Status::Execution, std::string("sampling: the largest logit is ") + (max > 0 ? "+inf" : "-inf") +
                                       ", so the token probabilities are undefined; sample greedily (temperature 0)"
                                       " or fix the model's output");

  const double t = p.temperature;
  const bool nucleus = p.top_p < 1;
  if (p.top_k > 0 && p.top_k < vocab) {
    select_top(logits, vocab, p.top_k);
    weights_.resize(candidates_.size());
    double total = 0;
    for (size_t i = 0; i < candidates_.size(); ++i) total += weights_[i] = std::exp((candidates_[i].first - max) / t);
    size_t n = candidates_.size();
    if (nucleus) {  // within the top k, renormalized
      const double bound = p.top_p * total;
      double before = 0;
      for (n = 0; n < candidates_.size() && before < bound; ++n) before += weights_[n];
    }
    return pick_candidate(n, u);
  }

  // Every token is a candidate: weights of the whole row. A plain loop rather than ATen ops: three dispatched ops
  // per row cost more than the arithmetic for small rows, and their intra-op threads contend with the stages'.
  row_weights_.resize(static_cast<size_t>(vocab));
  float* wp = row_weights_.data();
  const float tf = static_cast<float>(t);
  for (int64_t i = 0; i < vocab; ++i) wp[i] = std::exp((logits[i] - max) / tf);
  double total = 0;
  for (int64_t i = 0; i < vocab; ++i) total += wp[i];
  if (!nucleus) return walk(wp, vocab, u * total);

  // top-p alone: the nucleus is a prefix of the tokens in rank order; find it among the best k, widening k until
  // their mass reaches top_p of the row's (64, 256, 1024, then the whole row: a full sort).
  const double bound = p.top_p * total;
  // Past the heap's reach the whole row is sorted at once: one nth_element per widening would cost more.
  for (int64_t k = std::min(kFirstNucleus, vocab);;
       k = std::min(k * kWiden <= kHeapLimit ? k * kWiden : vocab, vocab)) {
    select_top(logits, vocab, k);
    weights_.resize(candidates_.size());
    double before = 0;
    size_t n = 0;
    for (; n < candidates_.size() && before < bound; ++n) before += weights_[n] = wp[candidates_[n].second];
    if (before >= bound || k == vocab) return pick_candidate(n, u);
  }
}

void Sampler::check_arguments(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                              const std::vector<TokenRng*>& rngs) {
  if (logits.dim() != 2 || logits.scalar_type() != at::kFloat)
    throw Error(Status::InvalidArgument,
                "sampling: the logits must be a float32 tensor [batch, vocab] (the decoder's"
                " result), got " +
                    std::string(c10::toString(logits.scalar_type())) + " of " + std::to_string(logits.dim()) +
                    " dimensions");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max())
    throw Error(Status::InvalidArgument,
                "sampling: the vocabulary has " + std::to_string(vocab) + " tokens; it must have 1 to 2^31-1");
  if (params.size() != static_cast<size_t>(rows) || rngs.size() != static_cast<size_t>(rows))
    throw Error(Status::InvalidArgument, "sampling: " + std::to_string(rows) + " rows of logits but " +
                                             std::to_string(params.size()) + " parameter sets and " +
                                             std::to_string(rngs.size()) + " generators; give one of each per row");
  for (int64_t b = 0; b < rows; ++b) {
    if (rngs[b] == nullptr)
      throw Error(Status::InvalidArgument, "sampling: row " + std::to_string(b) + " has no random generator");
    try {
      validate(params[b]);
    } catch (const Error& e) {
      throw Error(e.status(), std::string(e.what()) + " (row " + std::to_string(b) + ")");
    }
  }
}

int64_t Sampler::sample_host_row(const float* row, int64_t b, int64_t vocab, const SamplingParams& params,
                                 TokenRng& rng, std::vector<std::string>* row_errors) {
  try {
    return sample_row(row, vocab, params, rng);
  } catch (const Error& e) {
    std::string message = std::string(e.what()) + " (row " + std::to_string(b) + ")";
    if (row_errors == nullptr) throw Error(e.status(), message);
    (*row_errors)[b] = std::move(message);
    return -1;
  }
}

std::vector<int64_t> Sampler::sample(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                                     const std::vector<TokenRng*>& rngs, std::vector<std::string>* row_errors) {
  if (logits.defined() && !logits.device().is_cpu()) return sample_reducing_on_device(logits, params, rngs, row_errors);
  check_arguments(logits, params, rngs);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor cpu = logits.contiguous();
  const float* data = cpu.const_data_ptr<float>();
  std::vector<int64_t> tokens(static_cast<size_t>(rows));
  if (row_errors != nullptr) row_errors->assign(static_cast<size_t>(rows), std::string());
  for (int64_t b = 0; b < rows; ++b)
    tokens[b] = sample_host_row(data + b * vocab, b, vocab, params[b], *rngs[b], row_errors);
  return tokens;
}

std::vector<int64_t> Sampler::sample_reducing_on_device(const at::Tensor& logits,
                                                        const std::vector<SamplingParams>& params,
                                                        const std::vector<TokenRng*>& rngs,
                                                        std::vector<std::string>* row_errors) {
  check_arguments(logits, params, rngs);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  // Each row's largest logit and its first token (max propagates a NaN, as the host's pass reports one).
  const auto [max_values, max_tokens] = at::max(logits, 1);
  const at::Tensor values = max_values.to(at::kCPU), ids = max_tokens.to(at::kCPU);
  const float* value = values.const_data_ptr<float>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> tokens(static_cast<size_t>(rows), -1);
  if (row_errors != nullptr) row_errors->assign(static_cast<size_t>(rows), std::string());
  std::vector<int64_t> whole;  // rows that come back whole, in order
  for (int64_t b = 0; b < rows; ++b) {
    const SamplingParams& p = params[b];
    const bool greedy = p.temperature == 0 || static_cast<float>(p.temperature) == 0 || p.top_k == 1;
    if (greedy && std::isfinite(value[b])) {
      rngs[b]->next_uniform();  // the draw the host's pass takes for this token
      tokens[b] = id[b];
    } else {
      whole.push_back(b);
    }
  }
  if (whole.empty()) return tokens;
  const at::Tensor index = at::tensor(whole, at::TensorOptions().dtype(at::kLong)).to(logits.device());
  const at::Tensor host = logits.index_select(0, index).to(at::kCPU).contiguous();
  const float* data = host.const_data_ptr<float>();
  for (size_t i = 0; i < whole.size(); ++i) {
    const int64_t b = whole[i];
    tokens[b] = sample_host_row(data + static_cast<int64_t>(i) * vocab, b, vocab, params[b], *rngs[b], row_errors);
  }
  return tokens;
}

}  // namespace libpipe::generate
