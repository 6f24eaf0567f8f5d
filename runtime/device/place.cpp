#include "runtime/device/place.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>
#include <set>

namespace libpipe::device {

namespace {

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

// Calls `visit` on every defined tensor in `value`, through tuples, lists and dicts.
void for_each_tensor(const c10::IValue& value, const std::function<void(const at::Tensor&)>& visit) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) visit(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& e : value.toTupleRef().elements()) for_each_tensor(e, visit);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList())
      if (t.defined()) visit(t);
  } else if (value.isList()) {
    for (const c10::IValue& e : value.toListRef()) for_each_tensor(e, visit);
  } else if (value.isGenericDict()) {
    for (const auto& kv : value.toGenericDict()) for_each_tensor(kv.value(), visit);
  }
}

// `value` with every defined tensor replaced by `fn(tensor)`; containers are rebuilt with the same
// element types.
c10::IValue map_tensors(const c10::IValue& value, const TensorFn& fn) {
  if (value.isTensor()) return value.toTensor().defined() ? c10::IValue(fn(value.toTensor())) : value;
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& e : value.toTupleRef().elements()) items.push_back(map_tensors(e, fn));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(t.defined() ? fn(t) : t);
    return out;
  }
  if (value.isList()) {
    auto in = value.toList();
    c10::impl::GenericList out(in.elementType());
    for (size_t i = 0; i < in.size(); ++i) out.push_back(map_tensors(in.get(i), fn));
    return out;
  }
  if (value.isGenericDict()) {
    auto in = value.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), in.valueType());
    for (const auto& kv : in) out.insert(kv.key(), map_tensors(kv.value(), fn));
    return out;
  }
  return value;
}

bool holds_tensor_off(const c10::IValue& value, const c10::Device& device) {
  bool off = false;
  for_each_tensor(value, [&](const at::Tensor& t) { off = off || t.device() != device; });
  return off;
}

const c10::impl::VirtualGuardImpl& cuda() {
  static const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl;
}

// Tells the caching allocator that `stream` reads `t`: its memory is not given to other work
// until what `stream` has queued so far is done, whichever stream allocated it. (Memory the
// allocator does not own, such as a caller's DLPack tensor, is left alone by it.)
void used_by(const at::Tensor& t, const c10::Stream& stream) {
  if (t.is_cuda() && t.has_storage()) cuda().recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

at::Tensor pinned_like(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
}

}  // namespace

Place Place::with_own_stream(const c10::Device& device) {
  Place p;
  p.device_ = device;
  if (device.is_cuda()) p.stream_ = cuda().getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  return p;
}

Place Place::with_default_stream(const c10::Device& device) {
  Place p;
  p.device_ = device;
  if (device.is_cuda()) p.stream_ = cuda().getDefaultStream(device);
  return p;
}

std::shared_ptr<c10::Event> Place::mark() const {
  if (!stream_) return nullptr;
  auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  event->record(*stream_);
  return event;
}

c10::Stream Place::copy_stream(c10::DeviceIndex gpu) {
  auto it = copy_streams_.find(gpu);
  if (it == copy_streams_.end())
    it = copy_streams_.emplace(gpu, cuda().getStreamFromGlobalPool(c10::Device(c10::kCUDA, gpu), false)).first;
  return it->second;
}

void Place::receive(std::vector<c10::IValue>& values, const Ready& ready) {
  if (!stream_) {
    // To the CPU: each GPU's tensors come down on a copy stream that first waits for the writers;
    // then one host wait per GPU involved.
    bool any = false;
    for (const auto& v : values) any = any || holds_gpu_tensor(v);
    if (!any) return;
    std::set<c10::DeviceIndex> used;
    for (auto& v : values)
      v = map_tensors(v, [&](const at::Tensor& t) {
        if (t.is_cpu()) return t;
        const c10::Stream copy = copy_stream(t.device().index());
        if (used.insert(t.device().index()).second)
          for (const auto& e : ready)
            if (e) e->block(copy);
        c10::StreamGuard guard(copy);
        at::Tensor host = pinned_like(t);
        host.copy_(t, /*non_blocking=*/true);
        used_by(t, copy);
        return host;
      });
    for (c10::DeviceIndex gpu : used) copy_stream(gpu).synchronize();
    return;
  }
  const c10::Stream stream = *stream_;
  for (const auto& e : ready)
    if (e) e->block(stream);
  std::set<c10::DeviceIndex> waited;  // copy streams of other GPUs that already wait for `ready`
  bool uploaded = false;
  for (auto& v : values) {
    if (!holds_tensor_off(v, device_)) {
      for_each_tensor(v, [&](const at::Tensor& t) { used_by(t, stream); });
      continue;
    }
    v = map_tensors(v, [&](const at::Tensor& t) -> at::Tensor {
      if (t.device() == device_) {
        used_by(t, stream);
        return t;
      }
      if (t.is_cpu()) {
        if (!uploader_) uploader_ = std::make_shared<Uploader>(device_);
        at::Tensor here;
        if (t.is_pinned()) {
          // Already pinned: one asynchronous copy (LibTorch's host allocator keeps the block
          // until it is done).
          c10::StreamGuard guard(uploader_->stream());
          here = t.to(device_, /*non_blocking=*/true);
        } else {
          here = uploader_->upload(t);
        }
        used_by(here, stream);
        uploaded = true;
        return here;
      }
      // Another GPU: LibTorch copies on the source GPU's current stream, ordered both ways with
      // the destination's current stream; make those the copy stream and this place's stream.
      const c10::Stream copy = copy_stream(t.device().index());
      if (waited.insert(t.device().index()).second)
        for (const auto& e : ready)
          if (e) e->block(copy);
      const c10::Stream both[] = {stream, copy};
      c10::MultiStreamGuard guard(both);
      at::Tensor here = t.to(device_, /*non_blocking=*/true);
      used_by(t, copy);
      return here;
    });
  }
  if (uploaded) {
    c10::Event up(c10::DeviceType::CUDA);
    up.record(uploader_->stream());
    up.block(stream);
  }
}

c10::IValue Place::send_to_cpu(const c10::IValue& value) const {
  if (!stream_ || !holds_gpu_tensor(value)) return value;
  c10::StreamGuard guard(*stream_);
  return map_tensors(value, [&](const at::Tensor& t) {
    if (t.is_cpu()) return t;
    at::Tensor host = pinned_like(t);
    host.copy_(t, /*non_blocking=*/true);
    used_by(t, *stream_);
    return host;
  });
}

void wait(const Ready& ready) {
  for (const auto& e : ready)
    if (e) e->synchronize();
}

std::shared_ptr<c10::Event> mark_current(const c10::Device& device) {
  if (device.is_cpu()) return nullptr;
  auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  event->record(cuda().getStream(device));
  return event;
}

void lend_to_current_streams(const c10::IValue& value) {
  for_each_tensor(value, [](const at::Tensor& t) {
    if (t.is_cuda()) used_by(t, cuda().getStream(t.device()));
  });
}

bool holds_gpu_tensor(const c10::IValue& value) { return holds_tensor_off(value, c10::Device(c10::kCPU)); }

}  // namespace libpipe::device
