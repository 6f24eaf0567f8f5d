#include "runtime/cpu/kernel_choice.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "runtime/log.h"

namespace libpipe::cpu {

namespace {

constexpr int kTypes = 5;
constexpr int kMaxVariants = 4;

// -1: measured; 0 or 1: fixed by the environment variable.
int fixed(const char* name, const char* off, const char* on) {
  const char* value = std::getenv(name);
  if (!value) return -1;
  if (std::strcmp(value, off) == 0) return 0;
  if (std::strcmp(value, on) == 0) return 1;
  return -1;
}

int fixed_prefetch() {
  static const int f = fixed("LIBPIPE_PANEL_PREFETCH", "0", "1");
  return f;
}

int fixed_dot() {
  static const int f = fixed("LIBPIPE_BF16_KERNEL", "convert", "dot");
  return f;
}

// Whether the bfloat16 kernel is a choice here: the CPU has VDPBF16PS and nothing fixed it.
bool dot_is_measured(WeightType type) {
  return type == WeightType::kBFloat16 && cpu_has_avx512_bf16() && fixed_dot() < 0;
}

const char* type_name(WeightType type) {
  switch (type) {
    case WeightType::kFloat32: return "float32";
    case WeightType::kBFloat16: return "bfloat16";
    case WeightType::kFloat16: return "float16";
    case WeightType::kInt8: return "int8";
    case WeightType::kInt4: return "int4";
  }
  return "?";
}

const char* class_name(int c) {
  static const char* const names[KernelChoice::kRowClasses] = {"1 row",     "2-3 rows",   "4-5 rows",
                                                               "6-11 rows", "12-47 rows", "48 rows or more"};
  return names[c];
}

std::string describe(WeightType type, KernelVariant v) {
  std::string s = v.prefetch ? "prefetching" : "no prefetch";
  if (type == WeightType::kBFloat16) s += v.native_bf16 ? ", VDPBF16PS" : ", converted to float32";
  if (type == WeightType::kInt4 || type == WeightType::kInt8) s += v.vnni ? ", VPDPBUSD" : ", VPMADDUBSW";
  return s;
}

}  // namespace

struct KernelChoice::Class {
  std::atomic<int> decided{-1};
  std::atomic<uint64_t> next{0};
  std::atomic<unsigned> dropped{0};  // slots no longer tried (bit per slot): clearly slower at the first look
  std::mutex mutex;
  double bytes[kMaxVariants] = {};
  double seconds[kMaxVariants] = {};
  int samples[kMaxVariants] = {};
};

KernelChoice::KernelChoice() : classes_(new Class[kTypes * kRowClasses]) {}
KernelChoice::~KernelChoice() { delete[] classes_; }

KernelChoice& KernelChoice::instance() {
  static KernelChoice* choice = new KernelChoice();  // never destroyed: stage threads may outlive statics
  return *choice;
}

int KernelChoice::row_class(int64_t rows) {
  if (rows <= 1) return 0;
  if (rows <= 3) return 1;
  if (rows <= 5) return 2;
  if (rows <= 11) return 3;
  if (rows <= 47) return 4;
  return 5;
}

int KernelChoice::variants(WeightType type) { return (fixed_prefetch() < 0 ? 2 : 1) * (dot_is_measured(type) ? 2 : 1); }

KernelVariant KernelChoice::variant(WeightType type, int slot) {
  KernelVariant v;
  int rest = slot;
  if (fixed_prefetch() < 0) {
    v.prefetch = rest % 2 == 1;
    rest /= 2;
  } else {
    v.prefetch = fixed_prefetch() == 1;
  }
  // Not a choice: VPDPBUSD does less work.
  v.vnni = (type == WeightType::kInt4 || type == WeightType::kInt8) && cpu_has_avx512_vnni();
  if (type == WeightType::kBFloat16 && cpu_has_avx512_bf16())
    v.native_bf16 = dot_is_measured(type) ? rest % 2 == 1 : fixed_dot() == 1;
  return v;
}

KernelChoice::Class& KernelChoice::of(WeightType type, int64_t rows) const {
  return classes_[static_cast<int>(type) * kRowClasses + row_class(rows)];
}

KernelChoice::Pick KernelChoice::pick(WeightType type, int64_t rows) {
  const int count = variants(type);
  if (count == 1) return {variant(type, 0), -1};
  Class& c = of(type, rows);
  const int decided = c.decided.load(std::memory_order_acquire);
  if (decided >= 0) return {variant(type, decided), -1};
  // The slots in turn, skipping dropped ones (never all of them: the best is never dropped).
  const unsigned dropped = c.dropped.load(std::memory_order_acquire);
  int slot = 0;
  do {
    slot = static_cast<int>(c.next.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(count));
  } while ((dropped >> slot) & 1u);
  return {variant(type, slot), slot};
}

void KernelChoice::record(WeightType type, int64_t rows, int slot, int64_t bytes, double seconds) {
  const int count = variants(type);
  if (slot < 0 || slot >= count || seconds <= 0) return;
  Class& c = of(type, rows);
  std::lock_guard lock(c.mutex);
  if (c.decided.load(std::memory_order_relaxed) >= 0) return;
  c.bytes[slot] += static_cast<double>(bytes);
  c.seconds[slot] += seconds;
  ++c.samples[slot];
  auto rate = [&c](int s) { return c.bytes[s] / c.seconds[s]; };
  unsigned dropped = c.dropped.load(std::memory_order_relaxed);
  // Nothing is compared before every slot still tried has its first look.
  int best = -1;
  for (int s = 0; s < count; ++s) {
    if ((dropped >> s) & 1u) continue;
    if (c.samples[s] < kFirstLook) return;
    if (best < 0 || rate(s) > rate(best)) best = s;
  }
  bool all_sampled = true;
  int left = 0;
  for (int s = 0; s < count; ++s) {
    if ((dropped >> s) & 1u) continue;
    if (rate(s) * kClearlySlower < rate(best)) {
      dropped |= 1u << s;
      continue;
    }
    ++left;
    all_sampled = all_sampled && c.samples[s] >= kSamples;
  }
  c.dropped.store(dropped, std::memory_order_release);
  if (left > 1 && !all_sampled) return;
  c.decided.store(best, std::memory_order_release);
  std::string rates;
  for (int s = 0; s < count; ++s) {
    char rate_text[96];
    std::snprintf(rate_text, sizeof rate_text, " %.1f GB/s over %d pieces%s", rate(s) / 1e9, c.samples[s],
                  s != best && ((dropped >> s) & 1u) ? " (dropped: clearly slower)" : "");
    rates += (s ? "; " : "") + describe(type, variant(type, s)) + rate_text;
  }
  log::info(std::string("panel kernels: ") + type_name(type) + " products of " + class_name(row_class(rows)) + ": " +
            describe(type, variant(type, best)) + " (measured " + rates + ")");
}

int KernelChoice::decided(WeightType type, int row_class) const {
  if (row_class < 0 || row_class >= kRowClasses) return -1;
  if (variants(type) == 1) return 0;
  const int rows[kRowClasses] = {1, 2, 4, 6, 12, 48};
  return of(type, rows[row_class]).decided.load(std::memory_order_acquire);
}

}  // namespace libpipe::cpu
