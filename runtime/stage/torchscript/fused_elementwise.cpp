#include "runtime/stage/torchscript/fused_elementwise.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/subgraph_matcher.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/subgraph_rewrite.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "runtime/cpu/elementwise.h"
#include "runtime/stage/spare_cores.h"

namespace libpipe::stage {

namespace {

std::optional<cpu::WeightType> kernel_type(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || !cpu::cpu_has_panel_kernels()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kFloat: return cpu::WeightType::kFloat32;
    case at::kBFloat16: return cpu::WeightType::kBFloat16;
    case at::kHalf: return cpu::WeightType::kFloat16;
    default: return std::nullopt;
  }
}

// Rows per piece when a kernel's rows are spread over threads: below this a piece costs more to hand over.
int64_t rows_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto type = kernel_type(x);
  if (!type || weight.scalar_type() != x.scalar_type() || !weight.device().is_cpu() || weight.dim() != 1 ||
      x.dim() < 1 || x.size(-1) != weight.size(0) || x.numel() == 0) {
    // The pattern's own operators.
    const at::Tensor h = x.to(at::kFloat);
    return weight * (h * at::rsqrt(h.pow(2).mean({-1}, true) + eps)).to(x.scalar_type());
  }
  const at::Tensor in = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t cols = in.size(-1), rows = in.numel() / cols;
  SpareCores::for_ranges(rows, rows_grain(cols), rows, [&](int64_t begin, int64_t end) {
    cpu::rms_norm(*type, in.data_ptr(), w.data_ptr(), out.data_ptr(), cols, static_cast<float>(eps), begin, end);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                                   double eps) {
  const auto type = kernel_type(x);
  if (!type || y.scalar_type() != x.scalar_type() || !y.device().is_cpu() || y.sizes() != x.sizes() ||
      weight.scalar_type() != x.scalar_type() || !weight.device().is_cpu() || weight.dim() != 1 || x.dim() < 1 ||
      x.size(-1) != weight.size(0) || x.numel() == 0) {
    at::Tensor sum = at::add(x, y);  // the pattern's own operators (broadcasts, promotions, their errors)
    return {sum, rms_norm_op(sum, weight, eps)};
  }
  const at::Tensor a = x.contiguous(), b = y.contiguous(), w = weight.contiguous();
  at::Tensor sum = at::empty_like(a), out = at::empty_like(a);
  const int64_t cols = a.size(-1), rows = a.numel() / cols;
  SpareCores::for_ranges(rows, rows_grain(cols), rows, [&](int64_t begin, int64_t end) {
    cpu::add_rms_norm(*type, a.data_ptr(), b.data_ptr(), w.data_ptr(), sum.data_ptr(), out.data_ptr(), cols,
                      static_cast<float>(eps), begin, end);
  });
  return {sum, out};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// The kernel's layout: x [N, H, D] and cos/sin [N, 1, D] with contiguous rows (a decoder's packed tokens and each
// token's angles, unsqueezed for the heads).
bool rotary_layout(const at::Tensor& x, const at::Tensor& angles) {
  return angles.dim() == 3 && x.dim() == 3 && angles.size(0) == x.size(0) && angles.size(1) == 1 &&
         angles.size(2) == x.size(2) && angles.stride(2) == 1 && (angles.size(0) == 1 || angles.stride(0) == x.size(2));
}

at::Tensor rotary_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto type = kernel_type(x);
  if (!type || cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type() || !cos.device().is_cpu() ||
      !sin.device().is_cpu() || !rotary_layout(x, cos) || !rotary_layout(x, sin) || x.numel() == 0 ||
      x.size(2) % 2 != 0)
    return x * cos + rotate_half(x) * sin;
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t heads = in.size(1), dim = in.size(2), rows = in.size(0) * heads;
  SpareCores::for_ranges(rows, rows_grain(dim), rows, [&](int64_t begin, int64_t end) {
    cpu::rotary(*type, in.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), dim, heads, begin, end);
  });
  return out;
}

at::Tensor silu_mul_op(const at::Tensor& gate, const at::Tensor& up) {
  const auto type = kernel_type(gate);
  if (!type || up.scalar_type() != gate.scalar_type() || !up.device().is_cpu() || up.sizes() != gate.sizes() ||
      gate.numel() == 0)
    return at::silu(gate) * up;
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor out = at::empty_like(g);
  SpareCores::for_ranges(g.numel(), 16384, g.numel(), [&](int64_t begin, int64_t end) {
    cpu::silu_mul(*type, g.data_ptr(), u.data_ptr(), out.data_ptr(), begin, end);
  });
  return out;
}

void register_ops() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({"pipe::rms_norm", ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &rms_norm_op);
    lib.def(torch::schema("pipe::add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &add_rms_norm_op);
    lib.def(
        torch::schema("pipe::rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor", c10::AliasAnalysisKind::FROM_SCHEMA),
        &rotary_op);
    lib.def(torch::schema("pipe::silu_mul(Tensor gate, Tensor up) -> Tensor", c10::AliasAnalysisKind::FROM_SCHEMA),
            &silu_mul_op);
    return true;
  }();
  (void)once;
}

bool constant_is(const torch::jit::Match& match, const std::unordered_map<std::string, torch::jit::Value*>& vmap,
                 const char* name, const c10::IValue& want) {
  const auto value = torch::jit::toIValue(match.values_map.at(vmap.at(name)));
  if (!value) return false;
  if (want.isNone()) return value->isNone();
  if (want.isBool()) return value->isBool() && value->toBool() == want.toBool();
  if (want.isInt()) return value->isInt() && value->toInt() == want.toInt();
  return false;
}

// LlamaRMSNorm, as libpipe.decoders.llama.RMSNorm compiles. Every constant is an input of its own (the graph may hold
// one constant node per use), checked by the match's filter.
const char* const kRmsNorm = R"IR(
graph(%x, %eps, %weight, %f32, %nb1, %cp1, %mf1, %two, %neg1, %keep, %dt, %alpha, %nb2, %cp2, %mf2):
  %dtype = prim::dtype(%x)
  %h = aten::to(%x, %f32, %nb1, %cp1, %mf1)
  %p = aten::pow(%h, %two)
  %dims = prim::ListConstruct(%neg1)
  %m = aten::mean(%p, %dims, %keep, %dt)
  %a = aten::add(%m, %eps, %alpha)
  %r = aten::rsqrt(%a)
  %n = aten::mul(%h, %r)
  %c = aten::to(%n, %dtype, %nb2, %cp2, %mf2)
  %y = aten::mul(%weight, %c)
  return (%y))IR";
const char* const kRmsNormFused = R"IR(
graph(%x, %eps, %weight, %f32, %nb1, %cp1, %mf1, %two, %neg1, %keep, %dt, %alpha, %nb2, %cp2, %mf2):
  %y = pipe::rms_norm(%x, %weight, %eps)
  return (%y))IR";

