// Attention of a few query rows over their KV-cache slots, read where they lie, in the cache's own dtype.
//
// A decode step attends one query per sequence and head over that sequence's cached keys and values:
// [context, head_dim] per key-value head, a few tens of KiB, read once. The work per (row, head) is small
// and its shape changes every step (the context grows), which is where batched GEMM calls (MKL's
// cblas_sgemm_batch, float32 only) and SDPA's generic path spend their time on set-up and copies. Here one
// task computes one key-value head of one row (of a prompt chunk's row, up to kQueriesPerTask of its queries), for
// every query head that shares it (grouped-query attention reads each key and value once for the group): the scores
// of its queries against every key it may see
// (a boolean mask, broadcast as SDPA takes it), a softmax (vectorised exp), and the weighted sum of the
// values, all in float32 registers whatever the cache holds (float32, bfloat16 or float16), with the
// query and the output in the model's dtype (the cache's, or float32 over a cache kept in a smaller one). Tasks are
// independent, so they can be spread over threads.
//
// Plain C++ over raw pointers; the kernels are built with AVX-512 flags (cache_attention_avx512.cpp) and
// used only where panel_gemm.h's cpu_has_panel_kernels() holds.
#pragma once

#include <cstdint>

#include "runtime/cpu/panel_gemm.h"

namespace libpipe::cpu {

struct CacheAttention {
  WeightType type = WeightType::kFloat32;        // of the query and the output
  WeightType cache_type = WeightType::kFloat32;  // of the caches (a float32 model may keep them in bfloat16)
  const void* query = nullptr;                   // [batch, heads, queries, head_dim], contiguous
  void* out = nullptr;                           // the same shape, contiguous
  int64_t batch = 0, heads = 0, queries = 0, head_dim = 0;
  const void* k_cache = nullptr;  // [slots, kv_heads, max_len, head_dim] with these strides (elements),
  const void* v_cache = nullptr;  // the last one 1
  int64_t cache_stride[3] = {0, 0, 0};
  int64_t v_stride[3] = {0, 0, 0};
  int64_t kv_heads = 0;
  const int64_t* slots = nullptr;  // [batch], each in range
  int64_t context = 0;             // keys 0 .. context-1 of each slot
  const bool* mask = nullptr;      // true: may attend; element (b, h, q, j) at these strides (0: broadcast)
  int64_t mask_stride[4] = {0, 0, 0, 0};
  float scale = 1.f;
};

// Queries of one head per task. A decode step has one; a prompt chunk's queries are cut into pieces of this many so
// that its few tasks (one per key-value head: SmolLM2's 3 over 2 cores left one core a task idle) spread evenly.
constexpr int64_t kQueriesPerTask = 16;

inline int64_t cache_attention_query_pieces(const CacheAttention& a) {
  return (a.queries + kQueriesPerTask - 1) / kQueriesPerTask;
}

// Tasks: one per (row, key-value head, piece of kQueriesPerTask queries), batch x kv_heads x pieces of them; a task
// computes its queries for every query head that shares the key-value head (heads / kv_heads of them, consecutive in
// the query), reading its keys and values once for all.
inline int64_t cache_attention_tasks(const CacheAttention& a) {
  return a.batch * a.kv_heads * cache_attention_query_pieces(a);
}

// Computes tasks [begin, end). A query that may see no key gets NaN, as SDPA gives. Needs
// cpu_has_panel_kernels(), head_dim a multiple of 16 and at most 256.
void cache_attention(const CacheAttention& a, int64_t begin, int64_t end);

// Whether the kernels take these dtypes: the query's and the caches' equal, or float32 queries over bfloat16 or
// float16 caches.
inline bool cache_attention_types_supported(WeightType query, WeightType cache) {
  return query == cache || query == WeightType::kFloat32;
}

// Whether the kernels take this head size.
inline bool cache_attention_head_dim_supported(int64_t head_dim) {
  return head_dim > 0 && head_dim % 16 == 0 && head_dim <= 256;
}

}  // namespace libpipe::cpu
