// The generation engine (runtime/generate/engine.h) on the tiny decoder fixtures (tests/models/decoder_models.py):
// greedy tokens equal transformers' LlamaForCausalLM.generate(do_sample=False) on the same weights (the fixture's
// tiny_decoder.expected.json) for every prompt, whether the prompts come at once, chunked, or one after another
// while the others run; sequences beyond the slots wait (and beyond max_queued are refused with Busy); cancel,
// deadline and a failing step end one sequence and give its slot back; bad submissions are refused at once.
//
// States are made deterministic with the test gate (tests/gate): the gated decoders hold a step whose prefill row
// starts with token 119 + key in the second stage until the test opens gate `key`, so "a sequence holds the slot",
// "others wait" and "nothing can have produced a token yet" are facts, not timing guesses. Bounded waits only guard
// against a hang; no verdict depends on the clock.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "../gate/gate.h"
#include "fixtures.h"
#include "runtime/device/cuda_graph.h"
#include "runtime/error.h"
#include "runtime/generate/decoder_info.h"
#include "runtime/generate/engine.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/planner/planner.h"

namespace libpipe::generate {
namespace {

using test::status_of;
using Tokens = std::vector<int64_t>;

constexpr auto kHangGuard = std::chrono::seconds(120);  // only ends a hung test; never decides a verdict

// ---- the fixture's reference ----

struct Reference {
  std::vector<Tokens> prompts, greedy;
  int64_t max_new_tokens = 0, vocab = 0, slots = 0, max_len = 0;
  Tokens max_len_prompt, max_len_greedy;  // a prompt that fills the cache, and every token it has room for
  // Per prompt: the log-probability of each greedy token, and the 5 likeliest ids and theirs (transformers' logits).
  std::vector<std::vector<double>> logprob;
  std::vector<std::vector<Tokens>> top_ids;
  std::vector<std::vector<std::vector<double>>> top_logprobs;
};

const Reference& reference() {
  static const Reference ref = [] {
    std::ifstream in(test::fixture("tiny_decoder.expected.json"));
    if (!in)
      throw std::runtime_error("no tiny_decoder.expected.json in $PIPE_TEST_MODELS (tests/models/decoder_models.py)");
    const auto j = nlohmann::json::parse(in);
    Reference r;
    r.prompts = j.at("prompts").get<std::vector<Tokens>>();
    r.greedy = j.at("greedy").get<std::vector<Tokens>>();
    r.max_new_tokens = j.at("max_new_tokens").get<int64_t>();
    r.vocab = j.at("vocab").get<int64_t>();
    r.slots = j.at("slots").get<int64_t>();
    r.max_len = j.at("max_len").get<int64_t>();
    r.max_len_prompt = j.at("max_len_prompt").get<Tokens>();
    r.max_len_greedy = j.at("max_len_greedy").get<Tokens>();
    for (const auto& lp : j.at("greedy_logprobs")) {
      r.logprob.push_back(lp.at("logprob").get<std::vector<double>>());
      r.top_ids.push_back(lp.at("top_ids").get<std::vector<Tokens>>());
      r.top_logprobs.push_back(lp.at("top_logprobs").get<std::vector<std::vector<double>>>());
    }
    return r;
  }();
  return ref;
}

// ---- engines ----

// The decoder cut at `points`.
std::shared_ptr<const graph::Plan> decoder_plan_cut(const std::string& file, const std::vector<std::string>& points) {
  // The gated decoders call libpipe_test::gate, which must be loaded before they are.
  if (file.rfind("gated", 0) == 0 && gate_init() != 0) throw std::runtime_error("gate_init failed");
  auto model = graph::Model::load(test::fixture(file));
  PlanRequest request;
  request.split_points = points;
  auto plan = make_plan(model, request);
  EXPECT_EQ(plan->num_stages(), points.size() + 1);
  return plan;
}

// The decoder's plan: one stage, or two cut where the second layer begins (its caches and the gate in stage 1).
std::shared_ptr<const graph::Plan> decoder_plan(const std::string& file, int stages) {
  return decoder_plan_cut(file,
                          stages == 2 ? std::vector<std::string>{"model.layers.1:begin"} : std::vector<std::string>{});
}

// One intra-op thread per stage: these steps are tiny, and ThreadSanitizer (scripts/test-tsan.sh) cannot see the
// synchronisation inside LibTorch's (uninstrumented) OpenMP workers.
schedule::SessionOptions session_options() {
  schedule::SessionOptions o;
  o.threads_per_stage = 1;
  return o;
}

std::unique_ptr<Engine> make_engine(const std::string& file, int stages, EngineOptions options = {}) {
  return std::make_unique<Engine>(decoder_plan(file, stages), session_options(), options);
}

GenerationOptions greedy(int64_t max_new_tokens) {
  GenerationOptions o;
  o.max_new_tokens = max_new_tokens;
  return o;
}

// Waits for the end (a hang guard only) and returns every token.
Tokens finish_and_read(Generation& g) {
  EXPECT_TRUE(g.wait_until(Clock::now() + kHangGuard)) << "the generation never finished";
  Tokens out;
  int64_t buf[16];
  bool finished = false;
  for (size_t n; (n = g.read(buf, 16, &finished)) > 0;) out.insert(out.end(), buf, buf + n);
  EXPECT_TRUE(finished);
  return out;
}

// Polls `condition` until it holds; false only when it never does within the hang guard.
bool eventually(const std::function<bool()>& condition) {
  const auto give_up = Clock::now() + kHangGuard;
  while (!condition()) {
    if (Clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

// ---- the gate ----

// Keys come from prompts here, not from gate.h's counter.
[[maybe_unused]] const auto unused_gate_new_key = &gate_new_key;

// A gate key of the gated decoders: a prompt whose first token is 119 + key holds its prefill step in stage 1. The
// decoders know keys 1..8 only, so keys are reused: each starts with no files of an earlier use.
class GateKey {
 public:
  GateKey() {
    if (gate_init() != 0) throw std::runtime_error("gate_init failed (LIBPIPE_TEST_GATE_LIB)");
    static int64_t next = 0;
    key_ = next++ % 8 + 1;
    remove_files();
  }
  // Removes the key's files once everything that used it is gone (declare it before the engine).
  ~GateKey() { remove_files(); }
  GateKey(const GateKey&) = delete;
  GateKey& operator=(const GateKey&) = delete;

  int64_t key() const { return key_; }
  int64_t first_token() const { return 119 + key_; }
  Tokens prompt() const { return {first_token(), 5, 9, 17}; }
  // Held in stage 1 (a bounded wait for what the test itself brought about).
  bool wait_held(int count = 1) const { return gate_wait(key_, "stage1", "arrived", count) == 1; }
  int held() const { return gate_count(key_, "stage1", "arrived"); }
  void open() const { gate_open(key_, nullptr); }

 private:
  void remove_files() const {
    const char* dir = getenv("LIBPIPE_TEST_GATE_DIR");
    DIR* d = dir ? opendir(dir) : nullptr;
    if (!d) return;
    const std::string prefix = "gate-" + std::to_string(key_) + ".";
    std::vector<std::string> names;
    for (dirent* e; (e = readdir(d));)
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(std::string(dir) + "/" + e->d_name);
    closedir(d);
    for (const auto& n : names) ::unlink(n.c_str());
  }
  int64_t key_ = 0;
};

// Opens the gate when the test ends early, so that destroying the engine never waits on a held step (declare it
// after the engine).
struct OpenOnExit {
  const GateKey& gate;
  ~OpenOnExit() { gate.open(); }
};

// ---- greedy equality ----

TEST(Engine, GreedyTokensEqualTransformersForPromptsSubmittedAtOnce) {
  const auto& ref = reference();
  struct Case {
    int stages;
    int64_t prefill_chunk;  // 0: default (whole prompts); 8: the long prompts take several steps
  };
  for (const Case c : {Case{1, 0}, Case{2, 0}, Case{2, 8}}) {
    SCOPED_TRACE(testing::Message() << c.stages << " stages, prefill_chunk " << c.prefill_chunk);
    EngineOptions options;
    options.prefill_chunk = c.prefill_chunk;
    auto engine = make_engine("tiny_decoder.pt", c.stages, options);
    EXPECT_EQ(engine->decoder().slots, ref.slots);
    EXPECT_EQ(engine->decoder().max_len, ref.max_len);
    EXPECT_EQ(engine->decoder().vocab, ref.vocab);
    ASSERT_EQ(engine->session().num_stages(), static_cast<size_t>(c.stages));
    // Five prompts, four slots: one waits for a slot that a finished sequence leaves.
    std::vector<std::shared_ptr<Generation>> gens;
    for (const auto& p : ref.prompts) gens.push_back(engine->submit(p, greedy(ref.max_new_tokens)));
    int64_t prompt_tokens = 0;
    for (size_t i = 0; i < gens.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "prompt " << i);
      EXPECT_EQ(finish_and_read(*gens[i]), ref.greedy[i]);
      EXPECT_EQ(gens[i]->status(), Status::Ok) << gens[i]->message();
      const auto info = gens[i]->info();
      EXPECT_EQ(info.finish_reason, FinishReason::Length);
      EXPECT_EQ(info.prompt_tokens, static_cast<int64_t>(ref.prompts[i].size()));
      EXPECT_EQ(info.generated_tokens, ref.max_new_tokens);
      EXPECT_GE(info.queued_ms, 0);
      EXPECT_GE(info.time_to_first_token_ms, 0);
      EXPECT_GE(info.mean_inter_token_ms, 0);
      prompt_tokens += static_cast<int64_t>(ref.prompts[i].size());
    }
    ASSERT_TRUE(eventually([&] { return engine->stats().slots_in_use == 0; })) << "slots were not given back";
    const auto st = engine->stats();
    EXPECT_EQ(st.queued, 0);
    EXPECT_EQ(st.sequences_finished, gens.size());
    EXPECT_EQ(st.generated_tokens, gens.size() * static_cast<uint64_t>(ref.max_new_tokens));
    EXPECT_EQ(st.prompt_tokens, static_cast<uint64_t>(prompt_tokens));
    EXPECT_GT(st.steps, 0u);
    EXPECT_GT(st.mean_rows_per_step, 0);
  }
}

// Decode steps padded as for CUDA graphs (LIBPIPE_PAD_DECODE_STEPS=1) while it lives.
struct PadDecodeSteps {
  PadDecodeSteps() { setenv("LIBPIPE_PAD_DECODE_STEPS", "1", 1); }
  ~PadDecodeSteps() { unsetenv("LIBPIPE_PAD_DECODE_STEPS"); }
  PadDecodeSteps(const PadDecodeSteps&) = delete;
  PadDecodeSteps& operator=(const PadDecodeSteps&) = delete;
};

TEST(Engine, DecodeStepsPaddedForCudaGraphsStillGiveTransformersTokens) {
  // LIBPIPE_PAD_DECODE_STEPS=1 pads decode steps as for GPU stages that replay CUDA graphs (graph_padding.h): rows in
  // free slots at the padded context's end, whose logits nobody reads. On the CPU nothing replays them; the tokens
  // show that the padding rows disturb no sequence. Prompts come one after another (free slots: every decode step
  // is padded) and all at once (five prompts, four slots: steps are padded only while enough slots are free).
  const auto& ref = reference();
  PadDecodeSteps pad;
  for (const int stages : {1, 2}) {
    for (const bool at_once : {false, true}) {
      SCOPED_TRACE(testing::Message() << stages << " stages, " << (at_once ? "at once" : "one after another"));
      auto engine = make_engine("tiny_decoder.pt", stages);
      std::vector<std::shared_ptr<Generation>> gens;
      std::vector<Tokens> tokens(ref.prompts.size());
      for (size_t i = 0; i < ref.prompts.size(); ++i) {
        gens.push_back(engine->submit(ref.prompts[i], greedy(ref.max_new_tokens)));
        if (!at_once) tokens[i] = finish_and_read(*gens[i]);
      }
      for (size_t i = 0; i < gens.size(); ++i) {
        if (at_once) tokens[i] = finish_and_read(*gens[i]);
        EXPECT_EQ(tokens[i], ref.greedy[i]) << "prompt " << i;
        EXPECT_EQ(gens[i]->status(), Status::Ok) << gens[i]->message();
      }
      const auto st = engine->stats();
      EXPECT_GT(st.padded_steps, 0u);
      if (!at_once) {  // every step after a prompt's first is a decode step with free slots
        EXPECT_GE(st.padded_steps, ref.prompts.size() * static_cast<uint64_t>(ref.max_new_tokens - 1));
      }
    }
  }
}

// A stand-in for a GPU's CUDA graphs on CPU stages: recording runs the step's host code and keeps it, a replay runs
// it again (into the recorded inputs the stage refilled); the counts say that both happened.
class StandInGraph final : public device::StepGraph {
 public:
  StandInGraph(std::shared_ptr<std::atomic<int>> recorded, std::shared_ptr<std::atomic<int>> replayed)
      : recorded_(std::move(recorded)), replayed_(std::move(replayed)) {}
  void capture(const std::function<void()>& work) override {
    work();
    work_ = work;
    ++*recorded_;
  }
  void replay() override {
    work_();
    ++*replayed_;
  }

 private:
  std::shared_ptr<std::atomic<int>> recorded_, replayed_;
  std::function<void()> work_;
};

struct StandInGraphs {
  std::shared_ptr<std::atomic<int>> recorded = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<int>> replayed = std::make_shared<std::atomic<int>>(0);
  std::function<device::StepGraphFactory(const c10::Device&)> factory() const {
    auto rec = recorded, rep = replayed;
    return [rec, rep](const c10::Device&) -> device::StepGraphFactory {
      return [rec, rep] { return std::make_unique<StandInGraph>(rec, rep); };
    };
  }
};

TEST(Engine, DecodeStepsThroughTheWholeGraphPathOnCpuStagesStillGiveTransformersTokens) {
  // What a GPU does with CUDA graphs, on CPU stages with a stand-in for the graphs: the first stage cut before its
  // first layer, decode steps padded and marked graphable, each stage recording the first step of a shape and
  // replaying the later ones from its recorded inputs. Only the GPU's capture itself is left out.
  const auto& ref = reference();
  PadDecodeSteps pad;
  for (const int stages : {1, 2}) {
    SCOPED_TRACE(testing::Message() << stages << " stages");
    StandInGraphs graphs;
    auto options = session_options();
    options.graph_factory = graphs.factory();
    options.graph_cpu_stages = true;
    auto engine = std::make_unique<Engine>(decoder_plan("tiny_decoder.pt", stages), options, EngineOptions{});
    ASSERT_EQ(engine->session().num_stages(), static_cast<size_t>(stages));
    std::vector<std::shared_ptr<Generation>> gens;
    for (const auto& p : ref.prompts) gens.push_back(engine->submit(p, greedy(ref.max_new_tokens)));
    for (size_t i = 0; i < gens.size(); ++i) {
      EXPECT_EQ(finish_and_read(*gens[i]), ref.greedy[i]) << "prompt " << i;
      EXPECT_EQ(gens[i]->status(), Status::Ok) << gens[i]->message();
    }
    // One sequence alone at the end: its decode steps, of one shape, replay.
    auto last = engine->submit(ref.prompts[0], greedy(ref.max_new_tokens));
    EXPECT_EQ(finish_and_read(*last), ref.greedy[0]);
    EXPECT_GT(engine->stats().padded_steps, 0u);
    EXPECT_GE(graphs.recorded->load(), stages) << "every stage records";
    EXPECT_GT(graphs.replayed->load(), ref.max_new_tokens) << "decode steps replay";
  }
}

// ---- prefix reuse ----

// Tokens two sequences begin with.
int64_t common_prefix(const Tokens& a, const Tokens& b) {
  int64_t n = 0;
  while (n < static_cast<int64_t>(std::min(a.size(), b.size())) && a[n] == b[n]) ++n;
  return n;
}

TEST(Engine, APromptBeginningWithAFreedSlotsTokensStartsAfterThemAndStillGivesTransformersTokens) {
  const auto& ref = reference();
  // The longest prompt, so that a real part of it can come from the cache, and another that begins differently.
  size_t full_index = 0;
  for (size_t i = 0; i < ref.prompts.size(); ++i)
    if (ref.prompts[i].size() > ref.prompts[full_index].size()) full_index = i;
  const Tokens& full = ref.prompts[full_index];
  ASSERT_GE(full.size(), 4u);
  size_t other_index = 0;
  while (other_index < ref.prompts.size() && ref.prompts[other_index][0] == full[0]) ++other_index;
  ASSERT_LT(other_index, ref.prompts.size()) << "the fixture needs a prompt that begins with another token";
  const Tokens head(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(full.size() / 2));
  for (const int stages : {1, 2}) {
    for (const bool reuse : {true, false}) {
      SCOPED_TRACE(testing::Message() << stages << " stages, prefix reuse " << reuse);
      EngineOptions options;
      options.prefix_reuse = reuse;
      auto engine = make_engine("tiny_decoder.pt", stages, options);
      // The first half of the prompt, two tokens: its slot keeps the half and the first token (fed back for the
      // second).
      auto first = engine->submit(head, greedy(2));
      const Tokens first_tokens = finish_and_read(*first);
      ASSERT_EQ(first_tokens.size(), 2u);
      EXPECT_EQ(first->info().cached_tokens, 0);
      Tokens kept = head;
      kept.push_back(first_tokens[0]);
      // A prompt that begins otherwise takes another slot (the one freed longest ago), leaving that one as it is.
      auto other = engine->submit(ref.prompts[other_index], greedy(ref.max_new_tokens));
      EXPECT_EQ(finish_and_read(*other), ref.greedy[other_index]);
      EXPECT_EQ(other->info().cached_tokens, 0);
      // The whole prompt starts where the half and its token stop matching it, and gives transformers' tokens.
      const int64_t expected_cached = reuse ? common_prefix(kept, full) : 0;
      ASSERT_GE(expected_cached, reuse ? static_cast<int64_t>(head.size()) : 0);
      auto whole = engine->submit(full, greedy(ref.max_new_tokens));
      EXPECT_EQ(finish_and_read(*whole), ref.greedy[full_index]);
      EXPECT_EQ(whole->info().cached_tokens, expected_cached);
      // Again: everything but the last prompt token is in the slot now (that one is computed for its logits).
      auto again = engine->submit(full, greedy(ref.max_new_tokens));
      EXPECT_EQ(finish_and_read(*again), ref.greedy[full_index]);
      const int64_t again_cached = reuse ? static_cast<int64_t>(full.size()) - 1 : 0;
      EXPECT_EQ(again->info().cached_tokens, again_cached);
      ASSERT_TRUE(eventually([&] { return engine->stats().slots_in_use == 0; })) << "slots were not given back";
      const auto st = engine->stats();
      const uint64_t cached = static_cast<uint64_t>(expected_cached + again_cached);
      EXPECT_EQ(st.cached_prompt_tokens, cached);
      EXPECT_EQ(st.prompt_tokens, head.size() + ref.prompts[other_index].size() + 2 * full.size() - cached);
    }
  }
}

TEST(Engine, LogprobsEqualTheLogSoftmaxOfTransformersLogits) {
  const auto& ref = reference();
  auto engine = make_engine("tiny_decoder.pt", 2);
  std::vector<std::shared_ptr<Generation>> gens;
  for (const auto& p : ref.prompts) {
    GenerationOptions o = greedy(ref.max_new_tokens);
    o.logprobs = true;
    o.top_logprobs = 5;
    gens.push_back(engine->submit(p, o));
  }
  for (size_t i = 0; i < gens.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "prompt " << i);
    const Tokens tokens = finish_and_read(*gens[i]);
    ASSERT_EQ(tokens, ref.greedy[i]);
    for (size_t t = 0; t < tokens.size(); ++t) {
      SCOPED_TRACE(testing::Message() << "token " << t);
      TokenLogprobs lp;
      ASSERT_TRUE(gens[i]->logprobs(t, &lp));
      EXPECT_NEAR(lp.logprob, ref.logprob[i][t], 1e-4);
      ASSERT_EQ(lp.top_ids.size(), 5u);
      for (size_t k = 0; k < 5; ++k) {
        // Ranks may swap between near-equal alternatives; their log-probabilities may not differ.
        EXPECT_NEAR(lp.top_logprobs[k], ref.top_logprobs[i][t][k], 1e-4);
        const auto& want = ref.top_logprobs[i][t];
        const bool apart = (k == 0 || want[k - 1] - want[k] > 1e-3) && (k == 4 || want[k] - want[k + 1] > 1e-3);
        if (apart) {
          EXPECT_EQ(lp.top_ids[k], ref.top_ids[i][t][k]);
        }
      }
    }
    TokenLogprobs none;
    EXPECT_FALSE(gens[i]->logprobs(tokens.size(), &none));
  }
  GenerationOptions bad = greedy(1);
  bad.top_logprobs = 2;
  EXPECT_EQ(status_of([&] { engine->submit(ref.prompts[0], bad); }), Status::InvalidArgument);
  bad.logprobs = true;
  bad.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_EQ(status_of([&] { engine->submit(ref.prompts[0], bad); }), Status::InvalidArgument);
}

TEST(Engine, StagesSharedByTwoWorkerThreadsGiveTheSameTokensAndKeepTwoStepsInFlight) {
  // Three and four stages on two worker threads (runtime/schedule/stage_sharing.h): the middle stages run on
  // whichever worker would otherwise wait, and every stage still sees the steps in order (a prompt's chunks follow
  // each other in and must find the earlier chunks' keys and values in the caches).
  const auto& ref = reference();
  struct Case {
    std::vector<std::string> cut;
    int64_t prefill_chunk;
  };
  const std::vector<Case> cases{
      {{"model.layers.1:begin", "model.layers.1.mlp:begin"}, 0},
      {{"model.layers.0.mlp:begin", "model.layers.1:begin", "model.layers.1.mlp:begin"}, 0},
      {{"model.layers.0.mlp:begin", "model.layers.1:begin", "model.layers.1.mlp:begin"}, 2},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << c.cut.size() + 1 << " stages, prefill_chunk " << c.prefill_chunk);
    auto session_opts = session_options();
    session_opts.stage_workers = 2;
    EngineOptions options;
    options.prefill_chunk = c.prefill_chunk;
    Engine engine(decoder_plan_cut("tiny_decoder.pt", c.cut), session_opts, options);
    EXPECT_EQ(engine.session().concurrent_stages(), 2u);
    EXPECT_EQ(engine.options().steps_in_flight, 2) << "one step per worker thread";
    std::vector<std::shared_ptr<Generation>> gens;
    for (const auto& p : ref.prompts) gens.push_back(engine.submit(p, greedy(ref.max_new_tokens)));
    for (size_t i = 0; i < gens.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "prompt " << i);
      EXPECT_EQ(finish_and_read(*gens[i]), ref.greedy[i]);
      EXPECT_EQ(gens[i]->status(), Status::Ok) << gens[i]->message();
    }
    const uint64_t steps = engine.session().stats(0).microbatches;
    for (size_t s = 1; s < engine.session().num_stages(); ++s)
      EXPECT_EQ(engine.session().stats(s).microbatches, steps) << "every step passes stage " << s;
  }
}

TEST(Engine, SequencesJoiningMidFlightFromTheTokenCallbackGetTheirOwnTokens) {
  // Prompt i + 1 is submitted from prompt i's callback when i has its first token (and is far from done), so every
  // sequence joins while others are mid-flight; prompts are prefilled 4 tokens per step beside others' decode rows.
  const auto& ref = reference();
  const size_t n = ref.prompts.size();
  for (int stages : {1, 2}) {
    SCOPED_TRACE(testing::Message() << stages << " stages");
    std::mutex mutex;  // (declared before the engine: callbacks use them until the engine is gone)
    std::condition_variable submitted;
    std::vector<std::shared_ptr<Generation>> gens;
    std::vector<bool> joined_mid_flight;
    std::string failure;
    EngineOptions options;
    options.prefill_chunk = 4;
    auto engine = make_engine("tiny_decoder.pt", stages, options);
    std::function<void(size_t)> start = [&](size_t i) {
      std::shared_ptr<Generation> g;
      try {
        g = engine->submit(ref.prompts[i], greedy(ref.max_new_tokens));
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex);
        failure = std::string("submit from a callback failed: ") + e.what();
        submitted.notify_all();
        return;
      }
      {
        std::lock_guard lock(mutex);
        gens.push_back(g);
        submitted.notify_all();
      }
      auto next_started = std::make_shared<bool>(false);
      g->on_event([&, i, next_started, weak = std::weak_ptr<Generation>(g)](size_t available, bool finished) {
        if (*next_started || i + 1 >= n || available == 0 || finished) return;
        *next_started = true;
        auto self = weak.lock();
        {
          std::lock_guard lock(mutex);
          joined_mid_flight.push_back(self && self->info().generated_tokens < ref.max_new_tokens);
        }
        start(i + 1);
      });
    };
    start(0);
    for (size_t i = 0; i < n; ++i) {
      std::shared_ptr<Generation> g;
      {
        std::unique_lock lock(mutex);
        ASSERT_TRUE(submitted.wait_for(lock, kHangGuard, [&] { return gens.size() > i || !failure.empty(); }))
            << "prompt " << i << " was never submitted";
        ASSERT_EQ(failure, "");
        g = gens[i];
      }
      EXPECT_EQ(finish_and_read(*g), ref.greedy[i]) << "prompt " << i;
      EXPECT_EQ(g->info().finish_reason, FinishReason::Length);
    }
    std::lock_guard lock(mutex);
    EXPECT_EQ(joined_mid_flight, std::vector<bool>(n - 1, true));
  }
}

