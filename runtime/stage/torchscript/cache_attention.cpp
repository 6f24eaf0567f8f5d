#include "runtime/stage/torchscript/cache_attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/cpu/cache_attention.h"
#include "runtime/stage/spare_cores.h"

// MKL's batched GEMM, as the LibTorch wheels for x86 export it from libtorch_cpu (LP64: int sizes).
// Weak: a LibTorch without MKL leaves it null, and nothing is rewritten.
extern "C" {
void cblas_sgemm_batch(int layout, const int* transa, const int* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float** a, const int* lda, const float** b, const int* ldb,
                       const float* beta, float** c, const int* ldc, int group_count, const int* group_size)
    __attribute__((weak));
}

namespace libpipe::stage {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // mkl_cblas.h
const char* const kOpName = "pipe::cache_attention";

bool fusing_available() {
  if (!cblas_sgemm_batch && !cpu::cpu_has_panel_kernels()) return false;
  const char* env = std::getenv("LIBPIPE_CACHE_ATTENTION");
  return !(env && std::strcmp(env, "0") == 0);
}

at::Tensor gathered_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slots, int64_t context, const std::optional<at::Tensor>& mask,
                              std::optional<double> scale, bool enable_gqa) {
  // A cache in another dtype than the queries' is read in theirs (the decoder's .to, which the rewrite folds in).
  return at::scaled_dot_product_attention(query,
                                          k_cache.narrow(2, 0, context).index_select(0, slots).to(query.scalar_type()),
                                          v_cache.narrow(2, 0, context).index_select(0, slots).to(query.scalar_type()),
                                          mask, 0.0, false, scale, enable_gqa);
}

// One group of `count` GEMMs of equal sizes, row-major: c[i] = alpha * op(a[i]) * op(b[i]).
void batched_gemm(bool trans_b, int m, int n, int k, float alpha, std::vector<const float*>& a, int lda,
                  std::vector<const float*>& b, int ldb, std::vector<float*>& c, int ldc) {
  const int transa = kNoTrans, transb = trans_b ? kTrans : kNoTrans, count = static_cast<int>(c.size());
  const float beta = 0.f;
  cblas_sgemm_batch(kRowMajor, &transa, &transb, &m, &n, &k, &alpha, a.data(), &lda, b.data(), &ldb, &beta, c.data(),
                    &ldc, 1, &count);
}

void register_op() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({kOpName, ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::cache_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor slots, "
                          "int context, Tensor? attn_mask, float? scale, bool enable_gqa) -> Tensor",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &cache_attention);
    return true;
  }();
  (void)once;
}

bool is_constant(torch::jit::Value* v, double want) {
  const auto c = torch::jit::toIValue(v);
  return c && ((c->isDouble() && c->toDouble() == want) || (c->isInt() && static_cast<double>(c->toInt()) == want));
}

bool is_false(torch::jit::Value* v) {
  const auto c = torch::jit::toIValue(v);
  return c && c->isBool() && !c->toBool();
}

// `v` = aten::index_select(aten::narrow(cache, 2, 0, context), 0, slots), or that converted to another dtype
// (.to(dtype): a cache stored in another dtype than the model's): the index_select node, else null.
torch::jit::Node* cache_gather(torch::jit::Value* v) {
  torch::jit::Node* select = v->node();
  if (select->kind() == torch::jit::aten::to && select->inputs().size() == 5 &&
      select->input(1)->type()->kind() == c10::TypeKind::IntType)
    select = select->input(0)->node();
  if (select->kind() != torch::jit::aten::index_select || select->inputs().size() != 3 ||
      !is_constant(select->input(1), 0))
    return nullptr;
  torch::jit::Node* narrow = select->input(0)->node();
  if (narrow->kind() != torch::jit::aten::narrow || narrow->inputs().size() != 4 || !is_constant(narrow->input(1), 2) ||
      !is_constant(narrow->input(2), 0))
    return nullptr;
  return select;
}

