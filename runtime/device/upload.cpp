#include "runtime/device/upload.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

namespace libpipe::device {

Uploader::Uploader(const c10::Device& device, size_t chunk_bytes)
    : device_(device),
      stream_(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(device, false)),
      chunk_bytes_(chunk_bytes) {}

Uploader::~Uploader() {
  // The buffers go back to LibTorch's pinned-memory cache only once no copy reads them.
  try {
    finish();
  } catch (...) {}
}

at::Tensor Uploader::upload(const at::Tensor& cpu, std::optional<at::ScalarType> dtype) {
  const at::Tensor src = cpu.contiguous();
  c10::StreamGuard guard(stream_);
  at::Tensor dst = at::empty(src.sizes(), src.options().device(device_));
  const size_t bytes = src.nbytes();
  const auto* from = static_cast<const char*>(src.const_data_ptr());
  auto* to = static_cast<char*>(dst.data_ptr());
  for (size_t offset = 0; offset < bytes; offset += chunk_bytes_) {
    const size_t n = std::min(chunk_bytes_, bytes - offset);
    const int slot = next_;
    next_ ^= 1;
    if (!buffers_[slot].defined())
      buffers_[slot] =
          at::empty({static_cast<int64_t>(chunk_bytes_)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    if (in_use_[slot]) in_use_[slot]->synchronize();  // the copy before last from this buffer
    // LibTorch's copy, not memcpy: it spreads a large copy over the calling thread's intra-op
    // threads, which one core's memcpy cannot keep up with against the transfer.
    buffers_[slot]
        .narrow(0, 0, static_cast<int64_t>(n))
        .copy_(at::from_blob(const_cast<char*>(from) + offset, {static_cast<int64_t>(n)}, at::kByte));
    at::Tensor device_bytes =
        at::from_blob(to + offset, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device_));
    device_bytes.copy_(buffers_[slot].narrow(0, 0, static_cast<int64_t>(n)), /*non_blocking=*/true);
    if (!in_use_[slot]) in_use_[slot] = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    in_use_[slot]->record(stream_);
  }
  if (dtype && *dtype != dst.scalar_type()) dst = dst.to(*dtype);
  return dst;
}

void Uploader::finish() { stream_.synchronize(); }

}  // namespace libpipe::device
