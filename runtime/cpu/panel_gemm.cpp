#include "runtime/cpu/panel_gemm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
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
    case WeightType::kInt8:
    case WeightType::kInt4: return 1;
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

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    const char* o = isa_override();
    if (o && (std::strcmp(o, "avx512") == 0 || std::strcmp(o, "none") == 0)) return false;
#if defined(__x86_64__)
    return cpu_has_panel_kernels() && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
  }();
  return has;
}

int64_t int4_panel_bytes(int64_t n, int64_t k, int64_t group) {
  const int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  const int64_t depth = int4_depth(k, group);
  return panels * (depth / group * 2 * kPanelWidth + depth * kPanelWidth / 2);
}

void pack_int4_panels(const int8_t* codes, const uint16_t* scales, int64_t n, int64_t k, int64_t group, void* dst,
                      int64_t panel_begin, int64_t panel_end) {
  const int64_t depth = int4_depth(k, group), groups = depth / group;
  const int64_t group_bytes = 2 * kPanelWidth + group * kPanelWidth / 2;
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    uint8_t* out = d + panel * groups * group_bytes;
    const int64_t rows = std::min(kPanelWidth, n - panel * kPanelWidth);
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* at = out + g * group_bytes;
      uint16_t group_scales[kPanelWidth] = {};  // a tail panel's missing outputs: scale 0, codes 8 (zero)
      for (int64_t c = 0; c < rows; ++c) group_scales[c] = scales[(panel * kPanelWidth + c) * groups + g];
      std::memcpy(at, group_scales, sizeof group_scales);
      uint8_t* steps = at + 2 * kPanelWidth;
      for (int64_t s = 0; s < group / 8; ++s)
        for (int64_t c = 0; c < kPanelWidth; ++c)
          for (int64_t t = 0; t < 4; ++t) {
            const int8_t* row = codes + (panel * kPanelWidth + c) * depth + g * group + 8 * s;
            const int lo = c < rows ? row[t] + 8 : 8, hi = c < rows ? row[4 + t] + 8 : 8;
            steps[s * 4 * kPanelWidth + c * 4 + t] = static_cast<uint8_t>(lo | (hi << 4));
          }
    }
  }
}

void quantize_rows(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales, int32_t* sums,
                   int64_t row_begin, int64_t row_end) {
  if (cpu_has_panel_kernels()) return avx512::quantize_rows(x, ldx, k, depth, codes, scales, sums, row_begin, row_end);
  quantize_rows_scalar(x, ldx, k, depth, codes, scales, sums, row_begin, row_end);
}

void quantize_rows_scalar(const float* x, int64_t ldx, int64_t k, int64_t depth, int8_t* codes, float* scales,
                          int32_t* sums, int64_t row_begin, int64_t row_end) {
  const int64_t blocks = depth / kInt4RowBlock;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* xr = x + r * ldx;
    int8_t* q = codes + r * depth;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i0 = b * kInt4RowBlock, i1 = std::min(k, i0 + kInt4RowBlock);
      float amax = 0;
      for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(xr[i]));
      const float scale = amax / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      int32_t sum = 0;
      for (int64_t i = i0; i < i0 + kInt4RowBlock; ++i) {
        const int32_t c = i < i1 ? static_cast<int32_t>(std::round(xr[i] * inverse)) : 0;
        q[i] = static_cast<int8_t>(std::clamp(c, -127, 127));
        sum += q[i];
      }
      scales[r * blocks + b] = scale;
      sums[r * blocks + b] = sum;
    }
  }
}

int64_t panel_depth(WeightType type, int64_t k) {
  if (type == WeightType::kInt8) return int4_depth(k, kInt4RowBlock);
  return type == WeightType::kBFloat16 ? (k + 1) / 2 * 2 : k;
}

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
    const int64_t rows = std::min(kPanelWidth, n - panel * kPanelWidth);
    if (type == WeightType::kInt8) {
      // Per 4 k, 64 outputs x 4 codes: output c's k = 4s + t at byte 4 (64 s + c) + t, as q + 128 (padding: 0 + 128).
      uint8_t* o = reinterpret_cast<uint8_t*>(out);
      std::memset(o, 128, static_cast<size_t>(depth * kPanelWidth));
      for (int64_t c = 0; c < rows; ++c) {
        const int8_t* src = reinterpret_cast<const int8_t*>(w) + (panel * kPanelWidth + c) * k;
        for (int64_t i = 0; i < k; ++i)
          o[((i / 4) * kPanelWidth + c) * 4 + i % 4] = static_cast<uint8_t>(static_cast<int32_t>(src[i]) + 128);
      }
      continue;
    }
    std::memset(out, 0, static_cast<size_t>(depth * kPanelWidth) * es);
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
  if (type == WeightType::kInt8) {  // the codes q (stored as q + 128); the caller applies the row's scale
    const uint8_t* q = reinterpret_cast<const uint8_t*>(in);
    int8_t* o = reinterpret_cast<int8_t*>(out);
    for (int64_t i = 0; i < k; ++i)
      o[i] = static_cast<int8_t>(static_cast<int32_t>(q[((i / 4) * kPanelWidth + c) * 4 + i % 4]) - 128);
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
  const int64_t bytes_per_output = p.type == WeightType::kInt4
                                       ? p.k / 2 + p.k / p.group * 2
                                       : panel_depth(p.type, p.k) * int64_t(element_size(p.type));
  choice.record(p.type, p.m, pick.slot, units * kUnitWidth * bytes_per_output, seconds);
}

}  // namespace libpipe::cpu
