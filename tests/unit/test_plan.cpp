#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/import.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/graph/plan.h"
#include "runtime/io/safetensors.h"
#include "runtime/stage/torchscript/stage_module.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;

std::set<std::string> state_dict_keys(const std::string& stem) {
  std::ifstream in(test::fixture(stem + ".state_dict.txt"));
  std::set<std::string> keys;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) keys.insert(line);
  return keys;
}

std::vector<c10::IValue> fixture_inputs(const std::string& stem) {
  auto tensors = io::read_safetensors(test::fixture(stem + ".inputs.safetensors"));
  std::sort(tensors.begin(), tensors.end(), [](auto& a, auto& b) { return a.name < b.name; });
  return {tensors[0].tensor, tensors[1].tensor};  // x, y
}

// Runs the stages one after another by hand, handing crossing values along.
c10::IValue run_stages_by_hand(const Plan& plan, const std::vector<torch::jit::Module>& stages,
                               const std::vector<c10::IValue>& inputs) {
  std::vector<c10::IValue> env(plan.values().size());
  for (size_t id = 0; id < plan.values().size(); ++id)
    if (plan.values()[id].producer < 0) env[id] = inputs[plan.values()[id].input_index];
  c10::IValue out;
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<c10::IValue> args;
    for (size_t id : plan.stage(s).inputs) args.push_back(env[id]);
    out = const_cast<torch::jit::Module&>(stages[s]).forward(args);
    if (s + 1 < stages.size()) {
      const auto& items = out.toTupleRef().elements();
      for (size_t k = 0; k < plan.stage(s).outputs.size(); ++k) env[plan.stage(s).outputs[k]] = items[k];
    }
  }
  return out;
}

struct SeedCase {
  const char* file;
  const char* stem;
  size_t stages;
};

void PrintTo(const SeedCase& c, std::ostream* os) { *os << c.file; }

class SeedModelPlan : public ::testing::TestWithParam<SeedCase> {};

