#include "runtime/cpu/panel_gemm.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "runtime/cpu/kernel_choice.h"
#include "runtime/cpu/panel_gemm_kernels.h"

namespace libpipe::cpu {

namespace {

size_t element_size(WeightType type) {
  switch (type) {
    case WeightType::kFloat32: return 4;
    case WeightType::kInt8: return 1;
    default: return 2;
  }
}

// LIBPIPE_CPU_ISA=avx512 pretends the CPU lacks AVX-512 BF16 (the converting kernel, for tests and
// comparisons on a CPU that has it); =none, that it lacks AVX-512 (nothing uses the panels).
const char* isa_override() { return std::getenv("LIBPIPE_CPU_ISA"); }

#if defined(__x86_64__)
// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool has_f16c() {
  unsigned int a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
}
#endif

}  // namespace

bool cpu_has_panel_kernels() {
  static const bool has = [] {
    const char* o = isa_override();
    if (o && std::strcmp(o, "none") == 0) return false;
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && has_f16c() &&
           __builtin_cpu_supports("fma");
#else
    return false;
#endif
  }();
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    const char* o = isa_override();
    if (o && (std::strcmp(o, "avx512") == 0 || std::strcmp(o, "none") == 0)) return false;
#if defined(__x86_64__)
    return cpu_has_panel_kernels() && __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
  }();
  return has;
}

int64_t panel_depth(WeightType type, int64_t k) { return type == WeightType::kBFloat16 ? (k + 1) / 2 * 2 : k; }

int64_t panel_elements(WeightType type, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  return panels * panel_depth(type, k) * kPanelWidth;
}

void pack_panels(WeightType type, const void* weight, int64_t n, int64_t k, void* dst, int64_t panel_begin,
                 int64_t panel_end) {
  const size_t es = element_size(type);
  const int64_t depth = panel_depth(type, k);
  const char* w = static_cast<const char*>(weight);
  char* d = static_cast<char*>(dst);
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    char* out = d + static_cast<size_t>(panel * depth * kPanelWidth) * es;
    std::memset(out, 0, static_cast<size_t>(depth * kPanelWidth) * es);
    const int64_t rows = std::min(kPanelWidth, n - panel * kPanelWidth);
    for (int64_t c = 0; c < rows; ++c) {
      const char* src = w + static_cast<size_t>((panel * kPanelWidth + c) * k) * es;
      if (type == WeightType::kBFloat16) {
        // [depth/2][64][2]: element (i, c) at ((i / 2) * 64 + c) * 2 + i % 2
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(out + static_cast<size_t>(((i / 2) * kPanelWidth + c) * 2 + i % 2) * es, src + i * es, es);
      } else {
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(out + static_cast<size_t>(i * kPanelWidth + c) * es, src + i * es, es);
      }
    }
  }
}

void unpack_row(WeightType type, const void* panels, int64_t /*n*/, int64_t k, int64_t row, void* dst) {
  const size_t es = element_size(type);
  const int64_t depth = panel_depth(type, k);
  const int64_t panel = row / kPanelWidth, c = row % kPanelWidth;
  const char* in = static_cast<const char*>(panels) + static_cast<size_t>(panel * depth * kPanelWidth) * es;
  char* out = static_cast<char*>(dst);
  if (type == WeightType::kInt8) {  // the codes as stored; the caller applies the row's scale
    const int8_t* q = reinterpret_cast<const int8_t*>(in);
    int8_t* o = reinterpret_cast<int8_t*>(out);
    for (int64_t i = 0; i < k; ++i) o[i] = q[i * kPanelWidth + c];
    return;
  }
  if (type == WeightType::kFloat32) {
    const float* f = reinterpret_cast<const float*>(in);
    float* o = reinterpret_cast<float*>(out);
    for (int64_t i = 0; i < k; ++i) o[i] = f[i * kPanelWidth + c];
    return;
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(in);
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  if (type == WeightType::kBFloat16) {
    for (int64_t i = 0; i < k; ++i) o[i] = h[((i / 2) * kPanelWidth + c) * 2 + i % 2];
  } else {
    for (int64_t i = 0; i < k; ++i) o[i] = h[i * kPanelWidth + c];
  }
}

void panel_product(const PanelProduct& p, int64_t unit_begin, int64_t unit_end) {
  unit_end = std::min(unit_end, panel_units(p.n));
  if (unit_begin >= unit_end || p.m <= 0) return;
  KernelChoice& choice = KernelChoice::instance();
  const KernelChoice::Pick pick = choice.pick(p.type, p.m);
  if (pick.slot < 0) return avx512::panel_product(p, unit_begin, unit_end, pick.variant);
  const auto start = std::chrono::steady_clock::now();
  avx512::panel_product(p, unit_begin, unit_end, pick.variant);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t units = unit_end - unit_begin;
  choice.record(p.type, p.m, pick.slot, units * kUnitWidth * panel_depth(p.type, p.k) * int64_t(element_size(p.type)),
                seconds);
}

}  // namespace libpipe::cpu