TEST(Engine, APromptAloneIsCutIntoChunksThatFollowEachOtherThroughThePipeline) {
  // One sequence, prompt chunks of 2 tokens: its first chunk is held in stage 1 while its second one runs in stage 0,
  // without waiting for the first to come back. The tokens equal those of the whole prompt in one step.
  GateKey gate;
  Tokens prompt = gate.prompt();
  prompt.insert(prompt.end(), {33, 2, 71});  // 7 tokens: chunks of 2, 2, 2, 1
  Tokens want;
  {
    auto plain = make_engine("tiny_decoder.pt", 2);  // the same weights, no gate
    auto g = plain->submit(prompt, greedy(5));
    want = finish_and_read(*g);
  }
  EngineOptions options;
  options.prefill_chunk = 2;
  auto engine = make_engine("gated_decoder.pt", 2, options);
  OpenOnExit opener{gate};
  const uint64_t stage0_before = engine->session().stats(0).microbatches;
  auto g = engine->submit(prompt, greedy(5));
  ASSERT_TRUE(gate.wait_held());
  // Two steps in flight (one per stage): the second chunk passes stage 0 while the first is held.
  EXPECT_TRUE(eventually([&] { return engine->session().stats(0).microbatches >= stage0_before + 2; }))
      << "the second chunk did not enter the pipeline while the first was held";
  gate.open();
  EXPECT_EQ(finish_and_read(*g), want);
  EXPECT_EQ(g->info().prompt_tokens, static_cast<int64_t>(prompt.size()));
}

