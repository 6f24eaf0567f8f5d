// The NCCL transport: GPU tensors between processes (one GPU per rank) with ncclSend/ncclRecv.
//
// Built when NCCL and the CUDA runtime were found at configure time (cmake/NCCL.cmake defines
// LIBPIPE_HAVE_NCCL); otherwise the functions below exist and report that NCCL is missing.
//
// Design (see nccl_transport.cpp for the details):
//  - one 2-rank NCCL communicator per ordered pair of ranks (a channel a -> b), each with its own
//    non-blocking comm stream, so a send and a recv never share a communicator: NCCL serializes the
//    kernels of one communicator, and a large send waiting for its peer would block every receive
//    queued behind it (a ring, or two ranks sending to each other, would deadlock);
//  - the communicators are non-blocking (ncclConfig_t::blocking = 0); every wait polls
//    (ncclCommGetAsyncError, cudaStreamQuery, the abort flag), so abort() unblocks it;
//  - connections are set up at creation: a 1-byte send/recv on every channel;
//  - liveness is the process's heartbeat's (runtime/processes/heartbeat.h), which aborts the transport
//    when a peer's counter stops or marks a failure (NCCL alone does not notice a dead peer on one
//    machine: its kernels would wait for ever), and tells it of a peer that ended normally (peer_left).
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "runtime/comm/transport.h"

namespace libpipe::comm {

// True when this libpipe was built with NCCL and the machine has at least one CUDA device;
// otherwise false, and `why` (if not null) says which is missing. Initializes the CUDA runtime of
// this process when NCCL was built in (do not fork without exec after it).
bool nccl_available(std::string* why);

// Joins the NCCL group of `world_size` ranks through `store` (every rank calls this; ranks must
// create their NCCL transports on one store in the same order). `device` is this rank's GPU (one
// GPU per rank; two ranks may not share one). Returns once every channel is connected and warmed
// up, or throws Error(Communication) after `timeout`. `peer_timeout` (zero: `timeout`) is how long a
// receive from a peer that ended normally (peer_left) may still wait before it throws
// Error(Communication); a peer that died is the watching heartbeat's to report (abort()). Throws Error(Unsupported)
// when NCCL was not built in, Error(InvalidArgument) for a bad rank, world size or device.
std::unique_ptr<Transport> make_nccl_transport(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, c10::Device device,
    std::chrono::milliseconds timeout, std::chrono::milliseconds peer_timeout = std::chrono::milliseconds::zero());

}  // namespace libpipe::comm
