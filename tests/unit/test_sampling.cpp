// Sampling (runtime/generate/sampling): each rule against a reference computed here independently, with ATen or
// plain double arithmetic: argmax, the k largest logits, the nucleus by a full sort of softmax in double, and the
// softmax distribution itself. Every generator is seeded, so the statistical checks are deterministic; their bounds
// are many standard deviations wide, so they hold for any seed and fail only for a wrong distribution.
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/generate/sampling.h"

namespace libpipe::generate {
namespace {

at::Tensor random_logits(int64_t rows, int64_t vocab, double scale, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn({rows, vocab}, gen, at::kFloat) * scale;
}

// Draws one token per row for `steps` steps; out[b] is row b's sequence.
std::vector<std::vector<int64_t>> draw(Sampler& sampler, const at::Tensor& logits,
                                       const std::vector<SamplingParams>& params, std::vector<TokenRng>& rngs,
                                       int steps) {
  std::vector<TokenRng*> ptrs;
  for (auto& r : rngs) ptrs.push_back(&r);
  std::vector<std::vector<int64_t>> out(params.size());
  for (int s = 0; s < steps; ++s) {
    const auto tokens = sampler.sample(logits, params, ptrs);
    for (size_t b = 0; b < tokens.size(); ++b) out[b].push_back(tokens[b]);
  }
  return out;
}

// softmax(logits / t) of one row in double.
std::vector<double> softmax(const float* logits, int64_t vocab, double t) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) max = std::max(max, static_cast<double>(logits[i]));
  std::vector<double> p(static_cast<size_t>(vocab));
  double total = 0;
  for (int64_t i = 0; i < vocab; ++i) total += p[i] = std::exp((logits[i] - max) / t);
  for (auto& x : p) x /= total;
  return p;
}

// Tokens by decreasing probability (ties: lower token first).
std::vector<int64_t> ranked(const std::vector<double>& p) {
  std::vector<int64_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  return order;
}

// The nucleus: the shortest prefix of the ranked tokens whose probability reaches top_p. `slack` widens it by the
// tokens whose preceding mass is within slack of top_p, so that a rounding difference at the boundary cannot decide.
std::set<int64_t> nucleus(const std::vector<double>& p, double top_p, double slack) {
  std::set<int64_t> kept;
  double before = 0;
  for (int64_t token : ranked(p)) {
    if (before >= top_p + slack) break;
    kept.insert(token);
    before += p[token];
  }
  return kept;
}

TEST(Sampling, GreedyEqualsArgmax) {
  const at::Tensor logits = random_logits(16, 50000, 3.0, 1);
  const std::vector<SamplingParams> params(16);  // temperature 0
  std::vector<TokenRng> rngs(16);
  Sampler sampler;
  const auto tokens = draw(sampler, logits, params, rngs, 1);
  const at::Tensor expected = logits.argmax(1);
  for (int64_t b = 0; b < 16; ++b) EXPECT_EQ(tokens[b][0], expected[b].item<int64_t>()) << "row " << b;
}

