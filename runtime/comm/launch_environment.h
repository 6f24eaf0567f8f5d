// What a cluster launcher tells each process it starts: torchrun's environment (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) or SLURM's (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, SLURM_TASKS_PER_NODE, and the first host of SLURM_JOB_NODELIST). The same command runs on
// every rank, as a torch.distributed script does: rank 0 drives the session and hosts its store at `store`,
// every other rank joins it there.
#pragma once

#include <optional>
#include <string>

namespace libpipe::comm {

struct LaunchEnvironment {
  std::string launcher;  // "torchrun" or "slurm"
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // among the processes on this machine (its GPU index)
  int local_world_size = 1;  // processes on this machine
  std::string store;         // "HOST:PORT" where rank 0's store listens
};

// The launcher's environment, or nothing when no launcher started this process. The store's port is
// LIBPIPE_PORT when set; under torchrun otherwise MASTER_PORT + 1 when torchrun's agent holds MASTER_PORT
// itself (TORCHELASTIC_USE_AGENT_STORE=True, its default), else MASTER_PORT; under SLURM MASTER_PORT, else
// 29500. The host is MASTER_ADDR (under SLURM, when set; else the first host of the node list). Throws
// Error(InvalidArgument) naming the variables for an environment that is half set (RANK without
// WORLD_SIZE, a rank not below the world size, a value that is not a number).
std::optional<LaunchEnvironment> launch_environment();

// The first host of a SLURM node list, as `scontrol show hostnames` expands it: "node[07-09,12],gpu1" ->
// "node07". Throws Error(InvalidArgument) for a list it cannot read.
std::string first_host(const std::string& nodelist);

}  // namespace libpipe::comm
