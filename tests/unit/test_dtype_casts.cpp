// The dtype pass (runtime/stage/dtype_casts): a model written as a float32 trace records it,
// with float32 as a constant in every cast, run with its weights and inputs converted to bfloat16
// or float16. The references are ATen calls written out here the way eager code in the target
// dtype computes (casting back with `.to(input_dtype)`, promoting where it asks for float32).
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "fixtures.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/stage/torchscript/stage_module.h"
#include "runtime/stage/torchscript/weights.h"

namespace libpipe {
namespace {

using graph::Model;
using graph::Plan;

// A model from TorchScript source, saved and loaded as libpipe loads any model file.
std::shared_ptr<const Model> model_from(const std::string& source, const std::map<std::string, at::Tensor>& params,
                                        const std::map<std::string, at::Tensor>& buffers = {}) {
  torch::jit::Module m("Net");
  for (const auto& [name, t] : params) m.register_parameter(name, t, false);
  for (const auto& [name, t] : buffers) m.register_buffer(name, t);
  m.define(source);
  char path[] = "/tmp/libpipe-dtype-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  m.save(path);
  auto model = Model::load(path);
  std::filesystem::remove(path);
  return model;
}

// Two stages, the second starting at the model's `n`-th cast (aten::to) from the start.
std::shared_ptr<Plan> cut_at_cast(const std::shared_ptr<const Model>& model, int n) {
  std::vector<std::vector<torch::jit::Node*>> groups(1);
  const torch::jit::Value* self = model->graph()->inputs()[0];
  for (torch::jit::Node* node : model->graph()->nodes()) {
    if (graph::is_floating_node(node, self)) continue;
    if (node->kind() == torch::jit::aten::to && n-- == 0) groups.emplace_back();
    groups.back().push_back(node);
  }
  return Plan::from_groups(model, groups);
}

std::vector<torch::jit::Module> build(const Plan& plan, std::optional<at::ScalarType> dtype) {
  std::vector<torch::jit::Module> stages;
  stage::StageOptions options;
  options.dtype = dtype;
  for (size_t s = 0; s < plan.num_stages(); ++s) {
    stages.push_back(stage::build_stage_module(plan, s, c10::Device(c10::kCPU), dtype));
    stage::load_stage_weights(stages.back(), plan, s, options, nullptr);
  }
  return stages;
}

// Runs the stages in order, handing each the values the plan says it reads.
c10::IValue run(const Plan& plan, std::vector<torch::jit::Module>& stages, const std::vector<c10::IValue>& inputs) {
  std::vector<c10::IValue> env(plan.values().size());
  for (size_t id = 0; id < plan.values().size(); ++id)
    if (plan.values()[id].producer < 0) env[id] = inputs[plan.values()[id].input_index];
  c10::IValue out;
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<c10::IValue> args;
    for (size_t id : plan.stage(s).inputs) args.push_back(env[id]);
    out = stages[s].forward(args);
    if (s + 1 < stages.size())
      for (size_t k = 0; k < plan.stage(s).outputs.size(); ++k)
        env[plan.stage(s).outputs[k]] = out.toTupleRef().elements()[k];
  }
  return out;
}

// Casts to `dtype` in a stage's graph (the pass's, or the model's own).
size_t casts_to(const torch::jit::Module& stage, at::ScalarType dtype) {
  size_t n = 0;
  for (const torch::jit::Node* node : stage.get_method("forward").graph()->nodes())
    if (node->kind() == torch::jit::aten::to && node->inputs().size() > 1) {
      auto value = torch::jit::toIValue(node->input(1));
      n += value && value->isInt() && value->toInt() == static_cast<int64_t>(dtype);
    }
  return n;
}

// Hugging Face's RMSNorm and residual as a float32 trace records them: the residual is the
// widened copy (tracing maps the Python tensor to the latest value), the cast back is a cast to
// float32 (6). Cut before that cast (cut_at_cast(model, 1)), so stage 1 must know what stage 0
// hands it.
const char* kNormSource = R"JIT(
def forward(self, x):
    y = torch.linear(x, self.w0)
    r = y.to(6)
    v = r.pow(2).mean(-1, keepdim=True)
    h = r * torch.rsqrt(v + 1e-6)
    h = self.norm * h.to(6)
    return torch.linear(h, self.w1) + r
)JIT";

TEST(DtypeCasts, CastsBackWhereEagerCodeDoesAndKeepsTheUpcasts) {
  at::manual_seed(0);
  const at::Tensor w0 = at::randn({16, 16}), w1 = at::randn({16, 16}), norm = 1 + 0.1 * at::randn({16});
  auto model = model_from(kNormSource, {{"w0", w0}, {"w1", w1}, {"norm", norm}});
  auto plan = cut_at_cast(model, 1);
  ASSERT_EQ(plan->num_stages(), 2u);
  const at::Tensor x = at::randn({4, 16});

  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto stages = build(*plan, dtype);
    const at::Tensor got = run(*plan, stages, {x.to(dtype)}).toTensor();

    // Eager code in `dtype`: the norm's statistics in float32, cast back before the weight; the
    // residual is the dtype's own tensor.
    const at::Tensor y = at::linear(x.to(dtype), w0.to(dtype));
    const at::Tensor r = y.to(at::kFloat);
    const at::Tensor h = r * at::rsqrt(r.pow(2).mean(-1, true) + 1e-6);
    const at::Tensor want = at::linear(norm.to(dtype) * h.to(dtype), w1.to(dtype)) + y;
    EXPECT_EQ(got.scalar_type(), dtype);
    EXPECT_TRUE(at::equal(got, want)) << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max();

    // The norm computed in `dtype` throughout would be a different model: the test can tell.
    const at::Tensor yb = at::linear(x.to(dtype), w0.to(dtype));
    const at::Tensor hb = yb * at::rsqrt(yb.pow(2).mean(-1, true) + 1e-6);
    EXPECT_FALSE(at::equal(got, at::linear(norm.to(dtype) * hb, w1.to(dtype)) + yb));

    EXPECT_EQ(casts_to(stages[0], dtype), 0u) << "stage 0 hands float32 on, as eager code would";
    EXPECT_EQ(casts_to(stages[1], dtype), 2u) << "the norm's cast back and the residual";
  }
}

