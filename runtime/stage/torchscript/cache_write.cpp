#include "runtime/stage/torchscript/cache_write.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace libpipe::stage {

namespace {

const char* const kOpName = "pipe::cache_write_";

bool enabled() {
  const char* env = std::getenv("LIBPIPE_CACHE_WRITE");
  return !(env && std::strcmp(env, "0") == 0);
}

at::Tensor& generic_write(at::Tensor& cache, const at::Tensor& where, const at::Tensor& at, const at::Tensor& values) {
  c10::List<std::optional<at::Tensor>> indices;
  indices.push_back(where);
  indices.push_back(std::nullopt);
  indices.push_back(at);
  return cache.index_put_(indices, values, false);
}

// Every index within [0, size): a negative one wraps in index_put_, one past the end is its error.
bool in_range(const at::Tensor& index, int64_t size) {
  const int64_t* p = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    if (p[i] < 0 || p[i] >= size) return false;
  return true;
}

void register_op() {
  static const bool once = [] {
    if (c10::Dispatcher::singleton().findSchema({kOpName, ""}).has_value()) return true;
    static torch::Library lib(torch::Library::FRAGMENT, "pipe", std::nullopt, __FILE__, __LINE__);
    lib.def(torch::schema("pipe::cache_write_(Tensor(a!) cache, Tensor where, Tensor at, Tensor values) -> Tensor(a!)",
                          c10::AliasAnalysisKind::FROM_SCHEMA),
            &cache_write_);
    return true;
  }();
  (void)once;
}

bool is_none(torch::jit::Value* v) { return v->mustBeNone(); }

bool is_false(torch::jit::Value* v) {
  const auto c = torch::jit::toIValue(v);
  return c && c->isBool() && !c->toBool();
}

bool is_int(torch::jit::Value* v, int64_t want) {
  const auto c = torch::jit::toIValue(v);
  return c && c->isInt() && c->toInt() == want;
}

// `v` = aten::slice(t, 1, None, None, 1), the whole of dimension 1 (the `:` of k_cache[where, :, at]): t, else null.
torch::jit::Value* whole_slice_of(torch::jit::Value* v) {
  torch::jit::Node* n = v->node();
  if (n->kind() != torch::jit::aten::slice || n->inputs().size() != 5 || !is_int(n->input(1), 1) ||
      !is_none(n->input(2)) || !is_none(n->input(3)) || !is_int(n->input(4), 1))
    return nullptr;
  return n->input(0);
}

void collect(torch::jit::Block* block, std::vector<torch::jit::Node*>& out) {
  for (torch::jit::Node* n : block->nodes()) {
    if (n->kind() == torch::jit::aten::index_put_ && n->inputs().size() == 4) out.push_back(n);
    for (torch::jit::Block* b : n->blocks()) collect(b, out);
  }
}

}  // namespace

at::Tensor& cache_write_(at::Tensor& cache, const at::Tensor& where, const at::Tensor& at, const at::Tensor& values) {
  const bool layout = cache.device().is_cpu() && where.device().is_cpu() && at.device().is_cpu() &&
                      values.device().is_cpu() && cache.dim() == 4 && where.dim() == 1 && at.dim() == 1 &&
                      where.scalar_type() == at::kLong && at.scalar_type() == at::kLong &&
                      where.size(0) == at.size(0) && values.dim() == 3 && values.size(0) == where.size(0) &&
                      values.size(1) == cache.size(1) && values.size(2) == cache.size(3) &&
                      values.scalar_type() == cache.scalar_type() && cache.stride(3) == 1 && values.stride(2) == 1 &&
                      !values.is_alias_of(cache);
  if (!layout) return generic_write(cache, where, at, values);
  const at::Tensor slots = where.contiguous(), positions = at.contiguous();
  if (!in_range(slots, cache.size(0)) || !in_range(positions, cache.size(2)))
    return generic_write(cache, where, at, values);
  const int64_t n = slots.size(0), heads = cache.size(1), row_bytes = cache.size(3) * cache.element_size();
  const int64_t el = cache.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  auto* out = static_cast<char*>(cache.data_ptr());
  const auto* in = static_cast<const char*>(values.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(out + (slot[i] * cache.stride(0) + h * cache.stride(1) + position[i] * cache.stride(2)) * el,
                  in + (i * values.stride(0) + h * values.stride(1)) * el, static_cast<size_t>(row_bytes));
  // Written through its pointer: a tensor outside inference mode still learns it changed (autograd's check).
  if (!cache.is_inference()) cache.unsafeGetTensorImpl()->bump_version();
  return cache;
}

size_t fuse_cache_writes(torch::jit::Module& stage) {
  if (!enabled()) return 0;
  auto forward = stage.find_method("forward");
  if (!forward) return 0;
  std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  std::vector<torch::jit::Node*> writes;
  collect(graph->block(), writes);
  size_t rewritten = 0;
  for (torch::jit::Node* node : writes) {
    // index_put_(self, indices, values, accumulate) with indices = [where, None, at], accumulate False.
    torch::jit::Node* list = node->input(1)->node();
    if (!is_false(node->input(3)) || list->kind() != c10::prim::ListConstruct || list->inputs().size() != 3 ||
        !is_none(list->input(1)) || is_none(list->input(0)) || is_none(list->input(2)))
      continue;
    register_op();
    // The write goes to the cache itself rather than to the view of it that the `:` makes (a slice a write, ~3 us):
    // the same elements. The view stays where something else reads it.
    torch::jit::Node* view = node->input(0)->node();
    torch::jit::Value* cache = whole_slice_of(node->input(0));
    torch::jit::WithInsertPoint here(node);
    torch::jit::Value* out =
        graph->insert(c10::Symbol::fromQualString(kOpName),
                      {cache ? cache : node->input(0), list->input(0), list->input(2), node->input(2)});
    node->output()->replaceAllUsesWith(out);
    node->destroy();
    if (!list->hasUses()) list->destroy();
    if (cache && !view->hasUses()) view->destroy();
    ++rewritten;
  }
  return rewritten;
}

}  // namespace libpipe::stage