// Greedy picks the first of the largest logits (torch's argmax does too) wherever they lie in the row: in the part the
// sampler scans in lanes of 16 or in the tail past the last whole lane (a vocabulary of 1007), tied across lanes or
// across the two parts, a row of equal logits, -0 and +0 as the largest; a NaN anywhere fails its row.
TEST(Sampling, GreedyTakesTheFirstLargestLogitWhereverItLies) {
  at::Tensor logits = random_logits(7, 1007, 1.0, 11);
  logits[0][500] = 10.f;
  logits[0][37] = 10.f;
  logits[1][1003] = 10.f;
  logits[2][1000] = 10.f;
  logits[2][999] = 10.f;
  logits[3].fill_(0.f);
  logits[4].fill_(-1.f);
  logits[4][5] = -0.f;
  logits[4][3] = 0.f;
  logits[5][1005] = std::numeric_limits<float>::quiet_NaN();
  logits[6][20] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<SamplingParams> params(7);  // temperature 0
  std::vector<TokenRng> rngs(7);
  std::vector<TokenRng*> rng_ptrs;
  for (TokenRng& r : rngs) rng_ptrs.push_back(&r);
  Sampler sampler;
  std::vector<std::string> errors;
  const auto tokens = sampler.sample(logits, params, rng_ptrs, &errors);
  const at::Tensor expected = logits.narrow(0, 0, 5).argmax(1);
  for (int64_t b = 0; b < 5; ++b) {
    EXPECT_EQ(errors[b], "") << "row " << b;
    EXPECT_EQ(tokens[b], expected[b].item<int64_t>()) << "row " << b;
  }
  EXPECT_EQ(tokens[0], 37);
  EXPECT_EQ(tokens[3], 0);
  EXPECT_EQ(tokens[4], 3);
  for (int64_t b : {5, 6}) {
    EXPECT_EQ(tokens[b], -1) << "row " << b;
    EXPECT_NE(errors[b].find("NaN"), std::string::npos) << errors[b];
  }
}

TEST(Sampling, TopKOneEqualsGreedy) {
  const at::Tensor logits = random_logits(8, 50000, 3.0, 2);
  std::vector<SamplingParams> params(8, SamplingParams{1.5, 1, 1.0});
  params[3].top_p = 0.5;
  std::vector<TokenRng> rngs;
  for (uint64_t s = 0; s < 8; ++s) rngs.emplace_back(s);
  Sampler sampler;
  const auto tokens = draw(sampler, logits, params, rngs, 5);
  const at::Tensor expected = logits.argmax(1);
  for (int64_t b = 0; b < 8; ++b)
    for (int64_t t : tokens[b]) EXPECT_EQ(t, expected[b].item<int64_t>()) << "row " << b;
}

// One setting of each kind per row, so every path of the sampler is covered.
std::vector<SamplingParams> mixed_params() {
  return {{0.0, 0, 1.0},  {1.0, 0, 1.0},    {0.8, 40, 1.0}, {1.2, 0, 0.9},
          {1.0, 50, 0.8}, {2.0, 2000, 1.0}, {1.0, 0, 0.3},  {0.5, 5, 1.0}};
}

TEST(Sampling, SeedReproducesTokensWhateverTheBatch) {
  const auto params = mixed_params();
  const int64_t rows = static_cast<int64_t>(params.size());
  const at::Tensor logits = random_logits(rows, 32000, 2.0, 3);
  auto seeded = [&] {
    std::vector<TokenRng> rngs;
    for (int64_t b = 0; b < rows; ++b) rngs.emplace_back(1000 + b);
    return rngs;
  };
  Sampler sampler;
  auto rngs = seeded();
  const auto first = draw(sampler, logits, params, rngs, 30);
  rngs = seeded();
  EXPECT_EQ(draw(sampler, logits, params, rngs, 30), first) << "same seeds, same batch";
  for (int64_t b = 0; b < rows; ++b) EXPECT_EQ(rngs[b].draws(), 30u) << "one draw per token";

  // Each row alone, with a fresh sampler.
  for (int64_t b = 0; b < rows; ++b) {
    Sampler alone;
    std::vector<TokenRng> one{TokenRng(1000 + b)};
    EXPECT_EQ(draw(alone, logits.narrow(0, b, 1), {params[b]}, one, 30)[0], first[b]) << "row " << b << " alone";
  }

  // The rows reversed, next to rows of other sequences.
  const at::Tensor other = random_logits(3, 32000, 2.0, 4);
  std::vector<int64_t> index;
  std::vector<SamplingParams> shuffled;
  std::vector<TokenRng> shuffled_rngs;
  for (int64_t i = 0; i < 3; ++i) {
    index.push_back(rows + i);
    shuffled.push_back({1.0, 0, 1.0});
    shuffled_rngs.emplace_back(7 + i);
  }
  for (int64_t b = rows - 1; b >= 0; --b) {
    index.push_back(b);
    shuffled.push_back(params[b]);
    shuffled_rngs.emplace_back(1000 + b);
  }
  const at::Tensor batch = at::cat({logits, other}).index_select(0, at::tensor(index));
  const auto again = draw(sampler, batch, shuffled, shuffled_rngs, 30);
  for (int64_t b = 0; b < rows; ++b) EXPECT_EQ(again[3 + (rows - 1 - b)], first[b]) << "row " << b << " moved";

  // And the seed matters: another seed gives another sequence where the row samples.
  std::vector<TokenRng> other_seed{TokenRng(999)};
  EXPECT_NE(draw(sampler, logits.narrow(0, 1, 1), {params[1]}, other_seed, 30)[0], first[1]);
}

