// The C ABI: what a cluster launcher (torchrun, srun) told this process.
#include <cstddef>
#include <cstring>

#include "capi/boundary.h"
#include "capi/struct_sizes.h"
#include "runtime/comm/launch_environment.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

extern "C" {

pipe_status pipe_launch_from_environment(pipe_launch_info* info, int32_t* found) {
  return guarded(__func__, [&](const char* fn) {
    require(info, fn, "info");
    require(found, fn, "found");
    require_struct_size(info->struct_size, kLaunchInfo, fn, "info->struct_size");
    const auto launch = libpipe::comm::launch_environment();
    if (!launch) {
      *found = 0;
      return;
    }
    pipe_launch_info out = PIPE_LAUNCH_INFO_INIT;
    out.rank = launch->rank;
    out.world_size = launch->world_size;
    out.local_rank = launch->local_rank;
    out.local_world_size = launch->local_world_size;
    if (launch->store.size() >= sizeof out.store)
      throw Error(Status::InvalidArgument, std::string(fn) + ": rank 0's address '" + launch->store +
                                               "' is longer than " + std::to_string(sizeof out.store - 1) + " bytes");
    std::strncpy(out.launcher, launch->launcher.c_str(), sizeof out.launcher - 1);
    std::strncpy(out.store, launch->store.c_str(), sizeof out.store - 1);
    out.struct_size = info->struct_size;
    std::memcpy(info, &out, info->struct_size);
    *found = 1;
  });
}

}  // extern "C"