// ---- slots and the queue ----

TEST(Engine, MoreSequencesThanSlotsWaitAndAllFinishCorrectly) {
  // Ten sequences, four slots. The first one's prefill is held in stage 1, so nothing can finish: three more take
  // the other slots and six wait. Every callback checks that no more than four slots are ever in use.
  const auto& ref = reference();
  std::mutex mutex;  // (declared before the engine: callbacks use it until the engine is gone)
  int64_t most_slots = 0, most_queued = 0, callbacks = 0;
  GateKey gate;
  auto engine = make_engine("gated_decoder.pt", 2);
  OpenOnExit opener{gate};
  ASSERT_EQ(engine->decoder().slots, 4);
  auto watch = [&](Generation& g) {
    g.on_event([&](size_t, bool) {
      const auto st = engine->stats();
      std::lock_guard lock(mutex);
      most_slots = std::max(most_slots, st.slots_in_use);
      most_queued = std::max(most_queued, st.queued);
      ++callbacks;
    });
  };
  auto held = engine->submit(gate.prompt(), greedy(ref.max_new_tokens));
  watch(*held);
  ASSERT_TRUE(gate.wait_held());
  std::vector<std::shared_ptr<Generation>> gens;
  for (size_t i = 0; i < 9; ++i) {
    gens.push_back(engine->submit(ref.prompts[i % ref.prompts.size()], greedy(ref.max_new_tokens)));
    watch(*gens.back());
  }
  ASSERT_TRUE(eventually([&] {
    const auto st = engine->stats();
    return st.slots_in_use == 4 && st.queued == 6;
  })) << "slots_in_use "
      << engine->stats().slots_in_use << ", queued " << engine->stats().queued;
  for (const auto& g : gens) EXPECT_EQ(g->info().generated_tokens, 0);
  gate.open();
  for (size_t i = 0; i < gens.size(); ++i)
    EXPECT_EQ(finish_and_read(*gens[i]), ref.greedy[i % ref.prompts.size()]) << "sequence " << i + 1;
  EXPECT_EQ(finish_and_read(*held).size(), static_cast<size_t>(ref.max_new_tokens));
  EXPECT_EQ(held->status(), Status::Ok) << held->message();
  std::lock_guard lock(mutex);
  EXPECT_GT(callbacks, 0);
  EXPECT_LE(most_slots, 4);
  EXPECT_GT(most_queued, 0) << "a callback saw sequences waiting";
}