TEST(Sampling, TopKNeverPicksOutsideTheKLargest) {
  const int64_t vocab = 50000;
  const at::Tensor logits = random_logits(1, vocab, 1.0, 5);
  const float* row = logits.const_data_ptr<float>();
  Sampler sampler;
  for (int64_t k : {2, 40, 1500}) {  // 1500: the nth_element path
    const float kth = std::get<0>(logits[0].topk(k)).min().item<float>();
    TokenRng rng(k);
    std::set<int64_t> seen;
    for (int i = 0; i < 4000; ++i) {
      const int64_t token = sampler.sample_row(row, vocab, {3.0, k, 1.0}, rng);
      ASSERT_GE(row[token], kth) << "k " << k << ": token " << token << " is not among the k largest";
      seen.insert(token);
    }
    // A high temperature spreads the draws over the k, so the test also sees the filter is not narrower than k.
    if (k <= 40) {
      EXPECT_EQ(static_cast<int64_t>(seen.size()), k);
    } else {
      EXPECT_GT(seen.size(), 1000u) << "k " << k;
    }
  }
}

TEST(Sampling, TopPNeverPicksOutsideTheNucleus) {
  Sampler sampler;
  struct Case {
    int64_t vocab;
    double scale, temperature, top_p;
    int64_t top_k;
  };
  // A peaked row (nucleus within the first candidates), a flat one (the candidate set widens to most of the row),
  // and top-p inside a top-k.
  for (const Case& c : {Case{50000, 4.0, 1.0, 0.9, 0}, Case{5000, 0.3, 1.0, 0.5, 0}, Case{50000, 2.0, 1.5, 0.7, 100},
                        Case{1000, 1.0, 0.7, 0.95, 0}}) {
    const at::Tensor logits = random_logits(1, c.vocab, c.scale, 6 + c.vocab);
    const float* row = logits.const_data_ptr<float>();
    std::vector<double> p = softmax(row, c.vocab, c.temperature);
    if (c.top_k > 0) {  // renormalize over the k most likely, as the nucleus is taken within them
      std::vector<double> kept(p.size(), 0.0);
      const auto order = ranked(p);
      double mass = 0;
      for (int64_t i = 0; i < c.top_k; ++i) mass += p[order[i]];
      for (int64_t i = 0; i < c.top_k; ++i) kept[order[i]] = p[order[i]] / mass;
      p = kept;
    }
    const std::set<int64_t> allowed = nucleus(p, c.top_p, 1e-6);
    const std::set<int64_t> core = nucleus(p, c.top_p, -1e-6);
    TokenRng rng(c.vocab);
    std::set<int64_t> seen;
    for (int i = 0; i < 3000; ++i) {
      const int64_t token = sampler.sample_row(row, c.vocab, {c.temperature, c.top_k, c.top_p}, rng);
      ASSERT_TRUE(allowed.count(token)) << "vocab " << c.vocab << ": token " << token << " is outside the nucleus of "
                                        << allowed.size();
      seen.insert(token);
    }
    EXPECT_GT(core.size(), 1u) << "the case must leave a choice";
    if (core.size() <= 50) {  // small nuclei are covered entirely by 3000 draws
      for (int64_t token : core) EXPECT_TRUE(seen.count(token)) << "vocab " << c.vocab << ": never drew " << token;
    }
  }
}

