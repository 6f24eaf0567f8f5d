#include "runtime/stage/packed_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "runtime/graph/torchscript/model.h"
#include "runtime/log.h"
#include "runtime/stage/spare_cores.h"

// MKL's packed GEMM, as the LibTorch wheels for x86 export it from libtorch_cpu. Weak: a LibTorch
// without MKL leaves them null, and nothing is packed.
extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
// BLAS's own (column-major) product, for the rows MKL does not pack.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc)
    __attribute__((weak));
}

namespace libpipe::stage {

namespace {

// CBLAS's enumerations (mkl_cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

const char* const kOpName = "pipe::packed_linear";

// Fewer output features than this per chunk are not worth a thread; more (4.5 MiB of weights with
// 576 inputs, 0.4 ms at one core's memory bandwidth) hold a borrowed core too long.
constexpr int64_t kMinChunkRows = 64;
constexpr int64_t kMaxChunkRows = 2048;

bool packing_available() {
  if (!cblas_sgemm_pack_get_size || !cblas_sgemm_pack || !cblas_sgemm_compute || !sgemm_) return false;
  const char* env = std::getenv("LIBPIPE_PACKED_LINEAR");
  return !(env && std::strcmp(env, "0") == 0);
}

// Output features per chunk when a weight of `n` rows is cut into `chunks`: a multiple of 16, so that
// every chunk's outputs start on a 64-byte boundary.
int64_t chunk_rows(int64_t n, int64_t chunks) {
  const int64_t rows = (n + chunks - 1) / chunks;
  return (rows + 15) / 16 * 16;
}

// input [..., K] times weight [N, K] transposed, plus bias [N]: aten::linear's result. `packed` holds
// the weight packed by pack(), one row per chunk of output features; each chunk is one thread's
// work, on the stage's thread or on a core it borrows (SpareCores). The same chunks either way, so
// results do not depend on who computed them. Rows kPackedMinRows to kPackedMaxRows multiply by the
// packed chunks; fewer by the weight's own rows (MKL does not pack there); more: aten::linear.
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t chunks = packed.dim() == 2 ? packed.size(0) : 1;
  const bool usable = input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() >= 1 &&
                      input.size(-1) == k && (!bias || !bias->defined() || bias->scalar_type() == at::kFloat) &&
                      weight.is_contiguous();
  const int64_t m = usable ? input.numel() / k : 0;
  // Anything else is aten::linear's to compute, or to refuse with its own message.
  if (!usable || m > kPackedMaxRows || m == 0 || (m < kPackedMinRows && chunks == 1))
    return at::linear(input, weight, bias);
  const at::Tensor x = input.reshape({m, k}).contiguous();
  at::Tensor out = at::empty({m, n}, input.options());
  float beta = 0.f;
  if (bias && bias->defined()) {
    // Copied, never a view (expand(...).contiguous() of one row is the bias itself), or the
    // product would add into the weights.
    out.copy_(bias->expand({m, n}));
    beta = 1.f;
  }
  const int64_t rows = chunk_rows(n, chunks);
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* ps = packed.data_ptr<float>();
  const int64_t packed_stride = packed.dim() == 2 ? packed.size(1) : 0;
  const bool from_packed = m >= kPackedMinRows;
  SpareCores::for_each(chunks, [&](int64_t c) {
    const int64_t first = c * rows;
    const int nc = static_cast<int>(std::min(rows, n - first)), mi = static_cast<int>(m), ki = static_cast<int>(k),
              ldc = static_cast<int>(n);
    if (nc <= 0) return;
    if (from_packed) {
      cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, mi, nc, ki, xs, ki, ps + c * packed_stride, ki, beta,
                          os + first, ldc);
    } else {
      // Column-major: out^T[first.., :] = W[first.., :] x^T.
      const float one = 1.f;
      sgemm_("T", "N", &nc, &mi, &ki, &one, ws + first * k, &ki, xs, &ki, &beta, os + first, &ldc);
    }
  });
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

// The packed form of weight [N, K] (float32, CPU) in `chunks` chunks of output features (fewer if N is
// small), one row each, checked against aten::linear on a few rows: a LibTorch whose MKL packs
// differently is caught here rather than in results. Undefined if the check fails.
at::Tensor pack(const at::Tensor& weight, int64_t chunks) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  // As many chunks as threads may share the product, more for a large weight (the LM head): a
  // helper leaves between two chunks when the stage it borrowed from needs its core back.
  chunks = chunks <= 1 ? 1 : std::max(chunks, (n + kMaxChunkRows - 1) / kMaxChunkRows);
  chunks = std::max<int64_t>(1, std::min(chunks, n / kMinChunkRows));
  const int64_t rows = chunk_rows(n, chunks);
  chunks = (n + rows - 1) / rows;
  // MKL asks for room for its largest layout; the pages it does not write are never touched.
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, static_cast<int>(kPackedMaxRows), static_cast<int>(rows),
                                                 static_cast<int>(k));
  at::Tensor packed =
      at::empty({chunks, static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, at::kFloat);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * rows, nc = std::min(rows, n - first);
    cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, static_cast<int>(kPackedMaxRows), static_cast<int>(nc),
                     static_cast<int>(k), 1.f, w.data_ptr<float>() + first * k, static_cast<int>(k),
                     packed[c].data_ptr<float>());
  }
  // Rows both products compute (not the user's random stream): the packed one and, cut in
  // chunks, the one on the weight's rows.
  for (int64_t m : {int64_t{1}, kPackedMinRows}) {
    const at::Tensor x = at::sin(at::arange(m * k, at::kFloat)).view({m, k});
    const at::Tensor want = at::linear(x, w);
    const at::Tensor got = packed_linear(x, packed, w, std::nullopt);
    const double scale = want.abs().max().item<double>() + 1.0;
    if ((got - want).abs().max().item<double>() > 1e-4 * scale) return at::Tensor();
  }
  return packed;
}

void collect_linears(torch::jit::Block* block, std::vector<torch::jit::Node*>& out) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::linear && n->inputs().size() == 3) out.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect_linears(b, out);
  }
}

thread_local PackedWeights* current_weights = nullptr;

at::Tensor linear_packed_on_demand(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  if (!current_weights) return at::linear(input, weight, bias);
  const at::Tensor& packed = current_weights->packed(weight);
  if (!packed.defined()) return at::linear(input, weight, bias);
  return packed_linear(input, packed, weight, bias);
}

}  // namespace

PackedWeights::Use::Use(PackedWeights& weights) : previous_(current_weights) { current_weights = &weights; }
PackedWeights::Use::~Use() { current_weights = previous_; }

const at::Tensor& PackedWeights::packed(const at::Tensor& weight) {
  auto [it, fresh] = packed_.try_emplace(weight.data_ptr());
  if (fresh && weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
      weight.numel() > 0 && weight.is_contiguous())
    it->second = pack(weight, chunks_);
  return it->second;
}

bool register_linear_packed_on_demand() {
  static const bool available = [] {
    if (!packing_available()) return false;
    if (!c10::Dispatcher::singleton().findSchema({"pipe::linear_packed_on_demand", ""}).has_value()) {
      static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
      lib.def(torch::schema("pipe::linear_packed_on_demand(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor",
                            c10::AliasAnalysisKind::FROM_SCHEMA),
              &linear_packed_on_demand);
    }
    return true;
  }();
  return available;
}

size_t pack_linear_weights(torch::jit::Module& stage, int chunks) {
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
    if (fresh) it->second = pack(weight, chunks);
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