// A residual connection and the RMSNorm that reads it (after kRmsNorm is rewritten): the sum stays an output, the
// residual stream the next connection adds to. Only a Tensor + Tensor add with alpha 1 (the match's filter). The norm's
// output comes first: the matcher starts from the node of the first output and walks back to the inputs.
const char* const kAddRmsNorm = R"IR(
graph(%x, %y, %alpha, %weight, %eps):
  %sum = aten::add(%x, %y, %alpha)
  %out = pipe::rms_norm(%sum, %weight, %eps)
  return (%out, %sum))IR";
const char* const kAddRmsNormFused = R"IR(
graph(%x, %y, %alpha, %weight, %eps):
  %sum : Tensor, %out : Tensor = pipe::add_rms_norm(%x, %y, %weight, %eps)
  return (%out, %sum))IR";

// x * cos + rotate_half(x) * sin.
const char* const kRotary = R"IR(
graph(%x, %cos, %sin, %last_dim, %two, %dim1, %end1, %step1, %dim2, %start2, %step2, %dim3, %alpha):
  %a = aten::mul(%x, %cos)
  %sizes = aten::size(%x)
  %last = aten::__getitem__(%sizes, %last_dim)
  %half = aten::floordiv(%last, %two)
  %x2 = aten::slice(%x, %dim1, %half, %end1, %step1)
  %n = aten::neg(%x2)
  %x1 = aten::slice(%x, %dim2, %start2, %half, %step2)
  %parts = prim::ListConstruct(%n, %x1)
  %r = aten::cat(%parts, %dim3)
  %b = aten::mul(%r, %sin)
  %y = aten::add(%a, %b, %alpha)
  return (%y))IR";
const char* const kRotaryFused = R"IR(
graph(%x, %cos, %sin, %last_dim, %two, %dim1, %end1, %step1, %dim2, %start2, %step2, %dim3, %alpha):
  %y = pipe::rotary(%x, %cos, %sin)
  return (%y))IR";

