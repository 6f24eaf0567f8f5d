// The rendezvous store a session's driver hosts: a key-value map its workers use to join (claim a rank,
// learn the transport, find each other's addresses) and to send their heartbeats.
//
// Why not c10d's TCPStore: it listens on every interface whatever host it is given (its libuv server binds
// "::" or 0.0.0.0), and anyone who reaches the port may read and write any key: claim a rank, learn the
// session's addresses, fake a worker's heartbeat. This server listens only on the address asked for, and a
// connection gets no answer to anything until it has proved that it holds the session's secret (auth.h); a
// connection that fails to, or breaks the protocol's bounds (store_protocol.h), is closed and logged, and the
// session goes on as if it never came.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/auth.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/comm/socket.h"

namespace libpipe::comm {

class StoreServer {
 public:
  // Listens at `address` (port 0: a free one) for at most `max_clients` authenticated connections at once.
  // `handshake_timeout` bounds how long a new connection may take to authenticate. Throws
  // Error(Communication) when it cannot listen there.
  StoreServer(const Address& address, Secret secret, int max_clients, std::chrono::milliseconds handshake_timeout);
  // Closes every connection and waits for their threads.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The address it listens on, with the port it got.
  const Address& address() const { return address_; }
  // Connections refused so far: failed authentication, broken bounds, or over the limits.
  uint64_t refused() const { return refused_.load(); }

  // At most this many connections may be authenticating at once; more are closed at once.
  static constexpr int kMaxHandshakes = 64;

 private:
  struct Connection {
    std::shared_ptr<Socket> socket;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop();
  void serve(Connection& c, std::string peer);
  // One request; false when the connection must close (it did, or broke a bound: `why` says which).
  bool answer(const Socket& s, const std::string& peer, std::string& why);
  void refuse(const std::string& peer, const std::string& why);
  void reap();

  Address address_;
  Secret secret_;
  const int max_clients_;
  const std::chrono::milliseconds handshake_timeout_;
  Socket listener_;

  std::mutex mutex_;
  std::condition_variable changed_;  // a key was set or added, or the server stops
  std::map<std::string, std::vector<uint8_t>> data_;
  uint64_t stored_bytes_ = 0;
  bool stopping_ = false;
  std::list<Connection> connections_;  // under mutex_
  int clients_ = 0;                    // authenticated, under mutex_
  std::atomic<int> handshakes_{0};
  std::atomic<uint64_t> refused_{0};
  std::thread acceptor_;
};

}  // namespace libpipe::comm
