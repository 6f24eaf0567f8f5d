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

// Whether port 0 is accepted: the driver's store may pick a free port itself (the only way to get
// one without racing other processes for it); a worker must be given the port the store got.
enum class PortZero { Refused, PicksAFreePort };

// Parses "HOST:PORT" ("[v6]:PORT" too). Throws Error(InvalidArgument) saying what is wrong.
Address parse_address(const std::string& text, const std::string& what, PortZero zero = PortZero::Refused);

// "HOST:PORT" as parse_address reads it ("[v6]:PORT" for an IPv6 host).
std::string format_address(const Address& address);

// What the driver hosts: the store and the address it listens on (the port it got when 0 was
// asked for).
struct HostedStore {
  c10::intrusive_ptr<c10d::Store> store;
  Address address;
};

// Hosts the store on address.port (all interfaces; 0: a free port the system picks), after
// checking that address.host resolves to an address of this machine. As soon as it listens it
// logs, at INFO, exactly "store listening on HOST:PORT" with the port it got: the documented way
// (pipe.h, store option) for a program to learn a picked port before waiting for its workers.
// Throws Error(Communication) naming the address and what to do.
HostedStore host_store(const Address& address, int world_size, std::chrono::milliseconds timeout);

// Connects to the store at `address`, trying until `timeout` passes. Throws Error(Communication)
// naming the address. `local_host` receives this machine's address on the route to the store
// (what this rank's transport should listen on).
c10::intrusive_ptr<c10d::Store> connect_store(const Address& address, std::chrono::milliseconds timeout,
                                              std::string* local_host);

// The driver's side of joining: publishes the session (protocol, world size, transport name),
// then waits until every worker rank 1..world_size-1 has joined, or throws Error(Communication)
// after `timeout` naming the missing ranks and the command that starts them.
void announce_session(c10d::Store& store, int world_size, const std::string& transport);
void wait_for_workers(c10d::Store& store, int world_size, const std::string& address,
                      std::chrono::milliseconds timeout);

// A worker's side: checks the protocol and world size, claims `rank`, and returns the transport
// name. Throws Error(Communication) for another protocol or a taken rank, Error(InvalidArgument)
// for a world size that differs from the driver's.
std::string join_session(c10d::Store& store, int rank, int world_size);

}  // namespace libpipe::comm
