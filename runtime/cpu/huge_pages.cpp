#include "runtime/cpu/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>

namespace libpipe::cpu {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}

HugePageBuffer::HugePageBuffer(size_t bytes) : size_(bytes) {
  // Small buffers are not worth a huge page (and would waste most of one).
  const bool huge = bytes >= kHugePage;
  const size_t length = huge ? (bytes + 2 * kHugePage - 1) / kHugePage * kHugePage : (bytes ? bytes : 1);
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  mapping_ = p;
  mapped_ = length;
  auto address = reinterpret_cast<uintptr_t>(p);
  if (huge) {
    address = (address + kHugePage - 1) / kHugePage * kHugePage;
    // Advice only: where THP is off this fails, and the pages are ordinary ones.
    (void)madvise(reinterpret_cast<void*>(address), (bytes + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);
  }
  data_ = reinterpret_cast<void*>(address);  // anonymous pages read as zeros
}

HugePageBuffer::~HugePageBuffer() {
  if (mapping_) munmap(mapping_, mapped_);
}

}  // namespace libpipe::cpu