// Empirical frequencies over many seeded draws against the exact distribution: the largest difference stays under
// 0.01 (its standard deviation is at most sqrt(0.25 / draws) = 0.0011 here), and Pearson's chi-square statistic
// under its mean plus 6 standard deviations.
void expect_distribution(const std::vector<int64_t>& counts, const std::vector<double>& p, int draws) {
  double max_diff = 0, chi2 = 0;
  int64_t cells = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double freq = static_cast<double>(counts[i]) / draws;
    max_diff = std::max(max_diff, std::abs(freq - p[i]));
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double expected = p[i] * draws;
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++cells;
  }
  EXPECT_LT(max_diff, 0.01);
  const double dof = static_cast<double>(cells - 1);
  EXPECT_LT(chi2, dof + 6 * std::sqrt(2 * dof)) << cells << " cells";
}

TEST(Sampling, TemperatureFollowsTheSoftmax) {
  const int64_t vocab = 20;
  const int draws = 200000;
  const at::Tensor logits = random_logits(1, vocab, 1.5, 7);
  const float* row = logits.const_data_ptr<float>();
  Sampler sampler;
  for (double t : {0.7, 1.0, 2.5}) {
    TokenRng rng(static_cast<uint64_t>(t * 10));
    std::vector<int64_t> counts(vocab, 0);
    for (int i = 0; i < draws; ++i) ++counts[sampler.sample_row(row, vocab, {t, 0, 1.0}, rng)];
    SCOPED_TRACE("temperature " + std::to_string(t));
    expect_distribution(counts, softmax(row, vocab, t), draws);
  }
  // top-k: the softmax of the k largest, renormalized.
  const int64_t k = 6;
  std::vector<double> p = softmax(row, vocab, 1.0);
  const auto order = ranked(p);
  std::vector<double> top(p.size(), 0.0);
  double mass = 0;
  for (int64_t i = 0; i < k; ++i) mass += p[order[i]];
  for (int64_t i = 0; i < k; ++i) top[order[i]] = p[order[i]] / mass;
  TokenRng rng(11);
  std::vector<int64_t> counts(vocab, 0);
  for (int i = 0; i < draws; ++i) ++counts[sampler.sample_row(row, vocab, {1.0, k, 1.0}, rng)];
  SCOPED_TRACE("top-k 6");
  expect_distribution(counts, top, draws);
}

TEST(Sampling, BadParametersAreRefused) {
  struct Bad {
    SamplingParams params;
    const char* field;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const Bad& bad :
       {Bad{{-0.5, 0, 1.0}, "temperature"}, Bad{{nan, 0, 1.0}, "temperature"}, Bad{{inf, 0, 1.0}, "temperature"},
        Bad{{1e300, 0, 1.0}, "temperature"}, Bad{{1.0, -1, 1.0}, "top_k"}, Bad{{1.0, 0, 0.0}, "top_p"},
        Bad{{1.0, 0, 1.5}, "top_p"}, Bad{{1.0, 0, -0.1}, "top_p"}, Bad{{1.0, 0, nan}, "top_p"}}) {
    // Row 0 is fine and row 1 is bad: the call is refused before row 0's generator moves.
    const at::Tensor logits = random_logits(2, 100, 1.0, 8);
    TokenRng good(1), other(2);
    Sampler sampler;
    try {
      sampler.sample(logits, {SamplingParams{1.0, 0, 1.0}, bad.params}, {&good, &other});
      ADD_FAILURE() << bad.field << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument);
      const std::string what = e.what();
      EXPECT_NE(what.find(bad.field), std::string::npos) << what;
      EXPECT_NE(what.find("row 1"), std::string::npos) << what;
    }
    EXPECT_EQ(good.draws(), 0u) << bad.field;
  }
  EXPECT_NO_THROW(validate({0.0, 0, 1.0}));
  EXPECT_NO_THROW(validate({3.0, 10, 1e-9}));
}