void collect_attention(torch::jit::Block* block, std::vector<torch::jit::Node*>& out) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::scaled_dot_product_attention && n->inputs().size() == 8) out.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect_attention(b, out);
  }
}

// Removes the gather that fed the attention (its .to, index_select and narrow) as far as nothing else reads it.
void destroy_if_unused(torch::jit::Node* node) {
  while (node && !node->hasUses() &&
         (node->kind() == torch::jit::aten::to || node->kind() == torch::jit::aten::index_select ||
          node->kind() == torch::jit::aten::narrow)) {
    torch::jit::Node* input = node->kind() == torch::jit::aten::narrow ? nullptr : node->input(0)->node();
    node->destroy();
    node = input;
  }
}

cpu::WeightType weight_type(at::ScalarType t) {
  return t == at::kFloat      ? cpu::WeightType::kFloat32
         : t == at::kBFloat16 ? cpu::WeightType::kBFloat16
                              : cpu::WeightType::kFloat16;
}

// The kernels of runtime/cpu/cache_attention.h: every dtype they take, one (row, head) per task, the tasks spread
// over the cores lent to this stage or its intra-op threads.
at::Tensor kernel_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const int64_t* slot, int64_t context, const at::Tensor& allowed, float scale) {
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  cpu::CacheAttention a;
  a.type = weight_type(query.scalar_type());
  a.cache_type = weight_type(k_cache.scalar_type());
  a.query = q.data_ptr();
  a.out = out.data_ptr();
  a.batch = q.size(0);
  a.heads = q.size(1);
  a.queries = q.size(2);
  a.head_dim = q.size(3);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  for (int i = 0; i < 3; ++i) {
    a.cache_stride[i] = k_cache.stride(i);
    a.v_stride[i] = v_cache.stride(i);
  }
  a.kv_heads = k_cache.size(1);
  a.slots = slot;
  a.context = context;
  a.mask = allowed.data_ptr<bool>();
  for (int i = 0; i < 4; ++i) a.mask_stride[i] = allowed.stride(i);
  a.scale = scale;
  SpareCores::for_ranges(cpu::cache_attention_tasks(a), 1, 4,
                         [&](int64_t begin, int64_t end) { cpu::cache_attention(a, begin, end); });
  return out;
}

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

