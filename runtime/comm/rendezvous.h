// Rendezvous through libpipe's own store (store_server.h): the driver (rank 0) hosts it on the address
// asked for, workers connect to it, and every connection proves it holds the session's secret (auth.h)
// before it may read or write a key. Every step is bounded by a deadline.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace libpipe::comm {

class Secret;
class StoreServer;

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

// What the driver hosts: the store's server, this process's own connection to it, and the address it
// listens on (the port it got when 0 was asked for).
struct HostedStore {
  std::shared_ptr<StoreServer> server;
  c10::intrusive_ptr<c10d::Store> store;
  Address address;
};

// Hosts the store on exactly address.host (an address of this machine; never the wildcard), port
// address.port (0: a free port the system picks). As soon as it listens it logs, at INFO, exactly
// "store listening on HOST:PORT" with the port it got: the documented way (pipe.h, store option) for a
// program to learn a picked port before waiting for its workers. Throws Error(Communication) naming the
// address and what to do.
HostedStore host_store(const Address& address, const Secret& secret, int world_size, std::chrono::milliseconds timeout);

// Connects to the store at `address`, trying until `timeout` passes, and authenticates. Throws
// Error(Communication) naming the address. `local_host` receives this machine's address on the route to
// the store (what this rank's transport should listen on).
c10::intrusive_ptr<c10d::Store> connect_store(const Address& address, const Secret& secret,
                                              std::chrono::milliseconds timeout, std::string* local_host);

// The driver's side of joining: publishes the session (protocol, world size, transport name),
// then waits until every worker rank 1..world_size-1 has joined, or throws Error(Communication)
// after `timeout` naming the missing ranks and the command that starts them.
void announce_session(c10d::Store& store, int world_size, const std::string& transport);
void wait_for_workers(c10d::Store& store, int world_size, const std::string& address,
                      std::chrono::milliseconds timeout);

// A worker's side: checks the protocol and world size, claims `rank`, tells the device its stages would
// use when the process chooses ("cuda:N" or "cpu": schedule/rank_device.h), and returns the transport
// name. Throws Error(Communication) for another protocol or a taken rank, Error(InvalidArgument)
// for a world size that differs from the driver's.
std::string join_session(c10d::Store& store, int rank, int world_size, const std::string& own_device);

// The driver's side, once `rank` joined: the device it told. Throws Error(Communication) for one that is
// not a device.
c10::Device joined_device(c10d::Store& store, int rank);

}  // namespace libpipe::comm