TEST(Sampling, BadArgumentsAreRefused) {
  Sampler sampler;
  TokenRng rng(0);
  auto status_of = [&](const at::Tensor& logits, std::vector<SamplingParams> params, std::vector<TokenRng*> rngs) {
    try {
      sampler.sample(logits, params, rngs);
    } catch (const Error& e) {
      return e.status();
    }
    return Status::Ok;
  };
  EXPECT_EQ(status_of(at::zeros({2, 10}, at::kDouble), {{}, {}}, {&rng, &rng}), Status::InvalidArgument);
  EXPECT_EQ(status_of(at::zeros({10}), {{}}, {&rng}), Status::InvalidArgument);
  EXPECT_EQ(status_of(at::zeros({2, 0}), {{}, {}}, {&rng, &rng}), Status::InvalidArgument);
  EXPECT_EQ(status_of(at::zeros({2, 10}), {{}}, {&rng}), Status::InvalidArgument);
  EXPECT_EQ(status_of(at::zeros({1, 10}), {{}}, {nullptr}), Status::InvalidArgument);
  EXPECT_EQ(status_of(at::zeros({2, 10}), {{}, {}}, {&rng, &rng}), Status::Ok);
}

TEST(Sampling, BrokenLogitsFailTheirRowOnly) {
  at::Tensor logits = random_logits(3, 100, 1.0, 9);
  logits[1][17] = std::numeric_limits<float>::quiet_NaN();
  logits[2].fill_(-std::numeric_limits<float>::infinity());
  Sampler sampler;
  TokenRng a(1), b(2), c(3);
  const std::vector<SamplingParams> params(3, SamplingParams{1.0, 0, 1.0});
  try {
    sampler.sample(logits, params, {&a, &b, &c});
    ADD_FAILURE() << "NaN logits accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Execution);
    EXPECT_NE(std::string(e.what()).find("NaN"), std::string::npos) << e.what();
  }
  std::vector<std::string> errors;
  TokenRng a2(1), b2(2), c2(3);
  const auto tokens = sampler.sample(logits, params, {&a2, &b2, &c2}, &errors);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_EQ(errors[0], "");
  EXPECT_GE(tokens[0], 0);
  EXPECT_EQ(tokens[1], -1);
  EXPECT_NE(errors[1].find("NaN"), std::string::npos) << errors[1];
  EXPECT_EQ(tokens[2], -1);
  EXPECT_NE(errors[2].find("-inf"), std::string::npos) << errors[2];
}

