// Which GPU a process takes for its own stages, where the process chooses rather than the driver's device
// list: with NCCL, and with devices "auto" across processes. Each worker tells the driver its choice when it
// joins (comm::join_session), so the stages shipped to it are built for the GPU it has.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>

namespace libpipe::processes {

// The rule: the process numbered `local_index` among those of its host takes GPU local_index % gpu_count.
c10::Device gpu_for(int local_index, int gpu_count);

// This process's GPU as rank `rank`: under a launcher (torchrun, srun) its LOCAL_RANK numbers the processes
// of this host; otherwise the rank does (processes started by hand or by --processes, on one host). Nothing
// when the process sees no GPU (`why`, when given, says why).
std::optional<c10::Device> own_gpu(int rank, std::string* why = nullptr);

// own_gpu for the NCCL transport, which needs one: throws Error(Unsupported) saying why there is none.
c10::Device nccl_device(int rank);

}  // namespace libpipe::processes
