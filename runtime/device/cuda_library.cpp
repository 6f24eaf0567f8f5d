#include "runtime/device/cuda_library.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <dlfcn.h>

#include "runtime/error.h"

namespace libpipe::device {

namespace {

struct CudaLibrary {
  int devices = 0;
  std::string why;  // why there are none
};

// libtorch_cuda.so beside the libtorch_cpu.so this process loaded (the same LibTorch, whatever
// run path or interposer stands between libpipe and dlopen: AddressSanitizer's dlopen resolves
// bare names with its own run path, not libpipe's). The bare name is the fallback.
std::string torch_cuda_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&at::detail::getCUDAHooks), &info) && info.dli_fname) {
    std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    if (slash != std::string::npos) return path.substr(0, slash + 1) + "libtorch_cuda.so";
  }
  return "libtorch_cuda.so";
}

const CudaLibrary& cuda_library() {
  static const CudaLibrary library = [] {
    CudaLibrary l;
    // RTLD_GLOBAL: its registrations must be visible to LibTorch's CPU library, which looks them
    // up by name.
    if (!dlopen(torch_cuda_path().c_str(), RTLD_NOW | RTLD_GLOBAL) &&
        !dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL)) {
      l.why = std::string("LibTorch's CUDA library could not be loaded (") + dlerror() +
              "); this LibTorch may be a CPU-only build";
      return l;
    }
    try {
      l.devices = static_cast<int>(at::detail::getCUDAHooks().deviceCount());
    } catch (const c10::Error& e) {
      l.why = std::string("CUDA reports no usable device: ") + e.what_without_backtrace();
      return l;
    }
    if (l.devices == 0) l.why = "this machine has no CUDA device (or CUDA_VISIBLE_DEVICES hides them all)";
    return l;
  }();
  return library;
}

}  // namespace

int cuda_device_count(std::string* why) {
  const CudaLibrary& l = cuda_library();
  if (why) *why = l.why;
  return l.devices;
}

void require_device(const c10::Device& device, const std::string& who) {
  if (device.is_cpu()) return;
  if (!device.is_cuda())
    throw Error(Status::Unsupported,
                who + " is on " + device.str() + ", but libpipe runs stages on the CPU and on CUDA devices only");
  std::string why;
  const int count = cuda_device_count(&why);
  if (count == 0) throw Error(Status::Unsupported, who + " is on " + device.str() + ", but " + why);
  if (device.index() >= count)
    throw Error(Status::Unsupported, who + " is on " + device.str() + ", but only " + std::to_string(count) +
                                         " CUDA device" + (count == 1 ? " is" : "s are") + " visible (cuda:0" +
                                         (count > 1 ? "..cuda:" + std::to_string(count - 1) : "") + ")");
}

void require_device_memory(const void* data, const c10::Device& device, const std::string& who) {
  try {
    require_device(device, who);
  } catch (const Error& e) {
    throw Error(Status::Input, e.what());
  }
  if (!data) return;  // an empty tensor
  c10::Device owner(c10::kCPU);
  try {
    owner = at::detail::getCUDAHooks().getDeviceFromPtr(const_cast<void*>(data));
  } catch (const c10::Error&) {
    throw Error(Status::Input, who + " says it is on " + device.str() +
                                   " but its memory is not GPU memory of this process (host memory, or another "
                                   "process's); pass a CPU tensor, or a pointer from this process's CUDA allocations");
  }
  if (owner.index() != device.index())
    throw Error(Status::Input, who + " says it is on " + device.str() + " but its memory is on " +
                                   c10::Device(c10::kCUDA, owner.index()).str());
}

}  // namespace libpipe::device
