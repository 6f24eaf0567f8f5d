// The Gloo transport: CPU tensors between processes through c10d's Gloo process group (TCP).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "runtime/comm/transport.h"

namespace libpipe::comm {

// Joins the group of `world_size` ranks through `store` (every rank calls this; it returns once
// all are connected, or throws Error(Communication) after `timeout`). `host` is the address this
// rank listens on: one its peers can reach.
std::unique_ptr<Transport> make_gloo_transport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                               const std::string& host, std::chrono::milliseconds timeout);

}  // namespace libpipe::comm
