// Where a stage's work runs: a device and, on a GPU, the stream its kernels are queued on; and how
// values get there. A GPU stage never waits on the host for the GPU: after it queues a
// micro-batch's work it records an event (mark()), and the stage that reads the results makes its
// own stream wait for that event (receive()). Only data that has to reach the CPU waits on the
// host, once per micro-batch. Copies between the CPU and a GPU go through pinned memory;
// copies between GPUs go peer to peer (LibTorch enables peer access where the GPUs have it).
//
// Streams and events are c10's device-generic ones, so none of this needs a CUDA header; on the
// CPU a Place does nothing and costs nothing. A Place is used by one thread at a time.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <map>
#include <memory>

#include "runtime/device/upload.h"
#include <optional>
#include <vector>

namespace libpipe::device {

// The work a value waits for: events recorded on the streams that wrote it. Empty: ready now.
using Ready = std::vector<std::shared_ptr<c10::Event>>;

class Place {
 public:
  // The CPU.
  Place() = default;
  // `device` with a stream of its own from LibTorch's pool, so that stages sharing a GPU overlap
  // (the CPU for a CPU device).
  static Place with_own_stream(const c10::Device& device);
  // `device` with its default stream, for work that must stay ordered with code that queues on
  // the default stream (the NCCL transport).
  static Place with_default_stream(const c10::Device& device);

  const c10::Device& device() const { return device_; }
  bool on_gpu() const { return stream_.has_value(); }

  // Makes this place's device and stream current on the calling thread while the guard lives, so
  // that LibTorch queues the stage's kernels there (nothing on the CPU).
  c10::OptionalStreamGuard activate() const { return c10::OptionalStreamGuard(stream_); }

  // An event after the work queued so far on this place's stream; null on the CPU.
  std::shared_ptr<c10::Event> mark() const;

  // Makes `values` readable by this place's code: after the work in `ready`, with every tensor
  // (in tuples, lists and dicts too) on this place's device. CPU tensors go up through pinned
  // staging buffers on an upload stream (overlapping this place's earlier work), GPU tensors
  // come down into pinned memory (the one host wait), other GPUs' tensors are copied peer to
  // peer; tensors already here stay as they are, marked as used by this stream so their memory
  // is not reused before this place's kernels have read it.
  void receive(std::vector<c10::IValue>& values, const Ready& ready);

  // `value` with its tensors on this place's GPU copied into pinned CPU memory, queued on this
  // place's stream and not waited for: mark() after it, and wait for that event before reading.
  c10::IValue send_to_cpu(const c10::IValue& value) const;

 private:
  c10::Stream copy_stream(c10::DeviceIndex gpu);

  c10::Device device_{c10::kCPU};
  std::optional<c10::Stream> stream_;
  // CPU tensors come up through it, overlapping the stage's work (made on first use).
  std::shared_ptr<Uploader> uploader_;
  // Per other GPU: the stream that copies away from it, waiting for that GPU's events without
  // holding up the stream of the stage that wrote the data.
  std::map<c10::DeviceIndex, c10::Stream> copy_streams_;
};

// Waits on the host until the work in `ready` is done.
void wait(const Ready& ready);

// An event after the work queued so far on the calling thread's current stream of `device` (a
// caller's pending work on its inputs); null for the CPU.
std::shared_ptr<c10::Event> mark_current(const c10::Device& device);

// Marks the GPU tensors in `value` as used by the calling thread's current streams: memory a
// stage allocated is then not reused before the caller's own kernels have read it.
void lend_to_current_streams(const c10::IValue& value);

// True if `value` holds a tensor that is not on the CPU.
bool holds_gpu_tensor(const c10::IValue& value);

}  // namespace libpipe::device
