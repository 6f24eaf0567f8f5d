#include "runtime/stage/packed_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "runtime/graph/torchscript/model.h"
#include "runtime/log.h"

// MKL's packed GEMM, as the LibTorch wheels for x86 export it from libtorch_cpu. Weak: a LibTorch
// without MKL leaves them null, and nothing is packed.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace libpipe::stage {

namespace {

// CBLAS's enumerations (mkl_cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

const char* const kOpName = "pipe::packed_linear";

bool packing_available() {
  if (!cblas_sgemm_pack_get_size || !cblas_sgemm_pack || !cblas_sgemm_compute) return false;
  const char* env = std::getenv("LIBPIPE_PACKED_LINEAR");
  return !(env && std::strcmp(env, "0") == 0);
}

// input [..., K] times weight [N, K] transposed, plus bias [N]: aten::linear's result, computed from
// `packed` (weight packed by pack()) for kPackedMinRows to kPackedMaxRows rows.
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const bool usable = input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() >= 1 &&
                      input.size(-1) == k && (!bias || !bias->defined() || bias->scalar_type() == at::kFloat);
  const int64_t m = usable ? input.numel() / k : 0;
  // Anything else is aten::linear's to compute, or to refuse with its own message.
  if (!usable || m < kPackedMinRows || m > kPackedMaxRows) return at::linear(input, weight, bias);
  const at::Tensor x = input.reshape({m, k}).contiguous();
  at::Tensor out = at::empty({m, n}, input.options());
  float beta = 0.f;
  if (bias && bias->defined()) {
    // Copied, never a view (expand(...).contiguous() of one row is the bias itself), or the
    // product would add into the weights.
    out.copy_(bias->expand({m, n}));
    beta = 1.f;
  }
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                      x.data_ptr<float>(), static_cast<int>(k), packed.data_ptr<float>(), static_cast<int>(k), beta,
                      out.data_ptr<float>(), static_cast<int>(n));
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

void register_op() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({kOpName, ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::packed_linear(Tensor input, Tensor packed, Tensor weight, Tensor? bias) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &packed_linear);
    return true;
  }();
  (void)once;
}

// The packed form of weight [N, K] (float32, CPU), checked against aten::linear on a few rows: a
// LibTorch whose MKL packs differently is caught here rather than in results. Undefined if the
// check fails.
at::Tensor pack(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, static_cast<int>(kPackedMaxRows), n, k);
  // MKL asks for room for its largest layout; the pages it does not write are never touched.
  at::Tensor packed = at::empty({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, at::kFloat);
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, static_cast<int>(kPackedMaxRows), n, k, 1.f, w.data_ptr<float>(), k,
                   packed.data_ptr<float>());
  // Rows the packed product computes (not the user's random stream).
  const at::Tensor rows = at::sin(at::arange(kPackedMinRows * k, at::kFloat)).view({kPackedMinRows, k});
  const at::Tensor want = at::linear(rows, w);
  const at::Tensor got = packed_linear(rows, packed, w, std::nullopt);
  const double scale = want.abs().max().item<double>() + 1.0;
  if ((got - want).abs().max().item<double>() > 1e-4 * scale) return at::Tensor();
  return packed;
}

void collect_linears(torch::jit::Block* block, std::vector<torch::jit::Node*>& out) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::linear && n->inputs().size() == 3) out.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect_linears(b, out);
  }
}

}  // namespace

size_t pack_linear_weights(torch::jit::Module& stage) {
  if (!packing_available()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  const torch::jit::Value* self = graph->inputs()[0];
  std::set<std::vector<std::string>> written;
  for (const auto& w : graph::in_place_writes(*graph)) written.insert(w.path);

  std::vector<torch::jit::Node*> linears;
  collect_linears(graph->block(), linears);
  std::map<const c10::TensorImpl*, at::Tensor> packs;  // a weight tied to others is packed once
  size_t rewritten = 0, refused = 0;
  for (torch::jit::Node* node : linears) {
    const std::vector<std::string> path = graph::attribute_path(node->input(1), self);
    if (path.empty() || written.count(path)) continue;  // computed, or changing: not a constant weight
    torch::jit::Module owner = stage;
    for (size_t i = 0; i + 1 < path.size(); ++i) owner = owner.attr(path[i]).toModule();
    const c10::IValue value = owner.attr(path.back());
    if (!value.isTensor()) continue;
    const at::Tensor& weight = value.toTensor();
    if (!weight.device().is_cpu() || weight.scalar_type() != at::kFloat || weight.dim() != 2 || weight.numel() == 0)
      continue;
    register_op();
    auto [it, fresh] = packs.try_emplace(weight.unsafeGetTensorImpl());
    if (fresh) it->second = pack(weight);
    if (!it->second.defined()) {
      ++refused;
      continue;
    }
    const std::string name = path.back() + "_packed_for_gemm";
    if (!owner.hasattr(name)) owner.register_buffer(name, it->second);
    torch::jit::WithInsertPoint here(node);
    torch::jit::Value* packed = graph->insertGetAttr(node->input(1)->node()->input(0), name);
    torch::jit::Value* out =
        graph->insert(c10::Symbol::fromQualString(kOpName), {node->input(0), packed, node->input(1), node->input(2)});
    node->output()->replaceAllUsesWith(out);
    node->destroy();
    ++rewritten;
  }
  if (refused)
    log::warning(std::to_string(refused) + " linear layer(s) kept aten::linear: MKL's packed product of their weight " +
                 "did not match aten::linear's");
  return rewritten;
}

}  // namespace libpipe::stage