TEST(Engine, ASubmitBeyondMaxQueuedIsBusyAndTheQueueAcceptsAgainOnceItMoves) {
  const auto& ref = reference();
  GateKey gate;
  EngineOptions options;
  options.max_queued = 1;
  auto engine = make_engine("gated_decoder_1slot.pt", 2, options);
  OpenOnExit opener{gate};
  ASSERT_EQ(engine->options().max_queued, 1);
  auto holder = engine->submit(gate.prompt(), greedy(3));  // the only slot, held in stage 1
  ASSERT_TRUE(gate.wait_held());
  auto waiter = engine->submit(ref.prompts[1], greedy(ref.max_new_tokens));
  std::string message;
  EXPECT_EQ(status_of([&] { engine->submit(ref.prompts[2], greedy(ref.max_new_tokens)); }, &message), Status::Busy);
  EXPECT_NE(message.find("max_queued"), std::string::npos) << message;
  EXPECT_EQ(engine->stats().queued, 1);
  gate.open();
  EXPECT_EQ(finish_and_read(*holder).size(), 3u);
  EXPECT_EQ(finish_and_read(*waiter), ref.greedy[1]);
  // The queue is empty again: a submit is accepted and served.
  auto later = engine->submit(ref.prompts[2], greedy(ref.max_new_tokens));
  EXPECT_EQ(finish_and_read(*later), ref.greedy[2]);
}

