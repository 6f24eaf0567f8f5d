#include "runtime/stage/warm_ahead.h"

#include <algorithm>
#include <memory>
#include <unordered_map>

#include "runtime/stage/spare_cores.h"

namespace libpipe::stage {

namespace {

struct Successor {
  at::Tensor key;                   // the product's first weight: keeps its address from being reused
  std::vector<at::Tensor> next;     // the weights of the product that followed it
  const void* next_key = nullptr;   // next's first weight's address
  Successor* next_entry = nullptr;  // its entry (an unordered_map's nodes stay where they are)
  // What follows it, as far as a helper reads ahead: built once per order (`version`), so that in steady decoding a
  // product's post costs a comparison and a reference count, not lookups among weights the product just evicted
  // from the caches.
  SpareCores::WarmList ahead;
  uint64_t ahead_version = 0;
};

struct ProductOrder {
  std::unordered_map<const void*, Successor> after;
  Successor* previous = nullptr;  // the entry of the product before this one
  uint64_t version = 1;           // bumped whenever a product's successor changes
};

// Bounds what a thread that calls products of ever new weights (tests) keeps alive.
constexpr size_t kMaxProducts = 4096;

Successor& entry_for(ProductOrder& order, const at::Tensor& key) {
  Successor& e = order.after[key.data_ptr()];
  if (!e.key.is_same(key)) {
    e = Successor();
    e.key = key;
  }
  return e;
}

// The weights of the products after `from`, in order, until kWarmBytes or back at `from`.
SpareCores::WarmList ahead_of(const ProductOrder& order, const void* from) {
  auto list = std::make_shared<std::vector<at::Tensor>>();
  size_t bytes = 0;
  const void* at = from;
  while (bytes < SpareCores::kWarmBytes && list->size() < order.after.size() * 4) {
    const auto found = order.after.find(at);
    if (found == order.after.end() || found->second.next.empty()) break;
    for (const at::Tensor& w : found->second.next) {
      list->push_back(w);
      bytes += w.nbytes();
    }
    at = found->second.next.front().data_ptr();
    if (at == from) break;  // around the whole step
  }
  return list;
}

}  // namespace

void warm_next_product(const std::vector<at::Tensor>& weights) {
  if (SpareCores::lent_cores() < 2 || weights.empty()) return;
  thread_local ProductOrder order;
  if (order.after.size() >= kMaxProducts) {
    order.after.clear();
    order.previous = nullptr;
    ++order.version;
  }
  const void* key = weights.front().data_ptr();
  Successor* me;
  if (order.previous && order.previous->next_key == key && order.previous->next.size() == weights.size()) {
    me = order.previous->next_entry;  // the same order as last time
  } else {
    me = &entry_for(order, weights.front());
    if (order.previous) {
      order.previous->next = weights;
      order.previous->next_key = key;
      order.previous->next_entry = me;
      ++order.version;
    }
  }
  order.previous = me;
  if (!me->ahead || me->ahead_version != order.version) {
    me->ahead = ahead_of(order, key);
    me->ahead_version = order.version;
  }
  SpareCores::warm(me->ahead);
}

}  // namespace libpipe::stage
