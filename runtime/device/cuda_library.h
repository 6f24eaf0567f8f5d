// LibTorch's CUDA side (kernels, the caching allocators, streams and events) lives in
// libtorch_cuda, which libpipe does not link: CPU users would load the CUDA runtime, cuBLAS and
// cuDNN for nothing. It is loaded the first time a session asks for a GPU; loading it registers
// the CUDA device guard, allocators and hooks with LibTorch, after which c10's device-generic
// stream and event API (c10::Stream, c10::Event) works on CUDA without any CUDA header here.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace libpipe::device {

// CUDA devices visible to this process; 0 when there is none or LibTorch's CUDA library cannot be
// loaded (then `why`, if given, says which). Loads the library on first use. Thread-safe.
int cuda_device_count(std::string* why = nullptr);

// Throws Error(Unsupported) saying why `device` cannot be used here (no CUDA library, no GPU, an
// index past the visible GPUs, a device type other than CPU and CUDA). `who` names the user of the
// device in the message ("stage 1"). Thread-safe.
void require_device(const c10::Device& device, const std::string& who);

// Throws Error(Input) unless `data` is memory of CUDA device `device` of this process (a caller's
// DLPack tensor that says it is on a GPU). `who` names it in the message ("inputs[0]").
void require_device_memory(const void* data, const c10::Device& device, const std::string& who);

}  // namespace libpipe::device
