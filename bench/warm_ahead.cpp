// A decode step's products with the work between them, with and without the lent core reading the next
// products' weights ahead (SpareCores::warm, runtime/stage/warm_ahead.h), alternating pass by pass in one process
// so that a drift in the machine's read bandwidth hits both alike.
//
//   cmake --build build --target warm_ahead && build/bench/warm_ahead [smollm2|1b] [bf16|fp32] [passes] [gap scale]
//
// One pass is one sequence's decode step over one stage holding every layer: per layer the q/k/v product (one
// matrix, as the grouped product reads it), o, gate/up (one matrix) and down, then the LM head; between two
// products, a stretch of computation on data in the caches standing for what a stage runs there (norms, rotary,
// attention over a short cache, the TorchScript interpreter): 45 us after q/k/v, 20 after o, 10 after gate/up and
// 20 after down (SmolLM2's bf16 step has about 3 ms of such work in 121 gaps, bench/step_breakdown.py), times the
// gap scale (default 1). Prints the median and best step time of each side and the weights' bytes per second.
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

#include "runtime/stage/panel_linear.h"
#include "runtime/stage/spare_cores.h"

namespace {

using Clock = std::chrono::steady_clock;

double now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// Computation on 32 KiB that stays in the core's caches, for `us` microseconds.
float gap(double us, std::vector<float>& scratch) {
  float acc = 0;
  const auto until = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3));
  while (Clock::now() < until)
    for (size_t i = 0; i < scratch.size(); ++i) acc += scratch[i] * scratch[(i * 7) % scratch.size()];
  return acc;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "smollm2";
  const at::ScalarType dtype = argc > 2 && std::string(argv[2]) == "fp32" ? at::kFloat : at::kBFloat16;
  const int passes = argc > 3 ? std::max(2, std::atoi(argv[3])) : 40;
  const double scale = argc > 4 ? std::atof(argv[4]) : 1.0;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  c10::InferenceMode guard;
  at::set_num_threads(1);  // a stage thread's own operators run on it alone; the pool lends the other cores
  const bool big = model == "1b";
  const int64_t hidden = big ? 2048 : 576, kv = big ? 512 : 192, mlp = big ? 8192 : 1536, vocab = 49152;
  const int layers = big ? 16 : 30;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {hidden + 2 * kv, hidden}, {hidden, hidden}, {2 * mlp, hidden}, {hidden, mlp}};
  const double gaps_us[] = {45 * scale, 20 * scale, 10 * scale, 20 * scale};
  std::vector<at::Tensor> weights;
  std::vector<std::pair<int64_t, int64_t>> sizes;
  for (int l = 0; l < layers; ++l)
    for (auto [n, k] : shapes) {
      weights.push_back((at::randn({n, k}) * 0.02).to(dtype));
      sizes.push_back({n, k});
    }
  weights.push_back((at::randn({vocab, hidden}) * 0.02).to(dtype));
  sizes.push_back({vocab, hidden});
  double bytes = 0;
  for (const at::Tensor& w : weights) bytes += static_cast<double>(w.nbytes());
  const std::vector<at::Tensor> panels = libpipe::stage::to_panels(weights);
  if (!panels[0].defined()) {
    std::fprintf(stderr, "warm_ahead: this CPU has no AVX-512: no panels\n");
    return 1;
  }
  weights.clear();  // the panels are the only copy, as in a stage
  std::vector<at::Tensor> inputs;
  for (auto [n, k] : sizes) inputs.push_back(at::randn({1, k}).to(dtype));
  std::vector<float> scratch(8192, 1.0f);
  libpipe::stage::SpareCores pool(cores);
  libpipe::stage::SpareCores::Lend lend(&pool);
  libpipe::stage::SpareCores::Busy busy(&pool);
  std::vector<double> times[2];  // [warm off, warm on]
  float sink = 0;
  for (int pass = 0; pass < passes + 2; ++pass) {
    const bool on = (pass % 2 == 1) != ((pass / 2) % 2 == 1);  // off, on, on, off, ...: neither side always first
    libpipe::stage::SpareCores::set_warm_ahead(on);
    const double start = now();
    for (size_t i = 0; i < panels.size(); ++i) {
      libpipe::stage::panel_linear(inputs[i], panels[i], std::nullopt, sizes[i].first, sizes[i].second);
      if (i + 1 < panels.size()) sink += gap(gaps_us[i % 4], scratch);
    }
    if (pass >= 2) times[on].push_back(now() - start);  // the first two learn the order
  }
  libpipe::stage::SpareCores::set_warm_ahead(true);
  double gap_ms = 0;
  for (size_t i = 0; i + 1 < panels.size(); ++i) gap_ms += gaps_us[i % 4] / 1e3;
  std::printf("%s %s decode step, %d cores, %.0f MB of weights, %.2f ms of work between products, %d passes each\n",
              model.c_str(), c10::toString(dtype), cores, bytes / 1e6, gap_ms, passes / 2);
  for (int on = 0; on < 2; ++on)
    std::printf("  read ahead %-3s: median %.2f ms (best %.2f), %.1f GB/s of weights over the step\n",
                on ? "on" : "off", median(times[on]) * 1e3, *std::min_element(times[on].begin(), times[on].end()) * 1e3,
                bytes / median(times[on]) / 1e9);
  std::printf("  on / off: %.3f (%g)\n", median(times[1]) / median(times[0]), sink > 0 ? 0.0 : 1.0);
  return 0;
}