// ---- cancel, deadline, failing steps ----

TEST(Engine, CancellingASequenceHeldInAStageEndsItCancelledAndItsSlotServesTheNext) {
  const auto& ref = reference();
  GateKey gate;
  auto engine = make_engine("gated_decoder_1slot.pt", 2);
  OpenOnExit opener{gate};
  auto held = engine->submit(gate.prompt(), greedy(ref.max_new_tokens));
  ASSERT_TRUE(gate.wait_held());
  auto next = engine->submit(ref.prompts[3], greedy(ref.max_new_tokens));
  held->cancel();
  // The held step still writes the slot's cache: the slot stays taken and the next sequence waits.
  EXPECT_EQ(engine->stats().slots_in_use, 1);
  EXPECT_EQ(engine->stats().queued, 1);
  EXPECT_EQ(next->info().generated_tokens, 0);
  gate.open();
  EXPECT_EQ(finish_and_read(*held), Tokens{}) << "the token of a step that returned after the cancel is dropped";
  EXPECT_EQ(held->status(), Status::Cancelled);
  EXPECT_EQ(held->info().finish_reason, FinishReason::Cancelled);
  EXPECT_EQ(finish_and_read(*next), ref.greedy[3]);
  EXPECT_EQ(next->status(), Status::Ok) << next->message();
  // Cancelling what has ended changes nothing.
  next->cancel();
  EXPECT_EQ(next->status(), Status::Ok);
  EXPECT_EQ(next->info().finish_reason, FinishReason::Length);
}

