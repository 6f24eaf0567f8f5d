// Linear layers on the CPU: aten::linear against libpipe's pipe::packed_linear (weights packed once
// for MKL's GEMM, runtime/stage/packed_linear.h), on the 210 linear layers of SmolLM2-135M (30
// layers of q, k, v, o, gate, up, down; random weights of the real shapes), one intra-op thread,
// for the row counts a decode step (one row per sequence) and a prefill step give them.
//
//   cmake --build build --target linear_gemm && build/bench/linear_gemm [repeats]
//
// Prints, per row count, the best time of one pass over the 210 layers for each, and the ratio.
// Times are thread CPU time (the least disturbed by other work on the machine); the best of
// `repeats` passes (default 9).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/api/module.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "runtime/stage/packed_linear.h"

namespace {

double thread_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// One module per layer shape: forward(x) = linear(x, self.w); the weights are attributes, as in a stage.
torch::jit::Module linear_module(const at::Tensor& w) {
  torch::jit::Module m("LinearBench");
  m.register_parameter("w", w, false);
  m.define("def forward(self, x):\n    return torch.linear(x, self.w)\n");
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 9;
  at::set_num_threads(1);
  c10::InferenceMode guard;
  // SmolLM2-135M: hidden 576, 9 heads and 3 key/value heads of 64, intermediate 1536, 30 layers.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{576, 576},  {192, 576},  {192, 576}, {576, 576},
                                                           {1536, 576}, {1536, 576}, {576, 1536}};
  std::vector<torch::jit::Module> plain, packed;
  for (int layer = 0; layer < 30; ++layer)
    for (auto [out, in] : shapes) {
      at::Tensor w = at::randn({out, in});
      plain.push_back(linear_module(w));
      packed.push_back(linear_module(w));
      if (libpipe::stage::pack_linear_weights(packed.back()) != 1) {
        std::fprintf(stderr, "linear_gemm: nothing was packed (no MKL in this LibTorch, or LIBPIPE_PACKED_LINEAR=0)\n");
        return 1;
      }
    }
  std::printf("rows  aten::linear ms  packed ms  speed-up  (210 layers, 1 thread, best of %d)\n", repeats);
  for (int64_t rows : {1, 2, 3, 4, 8, 16, 32, 64, 128}) {
    const at::Tensor x576 = at::randn({rows, 576}), x1536 = at::randn({rows, 1536});
    double best[2] = {1e300, 1e300};
    for (int r = 0; r < repeats; ++r)
      for (int which = 0; which < 2; ++which) {
        auto& modules = which == 0 ? plain : packed;
        const double start = thread_ms();
        for (size_t i = 0; i < modules.size(); ++i)
          modules[i].forward({shapes[i % shapes.size()].second == 576 ? x576 : x1536});
        best[which] = std::min(best[which], thread_ms() - start);
      }
    std::printf("%4lld  %15.1f  %9.1f  %7.2fx\n", static_cast<long long>(rows), best[0], best[1], best[0] / best[1]);
  }
  return 0;
}
