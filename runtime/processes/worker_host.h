// A worker process: joins a session through its driver's rendezvous store, receives its stages,
// and runs them as a pipeline of its own (a thread per stage) between the previous rank and the
// next one, until the driver ends the session.
#pragma once

#include <chrono>
#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "runtime/comm/transport.h"

namespace libpipe::processes {

struct WorkerOptions {
  int rank = 0;
  int world_size = 0;
  std::string store;                              // "HOST:PORT" of the driver's store
  std::string token;                              // the session's secret (comm/auth.h); empty: LIBPIPE_TOKEN
  std::chrono::milliseconds comm_timeout{60000};  // reaching the store, receiving the stages
  int threads_per_stage = 0;                      // 0: as the driver says
};

// Returns when the driver ends the session. Throws Error: Communication when the store, the
// driver or a peer cannot be reached or goes away (a driver whose store stops answering this
// worker's heartbeats for the comm timeout is gone); InvalidArgument for bad options; a stage's
// own load error (NotFound, Input, ...) after reporting it to the driver.
void serve_worker(const WorkerOptions& options);

// The same, on a transport already connected (tests use in-process ranks); stages run on `device`.
// The worker's heartbeats go to `store` (heartbeat.h) until it returns; `comm_timeout` bounds the
// setup and tells when the driver is gone.
void serve(comm::Transport& transport, const c10::Device& device, std::chrono::milliseconds comm_timeout,
           int threads_per_stage, c10::intrusive_ptr<c10d::Store> store);

}  // namespace libpipe::processes
