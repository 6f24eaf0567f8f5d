// The torch.export front-end (runtime/graph/exported) against its TorchScript twin and against
// hand-written programs: the tables the split rules read, the refusals at load, the input checks,
// and LibTorch's log records reaching libpipe's log.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <set>
#include <vector>

#include <caffe2/serialize/inline_container.h>

#include "fixtures.h"
#include "runtime/graph/exported/archive.h"
#include "runtime/graph/exported/input_check.h"
#include "runtime/graph/exported/model.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/libtorch_log.h"
#include "runtime/log.h"
#include "runtime/planner/planner.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/stage.h"

namespace libpipe {
namespace {

using graph::exported::ExportedModel;
using graph::exported::Json;

std::shared_ptr<const ExportedModel> exported(const std::string& name) {
  return ExportedModel::load(test::fixture("exported/" + name + ".pt2"));
}

std::shared_ptr<const graph::Plan> plan_with(std::shared_ptr<const graph::Program> model, PlanRequest request) {
  return make_plan(std::move(model), request);
}

std::shared_ptr<const graph::Plan> plan_at(std::shared_ptr<const graph::Program> model,
                                           std::vector<std::string> points) {
  PlanRequest request;
  request.split_points = std::move(points);
  return make_plan(std::move(model), request);
}

// Every stage's parameters, as sets (the order within a stage follows each front-end's graph).
std::vector<std::set<std::string>> parameters(const graph::Plan& plan) {
  std::vector<std::set<std::string>> out;
  for (size_t s = 0; s < plan.num_stages(); ++s)
    out.emplace_back(plan.stage(s).parameters.begin(), plan.stage(s).parameters.end());
  return out;
}

TEST(ExportedModel, DescribesTheModuleTreeAndInputsOfAnHfLlama) {
  auto model = exported("hf_llama");
  EXPECT_EQ(model->input_names(), std::vector<std::string>{"input_ids"});
  std::map<std::string, std::string> types;
  for (const auto& m : model->modules()) types[m.path] = m.type;
  EXPECT_EQ(types.at(""), "LlamaLogits");
  EXPECT_EQ(types.at("model.layers.1"), "LlamaDecoderLayer");
  EXPECT_EQ(types.at("model.layers.1.self_attn"), "LlamaAttention");
  // Parameters are counted once per tensor, as the TorchScript front-end counts them.
  auto twin = graph::Model::load(test::fixture("split/hf_llama.pt"));
  std::map<std::string, uint64_t> twin_params;
  for (const auto& m : twin->modules()) twin_params[m.path] = m.num_params;
  for (const auto& m : model->modules()) {
    if (twin_params.count(m.path)) {
      EXPECT_EQ(m.num_params, twin_params[m.path]) << m.path;
    }
  }
}

TEST(ExportedModel, SplitsAsItsTorchScriptTwinDoes) {
  // By module path, by markers, and by the parameter policy: the same parameters per stage.
  EXPECT_EQ(parameters(*plan_at(exported("hf_llama"), {"model.layers.1:begin"})),
            parameters(*plan_at(graph::Model::load(test::fixture("split/hf_llama.pt")), {"model.layers.1:begin"})));
  EXPECT_EQ(parameters(*plan_with(exported("example_code"), {})),
            parameters(*plan_with(graph::Model::load(test::fixture("example_code.traced.pt")), {})));
  PlanRequest params;
  params.num_stages = 2;
  params.policy = "params";
  // GPT-2's head is tied to its embedding: one tensor, which TorchScript names after its first
  // owner and the exported program after the head (the embedding lookup reads it under that name).
  auto gpt2 = parameters(*plan_with(exported("gpt2"), params));
  for (auto& stage : gpt2)
    if (stage.erase("lm_head.weight")) stage.insert("transformer.wte.weight");
  EXPECT_EQ(gpt2, parameters(*plan_with(graph::Model::load(test::fixture("split/gpt2.pt")), params)));
}

TEST(ExportedModel, SizesNeverCrossBetweenStages) {
  // HF Llama reads sizes of its activations (sym_size) in every layer: cut between every layer, only
  // tensors cross, and the nodes that compute the sizes are recomputed where they are read.
  auto model = exported("hf_llama");
  auto plan = plan_at(model, {"model.layers.0:end", "model.layers.1:end"});
  ASSERT_EQ(plan->num_stages(), 3u);
  std::set<std::string> tensors;
  for (const auto& [name, value] : model->graph()["tensor_values"].items()) tensors.insert(name);
  for (const auto& cv : plan->values()) EXPECT_TRUE(tensors.count(cv.name)) << cv.name << " is not a tensor";
  size_t recomputed = 0;
  for (size_t id = 0; id < model->nodes().size(); ++id) recomputed += model->symbol_nodes(id).size();
  EXPECT_GT(recomputed, 0u);
}

TEST(ExportedModel, AWriteInPlaceKeepsItsBufferInOneStage) {
  auto model = exported("state_across_cut");
  const graph::AttributeRead* cache = nullptr;
  for (const auto& a : model->attributes())
    if (a.path == std::vector<std::string>{"store", "cache"}) cache = &a;
  ASSERT_NE(cache, nullptr);
  EXPECT_FALSE(cache->writers.empty());
  EXPECT_NE(cache->written_by.find("copy_"), std::string::npos) << cache->written_by;
  std::string message;
  EXPECT_EQ(test::status_of([&] { plan_at(model, {"head:begin"}); }, &message), Status::Split);
  EXPECT_NE(message.find("'store.cache' is updated in place"), std::string::npos) << message;
  EXPECT_EQ(plan_at(model, {"store.proj:end"})->num_stages(), 2u);
}

TEST(ExportedModel, InputsAreCheckedAgainstTheProgram) {
  auto model = exported("state_across_cut");  // x: [batch 1..4, 8] float32
  const auto x = at::randn({3, 8});
  EXPECT_EQ(test::status_of([&] { graph::exported::check_inputs(*model, {x}); }), Status::Ok);
  struct Case {
    at::Tensor input;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {x.to(at::kDouble), {"input 'x' has dtype Double", "float32"}},
      {at::randn({3, 8, 1}), {"input 'x' has 3 dimensions", "takes 2"}},
      {at::randn({3, 7}), {"size 7 in dimension 1", "fixed size of 8"}},
      {at::randn({5, 8}), {"size 5 in dimension 0", "allows 1 to 4"}},
  };
  for (const auto& c : cases) {
    std::string message;
    EXPECT_EQ(
        test::status_of([&] { graph::exported::check_inputs(*model, {c.input}, "micro-batch 1 of 2"); }, &message),
        Status::Input);
    for (const auto& s : c.says) EXPECT_NE(message.find(s), std::string::npos) << message;
    EXPECT_NE(message.find("micro-batch 1 of 2"), std::string::npos) << message;
  }
  std::string message;
  EXPECT_EQ(test::status_of([&] { graph::exported::check_inputs(*model, {x, x}); }, &message), Status::Input);
  EXPECT_NE(message.find("takes 1 inputs but 2"), std::string::npos) << message;
  // Two inputs sharing the batch symbol must agree on it.
  auto two = exported("example_code");  // x, y: [batch, 512]
  EXPECT_EQ(test::status_of([&] { graph::exported::check_inputs(*two, {at::randn({4, 512}), at::randn({3, 512})}); },
                            &message),
            Status::Input);
  EXPECT_NE(message.find("the program takes them equal"), std::string::npos) << message;
}

// A hand-written program: forward(x) = relu(x) run through `block` twice, then `head`, each node
// tagged as export tags it. `edit` changes it before it is written.
std::string write_program(const std::string& name, const std::function<void(Json&)>& edit = nullptr) {
  auto node = [](const std::string& target, const std::string& in, const std::string& out, const std::string& stack) {
    return Json{{"target", target},
                {"inputs", {{{"name", "self"}, {"arg", {{"as_tensor", {{"name", in}}}}}, {"kind", 1}}}},
                {"outputs", {{{"as_tensor", {{"name", out}}}}}},
                {"metadata", {{"nn_module_stack", stack}}}};
  };
  const std::string root = "L__self__,,m.Net;";
  const Json meta = {{"dtype", 7},
                     {"sizes", {{{"as_int", 2}}, {{"as_int", 3}}}},
                     {"requires_grad", false},
                     {"device", {{"type", "cpu"}, {"index", nullptr}}},
                     {"strides", {{{"as_int", 3}}, {{"as_int", 1}}}},
                     {"storage_offset", {{"as_int", 0}}},
                     {"layout", 7}};
  Json tensors = Json::object();
  for (const char* v : {"x", "a", "b", "c"}) tensors[v] = meta;
  const std::string leaf = R"({"type": null, "context": null, "children_spec": []})";
  Json program = {
      {"schema_version", {{"major", 8}, {"minor", 17}}},
      {"range_constraints", Json::object()},
      {"graph_module",
       {{"graph",
         {{"inputs", {{{"as_tensor", {{"name", "x"}}}}}},
          {"outputs", {{{"as_tensor", {{"name", "c"}}}}}},
          {"nodes",
           {node("torch.ops.aten.relu.default", "x", "a", root + "L__self__block,block,m.Block"),
            node("torch.ops.aten.relu.default", "a", "b", root + "L__self__block@1,block,m.Block"),
            node("torch.ops.aten.neg.default", "b", "c", root + "L__self__head,head,m.Head")}},
          {"tensor_values", tensors}}},
        {"signature",
         {{"input_specs", {{{"user_input", {{"arg", {{"as_tensor", {{"name", "x"}}}}}}}}}},
          {"output_specs", {{{"user_output", {{"arg", {{"as_tensor", {{"name", "c"}}}}}}}}}}}},
        {"module_call_graph",
         {{{"fqn", ""},
           {"signature",
            {{"inputs", Json::array()},
             {"outputs", Json::array()},
             {"in_spec",
              "[1, {\"type\": \"builtins.tuple\", \"context\": \"null\", \"children_spec\": [{\"type\": "
              "\"builtins.tuple\", \"context\": \"null\", \"children_spec\": [" +
                  leaf + "]}, {\"type\": \"builtins.dict\", \"context\": \"[]\", \"children_spec\": []}]}]"},
             {"out_spec", "[1, " + leaf + "]"},
             {"forward_arg_names", {"x"}}}}},
          {{"fqn", "block"}, {"signature", nullptr}},
          {{"fqn", "head"}, {"signature", nullptr}}}}}}};
  if (edit) edit(program);
  graph::exported::Pt2Writer writer;
  writer.add("models/model.json", program.dump());
  writer.add("data/weights/model_weights_config.json", std::string(R"({"config": {}})"));
  writer.add("data/constants/model_constants_config.json", std::string(R"({"config": {}})"));
  const std::string path = ::testing::TempDir() + name + ".pt2";
  std::ofstream(path, std::ios::binary) << writer.finish();
  return path;
}

TEST(ExportedModel, LaterCallsOfAModuleAreCallSitesOfTheirOwn) {
  auto model = ExportedModel::load(write_program("two_calls"));
  ASSERT_EQ(model->call_sites().size(), 3u);
  EXPECT_EQ(model->call_sites()[1].path, "block");
  EXPECT_EQ(model->call_sites()[1].call, 1);
  EXPECT_EQ(plan_at(model, {"block@1:begin"})->stage(0).nodes.size(), 1u);
  // Without @K, every call of the module is a cut.
  EXPECT_EQ(plan_at(model, {"block:end"})->num_stages(), 3u);
}

TEST(ExportedModel, WhatNativertCannotRunIsRefusedAtLoad) {
  struct Case {
    const char* name;
    std::function<void(Json&)> edit;
    Status status;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"mutation",
       [](Json& p) {
         p["graph_module"]["signature"]["output_specs"].push_back(
             {{"buffer_mutation", {{"arg", {{"name", "a"}}}, {"buffer_name", "cache"}}}});
       },
       Status::Unsupported, "without run_decompositions()"},
      {"model_output",
       [](Json& p) {
         p["graph_module"]["module_call_graph"][0]["signature"]["out_spec"] =
             "[1, {\"type\": \"transformers.modeling_outputs.CausalLMOutputWithPast\", \"context\": \"[]\", "
             "\"children_spec\": []}]";
       },
       Status::Unsupported, ".logits"},
      {"int_input",
       [](Json& p) { p["graph_module"]["signature"]["input_specs"][0]["user_input"]["arg"] = {{"as_int", 3}}; },
       Status::Unsupported, "not a tensor"},
      {"schema_9", [](Json& p) { p["schema_version"]["major"] = 9; }, Status::InvalidFormat, "schema 9"},
      {"unknown_weight",
       [](Json& p) {
         p["graph_module"]["signature"]["input_specs"].push_back(
             {{"parameter", {{"arg", {{"name", "p_w"}}}, {"parameter_name", "w"}}}});
       },
       Status::InvalidFormat, "neither the weights nor the constants config"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::string message;
    const std::string path = write_program(c.name, c.edit);
    EXPECT_EQ(test::status_of([&] { ExportedModel::load(path); }, &message), c.status);
    EXPECT_NE(message.find(c.says), std::string::npos) << message;
    EXPECT_NE(message.find(c.name), std::string::npos) << message;  // the file's name
  }
}

// Operators the calling thread runs, by name, while it lives.
class OperatorCount {
 public:
  OperatorCount() {
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          ++counts()[fn.name()];
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~OperatorCount() { at::removeCallback(handle_); }
  static std::map<std::string, int>& counts() {
    thread_local std::map<std::string, int> c;
    return c;
  }

 private:
  at::CallbackHandle handle_;
};

TEST(ExportedStage, CpuStagesMultiplyByPackedWeightsAsTorchScriptStagesDo) {
  if (!stage::panel_linear_available())
    GTEST_SKIP() << "this CPU has no AVX-512 (or LIBPIPE_PACKED_LINEAR=0): linear layers stay aten.linear";
  auto model = exported("hf_llama");
  auto plan = plan_at(model, {});
  const stage::StageOptions options;
  stage::BuildOptions plain, packed;
  plain.options = packed.options = &options;
  packed.cpu_rewrites = true;
  auto reference = stage::build_stage(*plan, 0, plain);
  auto stage = stage::build_stage(*plan, 0, packed);
  // 2 x 12 tokens.
  const auto ids = at::randint(0, 256, {2, 12}, at::kLong);
  c10::InferenceMode inference;
  OperatorCount count;
  const at::Tensor want = reference->forward({ids}).toTensor();
  EXPECT_EQ(OperatorCount::counts()["pipe::linear_packed_on_demand"], 0);
  const at::Tensor got = stage->forward({ids}).toTensor();
  EXPECT_EQ(OperatorCount::counts()["pipe::linear_packed_on_demand"], 15);  // 2 layers x 7, the head
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max();
  // Packed once: a second call gives the same bits.
  EXPECT_TRUE(at::equal(stage->forward({ids}).toTensor(), got));
}

// A copy of fixture `name` whose record for `fqn` is empty, as export_llm writes a skeleton's caches.
std::string without_data(const std::string& name, const std::string& fqn) {
  auto model = exported(name);
  std::string record;
  for (const auto& w : model->weights())
    if (w.fqn == fqn) record = w.record;
  EXPECT_FALSE(record.empty()) << fqn;
  const std::string path = ::testing::TempDir() + name + "_without_" + fqn + ".pt2";
  caffe2::serialize::PyTorchStreamReader reader(test::fixture("exported/" + name + ".pt2"));
  caffe2::serialize::PyTorchStreamWriter writer(path);
  for (const auto& r : reader.getAllRecords()) {
    if (r == record) {
      writer.writeRecord(r, nullptr, 0);
      continue;
    }
    auto [data, size] = reader.getRecord(r);
    writer.writeRecord(r, data.get(), size);
  }
  writer.writeEndOfFile();
  return path;
}

TEST(ExportedStage, AStageShippedToAWorkerLeavesItsEmptyCachesToTheWorker) {
  // A skeleton's cache (written in place, no data) would be gigabytes of zeros on the wire for a real
  // decoder: the shipped stage keeps its record empty, and the worker's stage allocates it.
  auto model = ExportedModel::load(without_data("state_across_cut", "store.cache"));
  auto plan = plan_at(model, {"store.proj:end"});
  ASSERT_EQ(plan->num_stages(), 2u);
  const stage::StageOptions options;
  auto shipped = stage::ship_stage(*plan, 1, c10::Device(c10::kCPU), options, nullptr);
  auto received = ExportedModel::from_archive(graph::exported::Pt2Archive::from_bytes(shipped.bytes, "shipped"));
  bool found = false;
  for (const auto& w : received->weights()) {
    if (w.fqn != "store.cache") continue;
    found = true;
    EXPECT_EQ(received->archive().size(w.record), 0u);
  }
  EXPECT_TRUE(found);

  stage::BuildOptions build;
  build.options = &options;
  auto first = stage::build_stage(*plan, 0, build);
  auto here = stage::build_stage(*plan, 1, build);
  auto there = stage::receive_stage(std::move(shipped), 1, build, "stage 1 on rank 1");
  c10::InferenceMode inference;
  const at::Tensor x = at::randn({4, 8});
  // Stage 1's arguments: the forward's own (x) or what stage 0 sends on.
  const auto sent = first->forward({x}).toTupleRef().elements();
  std::vector<c10::IValue> arguments;
  for (size_t cv : plan->stage(1).inputs) {
    const auto& value = plan->values()[cv];
    if (value.producer < 0) {
      arguments.emplace_back(x);
      continue;
    }
    const auto& outputs = plan->stage(0).outputs;
    const size_t k = std::find(outputs.begin(), outputs.end(), cv) - outputs.begin();
    ASSERT_LT(k, sent.size()) << value.name;
    arguments.push_back(sent[k]);
  }
  for (int call = 0; call < 2; ++call)  // the second call reads what the first wrote in the cache
    EXPECT_TRUE(at::equal(there->forward(arguments).toTensor(), here->forward(arguments).toTensor()))
        << "call " << call;
}

struct Captured {
  std::mutex mutex;
  std::vector<std::pair<int32_t, std::string>> lines;
};

void capture(void* user_data, int32_t level, const char* message) {
  auto* c = static_cast<Captured*>(user_data);
  std::lock_guard lock(c->mutex);
  c->lines.emplace_back(level, message);
}

TEST(LibTorchLog, C10RecordsGoToLibpipesLogAndOtherTextPassesThrough) {
  log::capture_libtorch_log();
  Captured captured;
  log::set_sink(&capture, &captured, log::Debug);
  testing::internal::CaptureStderr();
  std::cerr << "[W1128 09:12:34.567 KernelFactory.cpp:223] Following ops are missing static kernels:\n"
               "aten.to.dtype: 1,\n";
  std::cerr << "[W1128 09:12:35.000 op.cpp:9] Warning: something the user should know\n";
  std::cerr << "the host's own line\n";
  std::cerr << "[E1128 09:12:36.000 Executor.cpp:339] Exception during executeWithPrefilledFrame\n" << std::flush;
  const std::string passed = testing::internal::GetCapturedStderr();
  log::set_sink(nullptr, nullptr, log::Warning);
  EXPECT_EQ(passed, "the host's own line\n");
  ASSERT_EQ(captured.lines.size(), 3u);
  EXPECT_EQ(captured.lines[0].first, log::Debug);  // nativert's note, with its continuation line
  EXPECT_NE(captured.lines[0].second.find("aten.to.dtype: 1,"), std::string::npos);
  EXPECT_EQ(captured.lines[1].first, log::Warning);  // TORCH_WARN
  EXPECT_EQ(captured.lines[2].first, log::Debug);    // a failure the caller gets as a status
}

// A C++ host's log callback that prints what it gets on std::cerr, the record's own text first.
void echo_to_cerr(void* user_data, int32_t level, const char* message) {
  capture(user_data, level, message);
  const std::string text = message;
  std::cerr << text.substr(text.find('[')) << " (echoed)\n";
}

TEST(LibTorchLog, ACallbackThatWritesToCerrGetsEachRecordOnce) {
  log::capture_libtorch_log();
  Captured captured;
  log::set_sink(&echo_to_cerr, &captured, log::Debug);
  testing::internal::CaptureStderr();
  std::cerr << "[W1128 09:12:35.000 op.cpp:9] Warning: once\n" << std::flush;
  const std::string passed = testing::internal::GetCapturedStderr();
  log::set_sink(nullptr, nullptr, log::Warning);
  ASSERT_EQ(captured.lines.size(), 1u);
  EXPECT_NE(captured.lines[0].second.find("Warning: once"), std::string::npos);
  EXPECT_EQ(passed, "[W1128 09:12:35.000 op.cpp:9] Warning: once (echoed)\n");
}

}  // namespace
}  // namespace libpipe
