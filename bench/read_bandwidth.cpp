// The machine's memory read bandwidth, the yardstick of a decode step (it must read every weight once):
// a sum over 1 GiB of memory on transparent huge pages (runtime/cpu/huge_pages.h, as libpipe keeps weights),
// on 1 .. N threads, best of 5 passes each. Prints one JSON object: {"threads": [1, ..], "gb_per_s": [..]}.
//
//   cmake --build build --target read_bandwidth && build/bench/read_bandwidth [threads]
//
// bench/generate.py runs it to print each decode rate as a share of the bound weight bytes / bandwidth.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "runtime/cpu/huge_pages.h"

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Sums 16 lanes at a time, which the compiler vectorises: the loads, not the adds, set the pace.
float sum(const float* p, size_t n) {
  float lanes[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += p[i + j];
  float s = 0;
  for (float v : lanes) s += v;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int most = argc > 1 ? std::max(1, std::atoi(argv[1])) : static_cast<int>(std::thread::hardware_concurrency());
  const size_t bytes = size_t{1} << 30;
  libpipe::cpu::HugePageBuffer buffer(bytes);
  std::memset(buffer.data(), 1, bytes);
  const float* data = static_cast<const float*>(buffer.data());
  const size_t n = bytes / sizeof(float);
  std::printf("{\"threads\": [");
  for (int t = 1; t <= most; ++t) std::printf("%s%d", t > 1 ? ", " : "", t);
  std::printf("], \"gb_per_s\": [");
  volatile float sink = 0;
  for (int threads = 1; threads <= most; ++threads) {
    double best = 1e300;
    for (int r = 0; r < 5; ++r) {
      std::vector<std::thread> pool;
      std::vector<float> sums(threads);
      const double start = now();
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] { sums[t] = sum(data + t * n / threads, n / threads); });
      for (auto& th : pool) th.join();
      best = std::min(best, now() - start);
      for (float s : sums) sink = sink + s;
    }
    std::printf("%s%.1f", threads > 1 ? ", " : "", bytes / best / 1e9);
  }
  std::printf("]}\n");
  return 0;
}