TEST(DtypeCasts, FloatComputedOnPurposePromotesAsInPyTorch) {
  // A rotary embedding that asks for float32 positions: eager bfloat16 code multiplies them with
  // the bfloat16 inverse frequencies in float32 (PyTorch promotes), so the angles stay exact.
  auto model = model_from(R"JIT(
def forward(self, x):
    t = torch.arange(x.size(1), dtype=6)
    return torch.outer(t, self.inv_freq).cos()
)JIT",
                          {}, {{"inv_freq", 1.0 / at::pow(10000.0, at::arange(0, 8, 2).to(at::kFloat) / 8)}});
  auto plan = Plan::from_markers(model);
  auto stages = build(*plan, at::kBFloat16);
  const at::Tensor x = at::randn({2, 300}).to(at::kBFloat16);
  const at::Tensor got = run(*plan, stages, {x}).toTensor();
  const at::Tensor inv_freq = (1.0 / at::pow(10000.0, at::arange(0, 8, 2).to(at::kFloat) / 8)).to(at::kBFloat16);
  const at::Tensor want = at::outer(at::arange(300, at::kFloat), inv_freq).cos();
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(got, want));
}

TEST(DtypeCasts, CastBackSaturatesAtTheTargetRange) {
  // A float32 mask at torch.finfo(torch.float32).min, cast back where it meets float16 scores:
  // eager float16 code builds it at finfo(float16).min, which is what the cast gives, not -inf.
  at::manual_seed(0);
  const at::Tensor w = at::randn({8, 8});
  auto model = model_from(R"JIT(
def forward(self, x):
    s = torch.linear(x, self.w)
    m = torch.full([8], -3.4028234663852886e38, dtype=6)
    return s + m.to(6)
)JIT",
                          {{"w", w}});
  auto plan = Plan::from_markers(model);
  auto stages = build(*plan, at::kHalf);
  const at::Tensor x = at::randn({2, 8});
  const at::Tensor got = run(*plan, stages, {x.to(at::kHalf)}).toTensor();
  const at::Tensor want = at::linear(x.to(at::kHalf), w.to(at::kHalf)) + at::full({8}, -65504.0, at::kHalf);
  EXPECT_TRUE(at::isfinite(got).all().item<bool>());
  EXPECT_TRUE(at::equal(got, want));
}

TEST(DtypeCasts, UndecidableCastIsRefusedWhenTheStageIsBuilt) {
  // A forward argument may be bfloat16 (converted) or an integer tensor, so a matmul of it with a
  // float32-fixed value cannot be given a cast before run time.
  auto model = model_from(R"JIT(
def forward(self, x):
    return torch.matmul(x, self.table.to(6))
)JIT",
                          {}, {{"table", at::randn({8, 8})}});
  auto plan = Plan::from_markers(model);
  std::string message;
  EXPECT_EQ(
      test::status_of([&] { stage::build_stage_module(*plan, 0, c10::Device(c10::kCPU), at::kBFloat16); }, &message),
      Status::Unsupported);
  for (const char* needle : {"stage 0", "`aten::matmul`", "`aten::to`", "bfloat16", "model.to(torch.bfloat16)"})
    EXPECT_NE(message.find(needle), std::string::npos) << needle << " in: " << message;
  // The model's own dtype, or none, needs nothing.
  EXPECT_EQ(test::status_of([&] { build(*plan, at::kFloat); }), Status::Ok);
  EXPECT_EQ(test::status_of([&] { build(*plan, std::nullopt); }), Status::Ok);
}

TEST(DtypeCasts, TheModelsOwnDtypeLeavesTheGraphAsTraced) {
  at::manual_seed(0);
  auto model =
      model_from(kNormSource, {{"w0", at::randn({16, 16})}, {"w1", at::randn({16, 16})}, {"norm", at::ones(16)}});
  auto plan = Plan::from_markers(model);
  auto plain = build(*plan, std::nullopt), same = build(*plan, at::kFloat);
  for (size_t s = 0; s < plan->num_stages(); ++s) {
    const auto& a = *plain[s].get_method("forward").graph();
    const auto& b = *same[s].get_method("forward").graph();
    EXPECT_EQ(std::distance(a.nodes().begin(), a.nodes().end()), std::distance(b.nodes().begin(), b.nodes().end()));
  }
}

}  // namespace
}  // namespace libpipe
