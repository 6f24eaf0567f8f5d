#include "runtime/processes/rank_device.h"

#include "runtime/comm/launch_environment.h"
#include "runtime/device/cuda_library.h"
#include "runtime/error.h"

namespace libpipe::processes {

c10::Device gpu_for(int local_index, int gpu_count) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_index % gpu_count));
}

std::optional<c10::Device> own_gpu(int rank, std::string* why) {
  const int count = device::cuda_device_count(why);
  if (count < 1) return std::nullopt;
  const auto launch = comm::launch_environment();
  return gpu_for(launch ? launch->local_rank : rank, count);
}

c10::Device nccl_device(int rank) {
  std::string why;
  const auto gpu = own_gpu(rank, &why);
  if (!gpu) throw Error(Status::Unsupported, "the NCCL transport needs a CUDA device, but " + why);
  return *gpu;
}

}  // namespace libpipe::processes
