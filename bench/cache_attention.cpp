// Decode-step attention over KV-cache slots: libpipe's kernels (runtime/cpu/cache_attention.h) against ATen's
// scaled_dot_product_attention on the same gathered keys and values, for the shapes a decode step gives them (one
// query per sequence and head), on one thread and on a lent pool of every core, as a stage runs them.
//
//   cmake --build build --target cache_attention && build/bench/cache_attention [smollm2|1b] [repeats]
//
// smollm2: 9 query heads over 3 key-value heads of 64; 1b: 32 over 8 of 64. Prints per dtype, rows (sequences) and
// context the best of `repeats` calls (default 50) of one layer's attention in microseconds, and the cache bytes per
// second the kernel reads (keys and values of every row, in the cache's dtype).
// Then a prompt's first chunk (one row of 64, 128 and 256 queries under the causal mask) in microseconds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/cpu/cache_attention.h"
#include "runtime/stage/spare_cores.h"

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <typename F>
double best_us(int repeats, F&& f) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best * 1e6;
}

// The kernels' description of one layer's attention: q [rows, heads, queries, d] over the caches' first `context`
// positions of `slots`, under `allowed` [rows, heads, queries, context] (any strides).
libpipe::cpu::CacheAttention describe(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& allowed,
                                      int64_t context) {
  using libpipe::cpu::WeightType;
  libpipe::cpu::CacheAttention a;
  a.type = a.cache_type = q.scalar_type() == at::kFloat ? WeightType::kFloat32 : WeightType::kBFloat16;
  a.query = q.data_ptr();
  a.out = out.data_ptr();
  a.batch = q.size(0);
  a.heads = q.size(1);
  a.queries = q.size(2);
  a.head_dim = q.size(3);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  for (int i = 0; i < 3; ++i) a.cache_stride[i] = a.v_stride[i] = k_cache.stride(i);
  a.kv_heads = k_cache.size(1);
  a.slots = slots.data_ptr<int64_t>();
  a.context = context;
  a.mask = allowed.data_ptr<bool>();
  for (int i = 0; i < 4; ++i) a.mask_stride[i] = allowed.stride(i);
  a.scale = 0.125f;
  return a;
}

// The best of `repeats` calls on this thread alone and on the cores of `pool` lent to it, microseconds.
std::pair<double, double> time_kernels(const libpipe::cpu::CacheAttention& a, libpipe::stage::SpareCores& pool,
                                       int repeats) {
  const int64_t tasks = libpipe::cpu::cache_attention_tasks(a);
  const double one = best_us(repeats, [&] { libpipe::cpu::cache_attention(a, 0, tasks); });
  libpipe::stage::SpareCores::Lend lend(&pool);
  const double lent = best_us(repeats, [&] {
    libpipe::stage::SpareCores::for_ranges(
        tasks, 1, 4, [&](int64_t begin, int64_t end) { libpipe::cpu::cache_attention(a, begin, end); });
  });
  return {one, lent};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "smollm2";
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 50;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  c10::InferenceMode guard;
  at::set_num_threads(1);
  const bool big = model == "1b";
  const int64_t heads = big ? 32 : 9, kv = big ? 8 : 3, d = 64, max_len = 1024;
  if (!libpipe::cpu::cpu_has_panel_kernels()) {
    std::printf("this CPU lacks the AVX-512 kernels\n");
    return 0;
  }
  libpipe::stage::SpareCores pool(cores);
  std::printf(
      "%s attention, %lld heads over %lld key-value heads of %lld, best of %d calls, microseconds "
      "(cache GB/s)\n",
      model.c_str(), static_cast<long long>(heads), static_cast<long long>(kv), static_cast<long long>(d), repeats);
  std::printf("dtype rows context   one thread        %d cores      aten SDPA (1 thread)\n", cores);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (const int64_t rows : {1, 8, 32}) {
      const at::Tensor k_cache = at::randn({rows, kv, max_len, d}).to(dtype);
      const at::Tensor v_cache = at::randn({rows, kv, max_len, d}).to(dtype);
      const at::Tensor slots = at::arange(rows, at::kLong);
      for (const int64_t context : {64, 192, 512, 1024}) {
        const at::Tensor q = at::randn({rows, heads, 1, d}).to(dtype);
        const at::Tensor mask = at::ones({rows, 1, 1, context}, at::kBool);
        const at::Tensor allowed = mask.expand({rows, heads, 1, context});
        at::Tensor out = at::empty_like(q);
        const auto [one, lent] =
            time_kernels(describe(q, out, k_cache, v_cache, slots, allowed, context), pool, repeats);
        const at::Tensor keys = k_cache.narrow(2, 0, context);
        const at::Tensor values = v_cache.narrow(2, 0, context);
        const double sdpa = best_us(std::max(1, repeats / 5), [&] {
          (void)at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, 0.125, true);
        });
        const double bytes = 2.0 * rows * kv * context * d * k_cache.element_size();
        std::printf("%-5s %4lld %7lld %8.1f (%5.1f) %8.1f (%5.1f) %8.1f\n", dtype == at::kFloat ? "fp32" : "bf16",
                    static_cast<long long>(rows), static_cast<long long>(context), one, bytes / one / 1e3, lent,
                    bytes / lent / 1e3, sdpa);
      }
    }
  }
  // A prompt's first chunk: one row of T queries at positions 0 .. T-1 under the causal mask (as pack_call and
  // attend_packed hand it over: [1, heads, T, T]), against SDPA with is_causal on the same keys.
  std::printf("\n%s prompt attention: one row of T queries from position 0, causal, best of %d calls, microseconds\n",
              model.c_str(), repeats);
  std::printf("dtype queries   one thread   %d cores   aten SDPA (1 thread)\n", cores);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (const int64_t t : {64, 128, 256}) {
      const at::Tensor k_cache = at::randn({1, kv, max_len, d}).to(dtype);
      const at::Tensor v_cache = at::randn({1, kv, max_len, d}).to(dtype);
      const at::Tensor slots = at::zeros({1}, at::kLong);
      const at::Tensor q = at::randn({1, heads, t, d}).to(dtype);
      const at::Tensor allowed = at::ones({t, t}, at::kBool).tril().view({1, 1, t, t}).expand({1, heads, t, t});
      at::Tensor out = at::empty_like(q);
      const auto [one, lent] = time_kernels(describe(q, out, k_cache, v_cache, slots, allowed, t), pool, repeats);
      const at::Tensor keys = k_cache.narrow(2, 0, t);
      const at::Tensor values = v_cache.narrow(2, 0, t);
      const double sdpa = best_us(std::max(1, repeats / 5), [&] {
        (void)at::scaled_dot_product_attention(q, keys, values, std::nullopt, 0.0, true, 0.125, true);
      });
      std::printf("%-5s %7lld %12.1f %10.1f %12.1f\n", dtype == at::kFloat ? "fp32" : "bf16", static_cast<long long>(t),
                  one, lent, sdpa);
    }
  }
  return 0;
}
