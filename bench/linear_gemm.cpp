// Linear layers on the CPU: aten::linear against libpipe's pipe::panel_linear (weights stored once as
// panels on huge pages, runtime/stage/panel_linear.h) and, for bfloat16, MKL's own bf16 GEMM
// (cblas_gemm_bf16bf16f32, in the LibTorch wheel), on every linear layer of a model's shape (random
// weights), for the row counts a decode step (one row per sequence) and a prefill step give them.
//
//   cmake --build build --target linear_gemm && build/bench/linear_gemm [smollm2|1b] [repeats] [quantized|kernels]
//
// smollm2: SmolLM2-135M's 210 layers (30 x q, k, v, o, gate, up, down); 1b: a 1B-class Llama's
// (hidden 2048, 16 layers, 8 of 32 heads' width for k and v, intermediate 8192). All the machine's
// cores: aten::linear on its intra-op threads, panel_linear's units on the cores of a SpareCores pool
// (as in a session whose stage borrows the idle cores). Prints, per dtype and row count, the best of
// `repeats` passes (default 5) over all layers in wall time, as milliseconds, the weights' bytes per
// second and GFLOP/s; read_bandwidth gives the machine's read bandwidth for scale. Then the quantized panels
// (`quantized` alone: only them): bfloat16, int8 (pipe::panel_linear_int8) and int4 in groups of 32
// (pipe::panel_linear_int4) at 1, 8 and 32 rows, as the bytes each streams per second and the time. `kernels` in
// place of `quantized`: float32 and the same three kernels on one thread, layer shape by layer shape, 1 to 256 rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/cpu/huge_pages.h"
#include "runtime/stage/panel_linear.h"
#include "runtime/stage/spare_cores.h"

extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "smollm2";
  const int repeats = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  c10::InferenceMode guard;
  at::set_num_threads(cores);
  const bool big = model == "1b";
  // {out, in} of one layer's q, k, v, o, gate, up, down.
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      big ? std::vector<std::pair<int64_t, int64_t>>{{2048, 2048}, {512, 2048},  {512, 2048}, {2048, 2048},
                                                     {8192, 2048}, {8192, 2048}, {2048, 8192}}
          : std::vector<std::pair<int64_t, int64_t>>{{576, 576},  {192, 576},  {192, 576}, {576, 576},
                                                     {1536, 576}, {1536, 576}, {576, 1536}};
  const int layers = big ? 16 : 30;
  libpipe::stage::SpareCores pool(cores);
  std::printf("%s linear layers, %d threads, best of %d (the machine's read bandwidth: build/bench/read_bandwidth)\n",
              model.c_str(), cores, repeats);
  // What one product costs beside its arithmetic and memory traffic: a 64 x 64 layer, one row, many times.
  for (bool shared : {false, true}) {
    const at::Tensor w = at::randn({64, 64}), x = at::randn({1, 64});
    const at::Tensor p = libpipe::stage::to_panels(w);
    std::optional<libpipe::stage::SpareCores::Lend> lend;
    std::optional<libpipe::stage::SpareCores::Busy> busy;
    if (shared) {
      lend.emplace(&pool);
      busy.emplace(&pool);
    } else {
      at::set_num_threads(1);
    }
    double best = 1e300;
    for (int r = 0; r < repeats; ++r) {
      const double start = now();
      for (int i = 0; i < 2000; ++i) libpipe::stage::panel_linear(x, p, std::nullopt, 64, 64);
      best = std::min(best, (now() - start) / 2000);
    }
    at::set_num_threads(cores);
    std::printf("one 64 x 64 product of 1 row, %s: %.2f us\n", shared ? "shared with a lent core" : "one thread",
                best * 1e6);
  }
  const bool only_quantized = argc > 3 && std::string(argv[3]) == "quantized";
  // `kernels`: the quantized products one layer shape at a time on one thread, each the fastest of `repeats` calls,
  // summed over the model's layers: the kernels' own speed, steady on a machine that other work shares (a pass
  // over all layers on every core, as below, is the end-to-end figure but moves with any other load).
  if (argc > 3 && std::string(argv[3]) == "kernels") {
    at::set_num_threads(1);
    std::printf(
        "\none thread, each layer shape the fastest of %d calls, times %d layers\n%5s  %18s  %18s  %18s  %18s\n",
        repeats, layers, "rows", "fp32 ms GMAC/s", "bf16 ms GMAC/s", "int8 ms GMAC/s", "int4 ms GMAC/s");
    std::vector<at::Tensor> fp32, bf16, int8, int8_scales, int4;
    double macs_per_row = 0;
    for (auto [n, k] : shapes) {
      const at::Tensor w = at::randn({n, k}) * 0.02;
      macs_per_row += static_cast<double>(n) * k * layers;
      fp32.push_back(libpipe::stage::to_panels(w));
      bf16.push_back(libpipe::stage::to_panels(w.to(at::kBFloat16)));
      libpipe::stage::Int8Weight q8 = libpipe::stage::quantize_int8(w);
      libpipe::stage::PanelArena a8({q8.codes});  // the panels keep their arena's memory
      int8.push_back(a8.pack(0, q8.codes));
      int8_scales.push_back(q8.scales);
      const libpipe::stage::Int4Weight q4 = libpipe::stage::quantize_int4(w, 32);
      libpipe::stage::PanelArena a4(std::vector<size_t>{libpipe::stage::PanelArena::int4_bytes(n, k, 32)});
      int4.push_back(a4.pack_int4(0, q4, k));
    }
    for (int64_t rows : {1, 8, 32, 64, 128, 256}) {
      double total[4] = {0, 0, 0, 0};
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto [n, k] = shapes[i];
        const at::Tensor xf = at::randn({rows, k}), x = xf.to(at::kBFloat16);
        for (int kind = 0; kind < 4; ++kind) {
          double best = 1e300;
          for (int r = 0; r < repeats + 1; ++r) {
            const double start = now();
            if (kind == 0) libpipe::stage::panel_linear(xf, fp32[i], std::nullopt, n, k);
            else if (kind == 1) libpipe::stage::panel_linear(x, bf16[i], std::nullopt, n, k);
            else if (kind == 2) libpipe::stage::panel_linear_int8(x, int8[i], int8_scales[i], std::nullopt, n, k);
            else libpipe::stage::panel_linear_int4(x, int4[i], std::nullopt, n, k, 32);
            if (r > 0) best = std::min(best, now() - start);
          }
          total[kind] += best * layers;
        }
      }
      std::printf("%5lld", static_cast<long long>(rows));
      for (int kind = 0; kind < 4; ++kind)
        std::printf("  %9.2f %8.1f", total[kind] * 1e3, macs_per_row * rows / total[kind] / 1e9);
      std::printf("\n");
    }
    return 0;
  }
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    if (only_quantized) break;
    std::vector<at::Tensor> weights;
    double bytes = 0, flops_per_row = 0;
    for (int l = 0; l < layers; ++l)
      for (auto [n, k] : shapes) {
        weights.push_back(at::randn({n, k}).to(dtype));
        bytes += weights.back().nbytes();
        flops_per_row += 2.0 * n * k;
      }
    const std::vector<at::Tensor> panels = libpipe::stage::to_panels(weights);  // in one mapping, as a stage's
    if (!panels[0].defined()) {
      std::fprintf(stderr, "linear_gemm: this CPU has no AVX-512: nothing to compare\n");
      return 1;
    }
    std::printf("\n%s, %.0f MB of weights\n%5s  %28s  %28s  %28s\n", c10::toString(dtype), bytes / 1e6, "rows",
                "aten::linear ms GB/s GFLOP/s", "panel_linear ms GB/s GFLOP/s", "MKL bf16 GEMM ms GB/s GFLOP/s");
    for (int64_t rows : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
      std::vector<at::Tensor> inputs;
      for (auto [n, k] : shapes) inputs.push_back(at::randn({rows, k}).to(dtype));
      const bool mkl = dtype == at::kBFloat16 && cblas_gemm_bf16bf16f32;
      double best[3] = {1e300, 1e300, 1e300};
      for (int r = 0; r < repeats; ++r) {
        double start = now();
        for (size_t i = 0; i < weights.size(); ++i) at::linear(inputs[i % shapes.size()], weights[i]);
        best[0] = std::min(best[0], now() - start);
        start = now();
        {
          libpipe::stage::SpareCores::Lend lend(&pool);
          libpipe::stage::SpareCores::Busy busy(&pool);
          for (size_t i = 0; i < weights.size(); ++i)
            libpipe::stage::panel_linear(inputs[i % shapes.size()], panels[i], std::nullopt, weights[i].size(0),
                                         weights[i].size(1));
        }
        best[1] = std::min(best[1], now() - start);
        if (mkl) {
          start = now();
          for (size_t i = 0; i < weights.size(); ++i) {
            const int n = static_cast<int>(weights[i].size(0)), k = static_cast<int>(weights[i].size(1));
            at::Tensor out = at::empty({rows, n});
            cblas_gemm_bf16bf16f32(101, 111, 112, static_cast<int>(rows), n, k, 1.f,
                                   static_cast<const uint16_t*>(inputs[i % shapes.size()].data_ptr()), k,
                                   static_cast<const uint16_t*>(weights[i].data_ptr()), k, 0.f, out.data_ptr<float>(),
                                   n);
          }
          best[2] = std::min(best[2], now() - start);
        }
      }
      auto cell = [&](double t) {
        static char text[64];
        if (t > 1e299) return "-";
        std::snprintf(text, sizeof text, "%9.2f %7.1f %8.1f", t * 1e3, bytes / t / 1e9, flops_per_row * rows / t / 1e9);
        return static_cast<const char*>(text);
      };
      std::printf("%5lld  %28s", static_cast<long long>(rows), cell(best[0]));
      std::printf("  %28s", cell(best[1]));
      std::printf("  %28s\n", cell(best[2]));
    }
  }
  // Quantized weights: bfloat16 panels against int8 and int4 (group 32) panels of the same layers.
  {
    std::vector<at::Tensor> bf16, int8, int8_scales, int4;
    std::vector<std::pair<int64_t, int64_t>> sizes;
    double bytes[3] = {0, 0, 0};
    for (int l = 0; l < layers; ++l)
      for (auto [n, k] : shapes) {
        const at::Tensor w = at::randn({n, k}) * 0.02;
        sizes.push_back({n, k});
        bf16.push_back(libpipe::stage::to_panels(w.to(at::kBFloat16)));
        bytes[0] += bf16.back().nbytes();
        libpipe::stage::Int8Weight q8 = libpipe::stage::quantize_int8(w);
        libpipe::stage::PanelArena a8({q8.codes});
        int8.push_back(a8.pack(0, q8.codes));
        int8_scales.push_back(q8.scales);
        bytes[1] += int8.back().nbytes() + q8.scales.nbytes();
        const libpipe::stage::Int4Weight q4 = libpipe::stage::quantize_int4(w, 32);
        libpipe::stage::PanelArena a4(std::vector<size_t>{libpipe::stage::PanelArena::int4_bytes(n, k, 32)});
        int4.push_back(a4.pack_int4(0, q4, k));
        bytes[2] += int4.back().nbytes();
      }
    std::printf(
        "\nquantized weights (bfloat16 rows), MB streamed: bf16 %.0f, int8 %.0f, int4/32 %.0f\n%5s  %18s  %18s  %18s\n",
        bytes[0] / 1e6, bytes[1] / 1e6, bytes[2] / 1e6, "rows", "bf16 ms GB/s", "int8 ms GB/s", "int4 ms GB/s");
    for (int64_t rows : {1, 8, 32}) {
      std::vector<at::Tensor> inputs;
      for (auto [n, k] : shapes) inputs.push_back(at::randn({rows, k}).to(at::kBFloat16));
      double best[3] = {1e300, 1e300, 1e300};
      // As in a session of one-thread stages lent the other cores: the stage's own ATen ops (the rows' conversion
      // to float32 and back) on one thread, not an OpenMP team racing the lent cores' helpers.
      at::set_num_threads(1);
      for (int r = 0; r < repeats; ++r) {
        libpipe::stage::SpareCores::Lend lend(&pool);
        libpipe::stage::SpareCores::Busy busy(&pool);
        for (int kind = 0; kind < 3; ++kind) {
          const double start = now();
          for (size_t i = 0; i < sizes.size(); ++i) {
            const at::Tensor& x = inputs[i % shapes.size()];
            const auto [n, k] = sizes[i];
            if (kind == 0) libpipe::stage::panel_linear(x, bf16[i], std::nullopt, n, k);
            else if (kind == 1) libpipe::stage::panel_linear_int8(x, int8[i], int8_scales[i], std::nullopt, n, k);
            else libpipe::stage::panel_linear_int4(x, int4[i], std::nullopt, n, k, 32);
          }
          best[kind] = std::min(best[kind], now() - start);
        }
      }
      at::set_num_threads(cores);
      std::printf("%5lld", static_cast<long long>(rows));
      for (int kind = 0; kind < 3; ++kind)
        std::printf("  %9.2f %8.1f", best[kind] * 1e3, bytes[kind] / best[kind] / 1e9);
      std::printf("\n");
    }
  }
  return 0;
}