TEST(Engine, CancellingAQueuedSequenceEndsItAtOnce) {
  const auto& ref = reference();
  GateKey gate;
  auto engine = make_engine("gated_decoder_1slot.pt", 2);
  OpenOnExit opener{gate};
  auto held = engine->submit(gate.prompt(), greedy(2));
  ASSERT_TRUE(gate.wait_held());
  auto queued = engine->submit(ref.prompts[0], greedy(ref.max_new_tokens));
  auto after = engine->submit(ref.prompts[1], greedy(ref.max_new_tokens));
  queued->cancel();
  // It has no step, so nothing holds it back: it ends while the gate is still closed.
  ASSERT_TRUE(queued->wait_until(Clock::now() + kHangGuard));
  EXPECT_EQ(queued->status(), Status::Cancelled);
  EXPECT_EQ(gate.held(), 1);
  gate.open();
  EXPECT_EQ(finish_and_read(*held).size(), 2u);
  EXPECT_EQ(finish_and_read(*after), ref.greedy[1]);
  EXPECT_EQ(finish_and_read(*queued), Tokens{});
}

TEST(Engine, ADeadlinePassingWhileTheStepIsHeldEndsTheSequenceAndItsSlotReturnsWithTheStep) {
  const auto& ref = reference();
  GateKey gate;
  auto engine = make_engine("gated_decoder_1slot.pt", 2);
  OpenOnExit opener{gate};
  auto options = greedy(ref.max_new_tokens);
  options.deadline = Clock::now() + std::chrono::milliseconds(500);
  auto held = engine->submit(gate.prompt(), options);
  // Held in stage 1, or (on a machine too loaded to form the step in time) already past its deadline.
  ASSERT_TRUE(eventually([&] { return gate.held() > 0 || held->finished(); }));
  const bool was_held = gate.held() > 0;
  auto next = engine->submit(ref.prompts[2], greedy(ref.max_new_tokens));
  ASSERT_TRUE(eventually([&] { return Clock::now() > options.deadline; }));
  // The deadline ends the sequence though its step is still in the stage.
  ASSERT_TRUE(held->wait_until(Clock::now() + kHangGuard));
  EXPECT_EQ(held->status(), Status::DeadlineExceeded);
  EXPECT_EQ(held->info().finish_reason, FinishReason::Deadline);
  EXPECT_FALSE(held->message().empty());
  if (was_held) {
    EXPECT_EQ(engine->stats().slots_in_use, 1) << "the slot went back while its step was in a stage";
    EXPECT_EQ(engine->stats().queued, 1);
  }
  gate.open();
  EXPECT_EQ(finish_and_read(*next), ref.greedy[2]);
  EXPECT_EQ(finish_and_read(*held), Tokens{});
}

TEST(Engine, AFailingStepFailsItsSequenceOnlyAndTheEngineKeepsServing) {
  // One slot: the failing sequence runs alone, two others wait for its slot.
  const auto& ref = reference();
  for (int stages : {1, 2}) {
    SCOPED_TRACE(testing::Message() << stages << " stages");
    auto engine = make_engine("gated_decoder_1slot.pt", stages);
    auto failing = engine->submit({119, 4, 8}, greedy(ref.max_new_tokens));
    auto second = engine->submit(ref.prompts[4], greedy(ref.max_new_tokens));
    auto third = engine->submit(ref.prompts[0], greedy(ref.max_new_tokens));
    EXPECT_EQ(finish_and_read(*failing), Tokens{});
    EXPECT_EQ(failing->status(), Status::Execution);
    EXPECT_EQ(failing->info().finish_reason, FinishReason::Error);
    EXPECT_NE(failing->message().find("119"), std::string::npos) << failing->message();
    EXPECT_EQ(finish_and_read(*second), ref.greedy[4]);
    EXPECT_EQ(finish_and_read(*third), ref.greedy[0]);
    EXPECT_EQ(second->status(), Status::Ok);
    auto again = engine->submit(ref.prompts[3], greedy(ref.max_new_tokens));
    EXPECT_EQ(finish_and_read(*again), ref.greedy[3]);
  }
}

// ---- what is refused ----

