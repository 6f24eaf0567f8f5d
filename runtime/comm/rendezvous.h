// Rendezvous through c10d's TCPStore: the driver (rank 0) hosts the store, workers connect to it.
// Every step is bounded by our own deadline: TCPStore's client retries a refused connect with a
// backoff that overruns its timeout, so the address is probed first with plain sockets. Both
// ends silence c10's own stderr logging (process-wide) below fatal: libpipe reports the errors.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace libpipe::comm {

struct Address {
  std::string host;
  uint16_t port = 0;
};

// Parses "HOST:PORT" ("[v6]:PORT" too). Throws Error(InvalidArgument) saying what is wrong.
Address parse_address(const std::string& text, const std::string& what);

// Hosts the store on address.port (all interfaces), after checking that address.host resolves to
// an address of this machine. Throws Error(Communication) naming the address and what to do.
c10::intrusive_ptr<c10d::Store> host_store(const Address& address, int world_size, std::chrono::milliseconds timeout);

// Connects to the store at `address`, trying until `timeout` passes. Throws Error(Communication)
// naming the address. `local_host` receives this machine's address on the route to the store
// (what this rank's transport should listen on).
c10::intrusive_ptr<c10d::Store> connect_store(const Address& address, std::chrono::milliseconds timeout,
                                              std::string* local_host);

// The driver's side of joining: publishes the session (protocol, world size, transport name),
// then waits until every worker rank 1..world_size-1 has joined, or throws Error(Communication)
// after `timeout` naming the missing ranks and the command that starts them.
void announce_session(c10d::Store& store, int world_size, const std::string& transport);
void wait_for_workers(c10d::Store& store, int world_size, const std::string& address, std::chrono::milliseconds timeout);

// A worker's side: checks the protocol and world size, claims `rank`, and returns the transport
// name. Throws Error(Communication) for another protocol or a taken rank, Error(InvalidArgument)
// for a world size that differs from the driver's.
std::string join_session(c10d::Store& store, int rank, int world_size);

}  // namespace libpipe::comm