at::Tensor cache_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, int64_t context, const std::optional<at::Tensor>& mask,
                           std::optional<double> scale, bool enable_gqa) {
  const auto fallback = [&] {
    return gathered_attention(query, k_cache, v_cache, slots, context, mask, scale, enable_gqa);
  };
  const bool kernels =
      cpu::cpu_has_panel_kernels() && kernel_dtype(query.scalar_type()) && kernel_dtype(k_cache.scalar_type()) &&
      cpu::cache_attention_types_supported(weight_type(query.scalar_type()), weight_type(k_cache.scalar_type())) &&
      query.dim() == 4 && cpu::cache_attention_head_dim_supported(query.size(3));
  const bool mkl = cblas_sgemm_batch && query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat;
  if ((!kernels && !mkl) || query.dim() != 4 || k_cache.dim() != 4 || v_cache.dim() != 4 || slots.dim() != 1 ||
      v_cache.scalar_type() != k_cache.scalar_type() || slots.scalar_type() != at::kLong || !query.device().is_cpu() ||
      !k_cache.device().is_cpu() || !v_cache.device().is_cpu() || !slots.device().is_cpu() || !mask ||
      !mask->defined() || mask->scalar_type() != at::kBool || mask->dim() > 4)
    return fallback();
  const int64_t b = query.size(0), heads = query.size(1), t = query.size(2), d = query.size(3);
  const int64_t kv = k_cache.size(1), slots_held = k_cache.size(0);
  if (slots.size(0) != b || v_cache.sizes() != k_cache.sizes() || k_cache.size(3) != d || kv < 1 || heads % kv != 0 ||
      (heads != kv && !enable_gqa) || context < 1 || context > k_cache.size(2) || k_cache.stride(3) != 1 ||
      v_cache.stride(3) != 1 || b < 1 || t < 1 || d < 1)
    return fallback();
  const at::Tensor slot_ids = slots.contiguous();
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    if (slot[i] < 0 || slot[i] >= slots_held) return fallback();  // index_select's own error
  at::Tensor allowed;
  try {
    allowed = mask->expand({b, heads, t, context});
  } catch (const c10::Error&) {
    return fallback();  // not broadcastable: SDPA's own error
  }
  if (kernels)
    return kernel_attention(query, k_cache, v_cache, slot, context, allowed,
                            static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d))));

  // Heads of one key-value head are consecutive in q [B, H, T, D]: their r x T rows are one block.
  const int64_t r = heads / kv, rows = r * t;
  const at::Tensor q = query.contiguous();
  at::Tensor scores = at::empty({b, heads, t, context}, q.options());
  const float alpha = static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d)));
  const size_t count = static_cast<size_t>(b * kv);
  std::vector<const float*> a(count), keys(count), values(count);
  std::vector<float*> c(count);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < kv; ++g) {
      const size_t idx = static_cast<size_t>(i * kv + g);
      a[idx] = qp + (i * heads + g * r) * t * d;
      keys[idx] = kp + slot[i] * k_cache.stride(0) + g * k_cache.stride(1);
      values[idx] = vp + slot[i] * v_cache.stride(0) + g * v_cache.stride(1);
      c[idx] = scores.data_ptr<float>() + (i * heads + g * r) * t * context;
    }
  batched_gemm(true, static_cast<int>(rows), static_cast<int>(context), static_cast<int>(d), alpha, a,
               static_cast<int>(d), keys, static_cast<int>(k_cache.stride(2)), c, static_cast<int>(context));
  // Positions a row may not see weigh nothing; a row that sees none comes out NaN, as from SDPA.
  scores.masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  const at::Tensor probs = at::softmax(scores, -1);
  at::Tensor out = at::empty({b, heads, t, d}, q.options());
  for (int64_t i = 0; i < b; ++i)
    for (int64_t g = 0; g < kv; ++g) {
      const size_t idx = static_cast<size_t>(i * kv + g);
      a[idx] = probs.data_ptr<float>() + (i * heads + g * r) * t * context;
      c[idx] = out.data_ptr<float>() + (i * heads + g * r) * t * d;
    }
  batched_gemm(false, static_cast<int>(rows), static_cast<int>(d), static_cast<int>(context), 1.f, a,
               static_cast<int>(context), values, static_cast<int>(v_cache.stride(2)), c, static_cast<int>(d));
  return out;
}

size_t fuse_cache_attention(torch::jit::Module& stage) {
  if (!fusing_available()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  std::vector<torch::jit::Node*> attention;
  collect_attention(graph->block(), attention);
  size_t rewritten = 0;
  for (torch::jit::Node* node : attention) {
    // (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    torch::jit::Node* keys = cache_gather(node->input(1));
    torch::jit::Node* values = cache_gather(node->input(2));
    if (!keys || !values || keys->input(2) != values->input(2) ||
        keys->input(0)->node()->input(3) != values->input(0)->node()->input(3) || !is_constant(node->input(4), 0) ||
        !is_false(node->input(5)))
      continue;
    register_op();
    torch::jit::WithInsertPoint here(node);
    torch::jit::Value* out = graph->insert(
        c10::Symbol::fromQualString(kOpName),
        {node->input(0), keys->input(0)->node()->input(0), values->input(0)->node()->input(0), keys->input(2),
         keys->input(0)->node()->input(3), node->input(3), node->input(6), node->input(7)});
    torch::jit::Node* key_input = node->input(1)->node();
    torch::jit::Node* value_input = node->input(2)->node();
    node->output()->replaceAllUsesWith(out);
    node->destroy();
    destroy_if_unused(key_input);
    destroy_if_unused(value_input);
    ++rewritten;
  }
  return rewritten;
}

}  // namespace libpipe::stage