TEST(Engine, BadSubmissionsAreRefusedAtOnceNamingTheProblem) {
  const auto& ref = reference();
  auto engine = make_engine("tiny_decoder.pt", 2);
  auto refused = [&](Tokens prompt, GenerationOptions options, const std::string& named) {
    SCOPED_TRACE(named);
    std::string message;
    EXPECT_EQ(status_of([&] { engine->submit(std::move(prompt), std::move(options)); }, &message),
              Status::InvalidArgument);
    EXPECT_NE(message.find(named), std::string::npos) << message;
  };
  const Tokens ok = ref.prompts[1];
  refused({}, greedy(4), "empty");
  refused({1, ref.vocab, 2}, greedy(4), "vocabulary");
  refused({1, -1, 2}, greedy(4), "vocabulary");
  refused(Tokens(ref.max_len + 1, 3), greedy(4), "max_len");
  refused(Tokens(ref.max_len, 3), greedy(4), "max_len");  // fills the cache: no room for a generated token
  refused(ok, greedy(0), "max_new_tokens");
  refused(ok, greedy(-2), "max_new_tokens");
  auto sampling = [&](double temperature, int64_t top_k, double top_p) {
    auto o = greedy(4);
    o.sampling.temperature = temperature;
    o.sampling.top_k = top_k;
    o.sampling.top_p = top_p;
    return o;
  };
  refused(ok, sampling(-0.5, 0, 1), "temperature");
  refused(ok, sampling(std::numeric_limits<double>::quiet_NaN(), 0, 1), "temperature");
  refused(ok, sampling(1, -1, 1), "top_k");
  refused(ok, sampling(1, 0, 0), "top_p");
  refused(ok, sampling(1, 0, 1.5), "top_p");
  EXPECT_EQ(engine->stats().queued, 0);
  EXPECT_EQ(engine->stats().slots_in_use, 0);
  // Nothing of that disturbed the engine.
  auto g = engine->submit(ok, greedy(ref.max_new_tokens));
  EXPECT_EQ(finish_and_read(*g), ref.greedy[1]);
}

TEST(Engine, AModelThatIsNoDecoderIsRefusedNamingTheContract) {
  for (const std::string file : {"multi_mlp.traced.pt", "gated.scripted.pt"}) {
    SCOPED_TRACE(file);
    if (file == "gated.scripted.pt") {
      ASSERT_EQ(gate_init(), 0);  // it calls libpipe_test::gate
    }
    auto model = graph::Model::load(test::fixture(file));
    std::string message;
    EXPECT_EQ(status_of([&] { Engine engine(graph::Plan::from_markers(model), session_options(), {}); }, &message),
              Status::InvalidArgument);
    EXPECT_NE(message.find("decoder contract"), std::string::npos) << message;
  }
}

TEST(Engine, TheDecoderSaysWhetherItSkipsPaddingAndSoWhetherStepsMix) {
  // libpipe.decoders' modules set skips_padding (they compute the valid tokens only): the engine mixes decode rows
  // and prompt chunks in their steps. The gated fixture leaves it out (its steps keep one kind of row), and a
  // decoder that says nothing is taken to compute its padding.
  EXPECT_TRUE(read_decoder_info(*decoder_plan("tiny_decoder.pt", 2), std::nullopt).skips_padding);
  EXPECT_FALSE(read_decoder_info(*decoder_plan("gated_decoder.pt", 2), std::nullopt).skips_padding);
}

TEST(Engine, NegativeOptionsAreRefused) {
  auto plan = decoder_plan("tiny_decoder.pt", 1);
  for (int64_t EngineOptions::* field : {&EngineOptions::max_queued, &EngineOptions::prefill_chunk,
                                         &EngineOptions::steps_in_flight, &EngineOptions::max_rows_per_step}) {
    EngineOptions options;
    options.*field = -1;
    EXPECT_EQ(status_of([&] { Engine engine(plan, session_options(), options); }), Status::InvalidArgument);
  }
}

// ---- sampling, stop ids, lengths ----

TEST(Engine, SeededSamplingRepeatsWithTheSameSeedsAndDiffersWithOthers) {
  const auto& ref = reference();
  auto engine = make_engine("tiny_decoder.pt", 2);
  auto run = [&](uint64_t seed) {
    std::vector<std::shared_ptr<Generation>> gens;
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
      auto o = greedy(ref.max_new_tokens);
      o.sampling.temperature = 0.8;
      o.sampling.top_k = 20;
      o.seed = seed + i;
      gens.push_back(engine->submit(ref.prompts[i], o));
    }
    std::vector<Tokens> out;
    for (auto& g : gens) {
      out.push_back(finish_and_read(*g));
      EXPECT_EQ(g->status(), Status::Ok) << g->message();
    }
    return out;
  };
  const auto first = run(1000), again = run(1000), other = run(2000);
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  EXPECT_NE(first, ref.greedy) << "temperature 0.8 sampled the greedy tokens everywhere";
  for (const auto& t : first) EXPECT_EQ(t.size(), static_cast<size_t>(ref.max_new_tokens));
}

TEST(Engine, AStopIdEndsTheSequenceAndIsItsLastToken) {
  const auto& ref = reference();
  auto engine = make_engine("tiny_decoder.pt", 2);
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "prompt " << i);
    const Tokens& want = ref.greedy[i];
    // The first token from the third on that did not come before: greedy generation stops right there.
    size_t at = 2;
    while (at < want.size() && std::find(want.begin(), want.begin() + at, want[at]) != want.begin() + at) ++at;
    ASSERT_LT(at, want.size());
    // Beside it a stop id that greedy generation does not reach before it.
    int64_t unreached = 0;
    while (std::find(want.begin(), want.begin() + at + 1, unreached) != want.begin() + at + 1) ++unreached;
    auto o = greedy(ref.max_new_tokens);
    o.stop_ids = {unreached, want[at]};
    auto g = engine->submit(ref.prompts[i], o);
    EXPECT_EQ(finish_and_read(*g), Tokens(want.begin(), want.begin() + at + 1));
    EXPECT_EQ(g->status(), Status::Ok);
    EXPECT_EQ(g->info().finish_reason, FinishReason::Stop);
  }
}

