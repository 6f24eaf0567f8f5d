// The transport between processes for CPU stages: one TCP connection per pair of ranks, each authenticated
// with the session's secret before anything else crosses it, carrying messages in the wire format
// (wire.h), checked against its limits before anything is allocated.
//
// Why not Gloo's connections (what libpipe used before): Gloo's listener hands a connection to whichever pair
// waits for the 8-byte sequence number it sends first, with no check of who sent it, so anyone who reaches
// the port while a session starts can take a rank's place (and read or write its activations), and bytes it
// does not expect end the process. Here each rank listens only on its own address, and only until its peers
// have connected; a connection is a peer's only if it proves it holds the token for that pair of ranks; any
// other is closed and logged, and setup goes on.
//
// Setup: rank r listens on `host` (a free port), publishes "libpipe/tcp/<r>" = "HOST:PORT" in the store,
// connects to every lower rank (sending its rank, then authenticating as the connector for "link <r>-<q>")
// and accepts every higher one, all within `timeout`.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "runtime/comm/auth.h"
#include "runtime/comm/transport.h"

namespace libpipe::comm {

// Throws Error(Communication) naming the ranks that did not connect (or could not be reached) in time.
std::unique_ptr<Transport> make_tcp_transport(c10d::Store& store, const Secret& secret, int rank, int world_size,
                                              const std::string& host, std::chrono::milliseconds timeout);

}  // namespace libpipe::comm
