// CPU tensors to a GPU through pinned memory: a tensor in pageable CPU memory (a view of a
// memory-mapped checkpoint, a CPU stage's output) is copied in chunks through two pinned staging
// buffers on a stream of its own, so that the host's copy into one buffer overlaps the transfer
// from the other, and the host never pins more than the two buffers, however large the tensor.
// Used for stage weights and for micro-batches handed from the CPU to a GPU stage.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>

namespace libpipe::device {

class Uploader {
 public:
  // `device` must be a CUDA device (device::require_device checked it).
  explicit Uploader(const c10::Device& device, size_t chunk_bytes = size_t{16} << 20);
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;
  ~Uploader();

  // `cpu` on the GPU (contiguous), cast to `dtype` there when given. Queued, not waited for.
  at::Tensor upload(const at::Tensor& cpu, std::optional<at::ScalarType> dtype = std::nullopt);
  // Waits until every upload is done; the tensors may then be read on any stream.
  void finish();
  // The stream the copies are queued on (and the uploaded tensors allocated from): readers on
  // other streams wait for an event recorded on it.
  const c10::Stream& stream() const { return stream_; }

 private:
  c10::Device device_;
  c10::Stream stream_;
  size_t chunk_bytes_;
  at::Tensor buffers_[2];
  std::unique_ptr<c10::Event> in_use_[2];  // the copy reading each buffer
  int next_ = 0;
};

}  // namespace libpipe::device