TEST_P(SeedModelPlan, StagesHoldOriginalNamesAndComputeTheModel) {
  const SeedCase& c = GetParam();
  auto model = Model::load(test::fixture(c.file));
  auto plan = Plan::from_markers(model);
  ASSERT_EQ(plan->num_stages(), c.stages);

  const auto keys = state_dict_keys(c.stem);
  std::vector<torch::jit::Module> stages;
  for (size_t s = 0; s < plan->num_stages(); ++s) {
    stages.push_back(stage::build_stage_module(*plan, s));
    std::set<std::string> module_names;
    for (const auto& p : stages.back().named_parameters()) module_names.insert(p.name);
    for (const auto& b : stages.back().named_buffers()) module_names.insert(b.name);
    std::set<std::string> plan_names(plan->stage(s).parameters.begin(), plan->stage(s).parameters.end());
    plan_names.insert(plan->stage(s).buffers.begin(), plan->stage(s).buffers.end());
    EXPECT_EQ(module_names, plan_names) << "stage " << s << " registers exactly what the plan lists";
    for (const auto& name : module_names) EXPECT_TRUE(keys.count(name)) << name << " is not a state_dict key";
  }

  auto inputs = fixture_inputs(c.stem);
  c10::IValue expected = const_cast<torch::jit::Module&>(model->module()).forward(inputs);
  c10::IValue got = run_stages_by_hand(*plan, stages, inputs);
  EXPECT_TRUE(at::allclose(got.toTensor(), expected.toTensor(), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Seeds, SeedModelPlan,
                         ::testing::Values(SeedCase{"example_code.traced.pt", "example_code", 4},
                                           SeedCase{"example_code.scripted.pt", "example_code", 4},
                                           SeedCase{"multi_mlp.traced.pt", "multi_mlp", 4},
                                           SeedCase{"param_alias.scripted.pt", "param_alias", 2}),
                         [](const auto& info) {
                           std::string n = info.param.file;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

const graph::CrossingValue* find_value(const Plan& plan, int producer, std::vector<int> consumers) {
  for (const auto& v : plan.values())
    if (v.producer == producer && v.consumers == consumers) return &v;
  return nullptr;
}

TEST(Plan, SkipConnectionGoesStraightFromStage0ToStage2) {
  for (const char* file : {"example_code.traced.pt", "example_code.scripted.pt"}) {
    auto plan = Plan::from_markers(Model::load(test::fixture(file)));
    // The skip value is defined in stage 0 and read only by stage 2: it is no input of stage 1.
    EXPECT_NE(find_value(*plan, 0, {2}), nullptr) << file;
    EXPECT_NE(find_value(*plan, 0, {1}), nullptr) << file;
    EXPECT_EQ(plan->stage(1).inputs.size(), 1u) << file;
    EXPECT_EQ(plan->stage(2).inputs.size(), 2u) << file;
    // mm_param1 is replicated to both stages that read it.
    for (size_t s : {0u, 1u}) {
      const auto& p = plan->stage(s).parameters;
      EXPECT_NE(std::find(p.begin(), p.end(), "mm_param1"), p.end()) << file << " stage " << s;
    }
    EXPECT_EQ(plan->stage(0).param_bytes, 512u * 512u * 4u);
  }
}

TEST(Plan, InputReadOnlyByTheLastStageGoesOnlyThere) {
  auto plan = Plan::from_markers(Model::load(test::fixture("multi_mlp.traced.pt")));
  const auto* y = find_value(*plan, -1, {3});
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->name, "y");
  EXPECT_EQ(y->input_index, 1u);
  ASSERT_EQ(plan->stage(0).inputs.size(), 1u);
  EXPECT_EQ(plan->values()[plan->stage(0).inputs[0]].name, "x");
}

TEST(Plan, DescribeJsonListsStagesAndFlows) {
  auto plan = Plan::from_markers(Model::load(test::fixture("example_code.traced.pt")));
  const std::string json = plan->describe_json();
  EXPECT_NE(json.find("\"num_stages\":4"), std::string::npos) << json;
  EXPECT_NE(json.find("\"parameters\":[\"mm_param2\"]"), std::string::npos) << json;
  EXPECT_NE(json.find("\"from\":\"input\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"to\":\"caller\""), std::string::npos) << json;
}

TEST(Plan, OneGroupIsTheWholeModel) {
  auto model = Model::load(test::fixture("example_code.traced.pt"));
  std::vector<torch::jit::Node*> all;
  for (auto* n : model->graph()->nodes())
    if (n->kind() != c10::Symbol::fromQualString("pipe::split") &&
        !graph::is_floating_node(n, model->graph()->inputs()[0]))
      all.push_back(n);
  auto plan = Plan::from_groups(model, {all});
  ASSERT_EQ(plan->num_stages(), 1u);
  auto stage = stage::build_stage_module(*plan, 0);
  auto inputs = fixture_inputs("example_code");
  auto got = stage.forward(inputs).toTensor();
  auto want = const_cast<torch::jit::Module&>(model->module()).forward(inputs).toTensor();
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5));
}

TEST(Plan, StageModuleSavesAndReloadsAsStandaloneTorchScript) {
  auto plan = Plan::from_markers(Model::load(test::fixture("example_code.traced.pt")));
  auto stage = stage::build_stage_module(*plan, 2);
  const std::string path = ::testing::TempDir() + "stage2.pt";
  stage.save(path);
  auto reloaded = torch::jit::load(path);
  std::vector<c10::IValue> args = {at::randn({4, 512}), at::randn({4, 512})};
  auto a = stage.forward(args).toTupleRef().elements()[0].toTensor();
  auto b = reloaded.forward(args).toTupleRef().elements()[0].toTensor();
  EXPECT_TRUE(at::equal(a, b));
  std::set<std::string> names;
  for (const auto& p : reloaded.named_parameters()) names.insert(p.name);
  EXPECT_EQ(names, std::set<std::string>{"mm_param2"});
}

Status split_status(const char* file, std::string* message) {
  try {
    Plan::from_markers(Model::load(test::fixture(file)));
  } catch (const Error& e) {
    *message = e.what();
    return e.status();
  }
  return Status::Ok;
}

TEST(Plan, MarkerInsideABranchIsRefused) {
  std::string msg;
  EXPECT_EQ(split_status("marker_in_branch.scripted.pt", &msg), Status::Split);
  EXPECT_NE(msg.find("inside an if/loop block"), std::string::npos) << msg;
}

TEST(Plan, RepeatedMarkerWouldLeaveAnEmptyStage) {
  std::string msg;
  EXPECT_EQ(split_status("repeated_marker.traced.pt", &msg), Status::Split);
  EXPECT_NE(msg.find("stage 1 would be empty"), std::string::npos) << msg;
}

TEST(Model, MissingAndJunkFilesAreRefused) {
  std::string msg;
  try {
    Model::load("/nonexistent/model.pt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::NotFound);
  }
  try {
    Model::load(test::fixture("example_code.inputs.safetensors"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidFormat);
    EXPECT_NE(std::string(e.what()).find("not a loadable model archive"), std::string::npos);
  }
}

TEST(Model, InputNamesComeFromForwardsSignature) {
  auto model = Model::load(test::fixture("example_code.scripted.pt"));
  EXPECT_EQ(model->input_names(), (std::vector<std::string>{"x", "y"}));
}

}  // namespace
}  // namespace libpipe