// Logits off the CPU go through sample_reducing_on_device (greedy rows reduced where the logits are, the rest copied
// whole); it runs here on CPU logits and must give the host path's tokens, errors and draws for every kind of row:
// greedy (temperature 0, top_k 1) with a tie for the largest logit, sampled (temperature, top-k, top-p), a NaN, a
// +inf and an all -inf row, greedy and sampled, over several steps.
TEST(Sampling, ReducingOnTheDeviceEqualsTheHostPath) {
  const float inf = std::numeric_limits<float>::infinity();
  at::Tensor logits = random_logits(10, 1000, 2.0, 21);
  logits[0][5] = 50.f;  // a tie for the largest logit: the first token wins
  logits[0][700] = 50.f;
  logits[3][9] = std::numeric_limits<float>::quiet_NaN();
  logits[4][12] = inf;
  logits[5].fill_(-inf);
  logits[6][3] = inf;
  logits[7].fill_(-inf);
  const std::vector<SamplingParams> params{
      {0, 0, 1}, {0.8, 0, 1}, {1.0, 40, 1}, {0, 0, 1},     {0, 0, 1},
      {0, 0, 1}, {1.0, 0, 1}, {1.0, 0, 1},  {0.7, 0, 0.9}, {2.0, 1, 1},
  };
  std::vector<TokenRng> host_rngs, device_rngs;
  for (uint64_t seed = 0; seed < params.size(); ++seed) {
    host_rngs.emplace_back(100 + seed);
    device_rngs.emplace_back(100 + seed);
  }
  std::vector<TokenRng*> host_ptrs, device_ptrs;
  for (size_t b = 0; b < params.size(); ++b) {
    host_ptrs.push_back(&host_rngs[b]);
    device_ptrs.push_back(&device_rngs[b]);
  }
  Sampler host, device;
  for (int step = 0; step < 5; ++step) {
    std::vector<std::string> host_errors, device_errors;
    const auto want = host.sample(logits, params, host_ptrs, &host_errors);
    const auto got = device.sample_reducing_on_device(logits, params, device_ptrs, &device_errors);
    EXPECT_EQ(got, want) << "step " << step;
    EXPECT_EQ(device_errors, host_errors) << "step " << step;
    for (size_t b = 0; b < params.size(); ++b) EXPECT_EQ(device_rngs[b].draws(), host_rngs[b].draws()) << b;
  }
  // The rows meant above: a tie won by the first token, greedy over +inf and all -inf as the host path takes them, a
  // NaN failing its row, and sampling refused where a logit is +inf or every one -inf.
  std::vector<std::string> errors;
  TokenRng fresh[10] = {TokenRng(0), TokenRng(1), TokenRng(2), TokenRng(3), TokenRng(4),
                        TokenRng(5), TokenRng(6), TokenRng(7), TokenRng(8), TokenRng(9)};
  std::vector<TokenRng*> ptrs;
  for (auto& r : fresh) ptrs.push_back(&r);
  const auto tokens = device.sample_reducing_on_device(logits, params, ptrs, &errors);
  EXPECT_EQ(tokens[0], 5);
  EXPECT_EQ(tokens[3], -1);
  EXPECT_NE(errors[3].find("NaN"), std::string::npos) << errors[3];
  EXPECT_EQ(tokens[4], 12);
  EXPECT_EQ(tokens[5], 0);
  EXPECT_EQ(tokens[6], -1);  // sampled with a +inf or all -inf logits: undefined probabilities
  EXPECT_NE(errors[6].find("+inf"), std::string::npos) << errors[6];
  EXPECT_EQ(tokens[7], -1);
  EXPECT_EQ(tokens[9], logits[9].argmax().item<int64_t>());
}

// Not a test: the cost of a step's sampling at B = 64, vocab 50k, for each kind of setting. Run with
// --gtest_also_run_disabled_tests --gtest_filter='*SamplingSpeed*'.
TEST(Sampling, DISABLED_SamplingSpeed) {
  const int64_t rows = 64, vocab = 50000;
  const at::Tensor logits = random_logits(rows, vocab, 3.0, 10);
  const std::vector<std::pair<const char*, SamplingParams>> kinds = {
      {"greedy", {0.0, 0, 1.0}},    {"temperature", {0.8, 0, 1.0}},
      {"top-k 50", {0.8, 50, 1.0}}, {"top-k 50 + top-p 0.9", {0.8, 50, 0.9}},
      {"top-p 0.9", {0.8, 0, 0.9}}, {"top-p 0.9, flat logits / 10", {8.0, 0, 0.9}}};
  Sampler sampler;
  for (const auto& [name, params] : kinds) {
    std::vector<TokenRng> rngs(rows);
    const int steps = 20;
    draw(sampler, logits, std::vector<SamplingParams>(rows, params), rngs, 2);  // warm-up
    const auto start = std::chrono::steady_clock::now();
    draw(sampler, logits, std::vector<SamplingParams>(rows, params), rngs, steps);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%-30s %.2f ms per step of %ld rows\n", name, ms / steps, static_cast<long>(rows));
  }
}

}  // namespace
}  // namespace libpipe::generate
