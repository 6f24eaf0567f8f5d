#include "runtime/stage/warm_ahead.h"

#include <algorithm>
#include <unordered_map>

#include "runtime/stage/spare_cores.h"

namespace libpipe::stage {

namespace {

struct Successor {
  at::Tensor key;                // the product's first weight: keeps its address from being reused
  std::vector<at::Tensor> next;  // the weights of the product that followed it
};

struct ProductOrder {
  std::unordered_map<const void*, Successor> after;
  at::Tensor last;  // the first weight of the product before this one
};

// Bounds what a thread that calls products of ever new weights (tests) keeps alive.
constexpr size_t kMaxProducts = 4096;

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                            [](const at::Tensor& x, const at::Tensor& y) { return x.is_same(y); });
}

}  // namespace

void warm_next_product(const std::vector<at::Tensor>& weights) {
  if (SpareCores::lent_cores() < 2 || weights.empty()) return;
  thread_local ProductOrder order;
  if (order.last.defined()) {
    if (order.after.size() >= kMaxProducts) order.after.clear();
    Successor& s = order.after[order.last.data_ptr()];
    if (!s.key.is_same(order.last)) s.key = order.last;
    if (!same(s.next, weights)) s.next = weights;
  }
  order.last = weights.front();
  // The products that follow, in order, as far as the helpers may read ahead.
  const at::Tensor* spans[SpareCores::kWarmSpans];
  size_t count = 0, bytes = 0;
  const void* at = weights.front().data_ptr();
  for (size_t hops = 0; hops < SpareCores::kWarmSpans && bytes < SpareCores::kWarmBytes; ++hops) {
    const auto found = order.after.find(at);
    if (found == order.after.end() || found->second.next.empty()) break;
    for (const at::Tensor& w : found->second.next) {
      if (count == SpareCores::kWarmSpans) break;
      spans[count++] = &w;
      bytes += w.nbytes();
    }
    at = found->second.next.front().data_ptr();
    if (at == weights.front().data_ptr()) break;  // around the whole step
  }
  SpareCores::warm(spans, count);
}

}  // namespace libpipe::stage