TEST(Engine, MaxNewTokensAndTheCacheLengthEndSequencesWithLength) {
  const auto& ref = reference();
  auto engine = make_engine("tiny_decoder.pt", 2);
  auto short_one = engine->submit(ref.prompts[2], greedy(5));
  // A prompt close to max_len: max_len - len(prompt) + 1 tokens fit (the last is never fed back).
  auto long_one = engine->submit(ref.max_len_prompt, greedy(50));
  auto one = engine->submit(ref.prompts[4], greedy(1));
  EXPECT_EQ(finish_and_read(*short_one), Tokens(ref.greedy[2].begin(), ref.greedy[2].begin() + 5));
  EXPECT_EQ(short_one->info().finish_reason, FinishReason::Length);
  EXPECT_EQ(finish_and_read(*long_one), ref.max_len_greedy);
  EXPECT_EQ(long_one->info().finish_reason, FinishReason::Length);
  EXPECT_EQ(long_one->status(), Status::Ok) << long_one->message();
  EXPECT_EQ(finish_and_read(*one), Tokens{ref.greedy[4][0]});
  EXPECT_EQ(one->info().finish_reason, FinishReason::Length);
}

// ---- reading: the eventfd and read() ----

TEST(Engine, TheEventFdIsReadableWhileTokensAreUnreadOrTheSequenceEnded) {
  const auto& ref = reference();
  std::mutex mutex;  // (declared before the engine: the callback uses them until the engine is gone)
  Tokens got;
  std::vector<std::string> wrong;
  bool told_end = false;
  GateKey gate;
  auto engine = make_engine("gated_decoder_1slot.pt", 2);
  OpenOnExit opener{gate};
  auto held = engine->submit(gate.prompt(), greedy(2));
  ASSERT_TRUE(gate.wait_held());
  auto streamed = engine->submit(ref.prompts[3], greedy(ref.max_new_tokens));  // read from its callback
  auto polled = engine->submit(ref.prompts[2], greedy(ref.max_new_tokens));    // read after its end
  const int held_fd = held->event_fd(), streamed_fd = streamed->event_fd(), polled_fd = polled->event_fd();
  // Nothing can have a token yet: the only slot's first step is in the gate.
  EXPECT_FALSE(readable(held_fd));
  EXPECT_FALSE(readable(streamed_fd));
  EXPECT_FALSE(readable(polled_fd));
  int64_t buf[64];
  bool finished = true;
  EXPECT_EQ(streamed->read(buf, 64, &finished), 0u);
  EXPECT_FALSE(finished);

  // The callback runs on the engine's thread, which is also the one that appends tokens, so within it the
  // generation is still: reading everything clears the descriptor; the end makes it readable for good.
  ASSERT_TRUE(streamed->on_event([&](size_t available, bool ended) {
    std::lock_guard lock(mutex);
    if (told_end) wrong.push_back("an event after the end");
    if (!ended && !readable(streamed_fd)) wrong.push_back("tokens unread but the descriptor is not readable");
    int64_t tokens[64];
    bool all = false;
    const size_t n = streamed->read(tokens, 64, &all);
    if (n != available) wrong.push_back("read " + std::to_string(n) + " of " + std::to_string(available));
    got.insert(got.end(), tokens, tokens + n);
    if (!ended && readable(streamed_fd)) wrong.push_back("caught up but the descriptor is still readable");
    if (ended && !readable(streamed_fd)) wrong.push_back("ended but the descriptor is not readable");
    if (all != ended) wrong.push_back("read's finished differs from the event's");
    told_end = told_end || ended;
  }));
  EXPECT_FALSE(streamed->on_event([](size_t, bool) {})) << "a second callback was accepted";

  gate.open();
  EXPECT_EQ(finish_and_read(*held).size(), 2u);
  ASSERT_TRUE(streamed->wait_until(Clock::now() + kHangGuard));
  ASSERT_TRUE(polled->wait_until(Clock::now() + kHangGuard));
  {
    std::lock_guard lock(mutex);
    EXPECT_EQ(wrong, std::vector<std::string>{});
    EXPECT_TRUE(told_end);
    EXPECT_EQ(got, ref.greedy[3]);
  }
  EXPECT_TRUE(readable(streamed_fd)) << "an ended sequence's descriptor stays readable";
  EXPECT_EQ(streamed->read(buf, 64, &finished), 0u);
  EXPECT_TRUE(finished);
  EXPECT_TRUE(readable(streamed_fd));

  // Ended with every token unread: readable; a partial read leaves it readable and not finished; reading the rest
  // says finished, and the descriptor stays readable.
  EXPECT_TRUE(readable(polled_fd));
  ASSERT_EQ(polled->read(buf, 1, &finished), 1u);
  EXPECT_FALSE(finished);
  EXPECT_TRUE(readable(polled_fd));
  Tokens rest{buf[0]};
  for (size_t n; (n = polled->read(buf, 64, &finished)) > 0;) rest.insert(rest.end(), buf, buf + n);
  EXPECT_TRUE(finished);
  EXPECT_EQ(rest, ref.greedy[2]);
  EXPECT_TRUE(readable(polled_fd));
}

TEST(Engine, DestroyingTheEngineCancelsEverySequenceAndGenerationsOutliveIt) {
  const auto& ref = reference();
  GateKey gate;
  auto engine = make_engine("gated_decoder_1slot.pt", 2);
  auto held = engine->submit(gate.prompt(), greedy(ref.max_new_tokens));
  ASSERT_TRUE(gate.wait_held());
  auto queued = engine->submit(ref.prompts[1], greedy(ref.max_new_tokens));
  // The destructor waits for the held step, so it runs beside the test, which opens the gate once the sequences
  // have ended.
  std::thread destroyer([&] { engine.reset(); });
  const bool ended = held->wait_until(Clock::now() + kHangGuard) && queued->wait_until(Clock::now() + kHangGuard);
  gate.open();
  destroyer.join();
  ASSERT_TRUE(ended);
  EXPECT_EQ(held->status(), Status::Cancelled);
  EXPECT_EQ(queued->status(), Status::Cancelled);
  EXPECT_EQ(finish_and_read(*queued), Tokens{});
  held->cancel();  // the engine is gone: nothing to wake, nothing breaks
}

}  // namespace
}  // namespace libpipe::generate
