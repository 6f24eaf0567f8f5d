// The C ABI: running a worker process that hosts stages for a session driven elsewhere.
#include <cstddef>
#include <cstdlib>

#include "capi/boundary.h"
#include "capi/struct_sizes.h"
#include "runtime/comm/launch_environment.h"
#include "runtime/processes/worker_host.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

extern "C" {

pipe_status pipe_worker_run(const pipe_worker_options* options) {
  return guarded(__func__, [&](const char* fn) {
    require(options, fn, "options");
    require_struct_size(options->struct_size, kWorkerOptions, fn, "options->struct_size");
#define PIPE_HAS(field) (options->struct_size >= offsetof(pipe_worker_options, field) + sizeof(options->field))
    libpipe::processes::WorkerOptions w;
    w.rank = options->rank;
    w.world_size = options->world_size;
    if (options->store) w.store = options->store;
    if (w.rank == 0 && w.world_size == 0) {
      // Neither given: a launcher's rank i serves as rank i + 1 of a driver outside the launch.
      const auto launch = libpipe::comm::launch_environment();
      if (!launch)
        throw Error(Status::InvalidArgument, std::string(fn) +
                                                 ": options->rank and options->world_size are 0 and "
                                                 "no launcher (torchrun, srun) started this process; give both");
      w.rank = launch->rank + 1;
      w.world_size = launch->world_size + 1;
      const char* env = std::getenv("LIBPIPE_STORE");
      if (w.store.empty() && env && *env) w.store = env;
      if (w.store.empty())
        throw Error(Status::InvalidArgument, std::string(fn) + ": launched by " + launch->launcher +
                                                 ", this worker serves a driver outside the launch: give its "
                                                 "store as options->store or LIBPIPE_STORE");
    }
    if (w.store.empty()) {
      const char* env = std::getenv("LIBPIPE_STORE");
      if (env && *env) w.store = env;
    }
    if (w.store.empty()) require(options->store, fn, "options->store");
    if (PIPE_HAS(token) && options->token) w.token = options->token;
    if (PIPE_HAS(comm_timeout_ms)) {
      if (options->comm_timeout_ms < 0)
        throw Error(Status::InvalidArgument, std::string(fn) + ": options->comm_timeout_ms is " +
                                                 std::to_string(options->comm_timeout_ms) +
                                                 "; give 0 (one minute) or more");
      if (options->comm_timeout_ms > 0) w.comm_timeout = std::chrono::milliseconds(options->comm_timeout_ms);
    }
    if (PIPE_HAS(threads_per_stage)) {
      if (options->threads_per_stage < 0)
        throw Error(Status::InvalidArgument, std::string(fn) + ": options->threads_per_stage is " +
                                                 std::to_string(options->threads_per_stage) +
                                                 "; give 0 (the driver's) or more");
      w.threads_per_stage = options->threads_per_stage;
    }
#undef PIPE_HAS
    libpipe::processes::serve_worker(w);
  });
}

}  // extern "C"