const char* const kSiluMul = R"IR(
graph(%gate, %up):
  %s = aten::silu(%gate)
  %y = aten::mul(%s, %up)
  return (%y))IR";
const char* const kSiluMulFused = R"IR(
graph(%gate, %up):
  %y = pipe::silu_mul(%gate, %up)
  return (%y))IR";

size_t count(const torch::jit::Block* block, c10::Symbol kind) {
  size_t n = 0;
  for (const torch::jit::Node* node : block->nodes()) {
    n += node->kind() == kind;
    for (const torch::jit::Block* b : node->blocks()) n += count(b, kind);
  }
  return n;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_op(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                                double eps) {
  return add_rms_norm_op(x, y, weight, eps);
}
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return rotary_op(x, cos, sin); }
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) { return silu_mul_op(gate, up); }

size_t fuse_elementwise(torch::jit::Module& stage) {
  const char* env = std::getenv("LIBPIPE_FUSED_ELEMENTWISE");
  if ((env && std::strcmp(env, "0") == 0) || !cpu::cpu_has_panel_kernels()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  register_ops();
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  // Branches on constants go first: F.silu compiles to `if inplace: silu_ else: silu` with inplace False.
  torch::jit::ConstantPropagationImmutableTypes(graph);
  using VMap = std::unordered_map<std::string, torch::jit::Value*>;
  {
    torch::jit::SubgraphRewriter rewriter;
    rewriter.RegisterRewritePattern(kRmsNorm, kRmsNormFused);
    rewriter.runOnGraph(graph, [](const torch::jit::Match& m, const VMap& v) {
      const c10::IValue none, no(false), one(int64_t{1});
      return constant_is(m, v, "f32", static_cast<int64_t>(at::kFloat)) && constant_is(m, v, "nb1", no) &&
             constant_is(m, v, "cp1", no) && constant_is(m, v, "mf1", none) && constant_is(m, v, "two", int64_t{2}) &&
             constant_is(m, v, "neg1", int64_t{-1}) && constant_is(m, v, "keep", true) &&
             constant_is(m, v, "dt", none) && constant_is(m, v, "alpha", one) && constant_is(m, v, "nb2", no) &&
             constant_is(m, v, "cp2", no) && constant_is(m, v, "mf2", none);
    });
  }
  const char* residual_env = std::getenv("LIBPIPE_FUSED_RESIDUAL");
  if (!residual_env || std::strcmp(residual_env, "0") != 0) {
    torch::jit::SubgraphRewriter rewriter;
    rewriter.RegisterRewritePattern(kAddRmsNorm, kAddRmsNormFused);
    rewriter.runOnGraph(graph, [](const torch::jit::Match& m, const VMap& v) {
      const auto is_tensor = [&](const char* name) {
        return m.values_map.at(v.at(name))->type()->isSubtypeOf(*c10::TensorType::get());
      };
      return is_tensor("x") && is_tensor("y") && constant_is(m, v, "alpha", int64_t{1});
    });
  }
  {
    torch::jit::SubgraphRewriter rewriter;
    rewriter.RegisterRewritePattern(kRotary, kRotaryFused);
    rewriter.runOnGraph(graph, [](const torch::jit::Match& m, const VMap& v) {
      const c10::IValue none, last(int64_t{-1}), one(int64_t{1});
      return constant_is(m, v, "last_dim", last) && constant_is(m, v, "two", int64_t{2}) &&
             constant_is(m, v, "dim1", last) && constant_is(m, v, "end1", none) && constant_is(m, v, "step1", one) &&
             constant_is(m, v, "dim2", last) && constant_is(m, v, "start2", none) && constant_is(m, v, "step2", one) &&
             constant_is(m, v, "dim3", last) && constant_is(m, v, "alpha", one);
    });
  }
  {
    torch::jit::SubgraphRewriter rewriter;
    rewriter.RegisterRewritePattern(kSiluMul, kSiluMulFused);
    rewriter.runOnGraph(graph);
  }
  return count(graph->block(), c10::Symbol::fromQualString("pipe::rms_norm")) +
         count(graph->block(), c10::Symbol::fromQualString("pipe::add_rms_norm")) +
         count(graph->block(), c10::Symbol::fromQualString("pipe::rotary")) +
         count(graph->block(), c10::Symbol::fromQualString("pipe::silu_mul"));
}

}  // namespace libpipe::stage
