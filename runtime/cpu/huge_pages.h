// Memory for weights that a decode step streams: backed by transparent huge pages where the kernel
// allows them (madvise mode, the common default).
//
// A decode step reads every weight once. With 4 KiB pages, two cores streaming a 2-core machine's
// weights reached 25-34 GB/s; on 2 MiB pages, 45-58 GB/s, the machine's read bandwidth (bench/RESULTS.md,
// "Linear layers of few rows"): the page walks of 4 KiB pages cost that much. glibc's malloc never asks
// for huge pages, so weights get a mapping of their own, aligned to 2 MiB and marked MADV_HUGEPAGE
// before anything touches it. Where the kernel refuses (THP off), the mapping is plain pages: correct,
// only slower.
#pragma once

#include <cstddef>

namespace libpipe::cpu {

class HugePageBuffer {
 public:
  // At least `bytes` bytes, zero-filled, 64-byte aligned (2 MiB aligned when huge pages are used).
  // Throws std::bad_alloc when the memory cannot be mapped.
  explicit HugePageBuffer(size_t bytes);
  ~HugePageBuffer();
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* mapping_ = nullptr;
  size_t mapped_ = 0;
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace libpipe::cpu
