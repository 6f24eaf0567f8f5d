// TCP sockets for the connections between a session's processes: listening only on the address asked for,
// and every connect, accept, read and write bounded by a deadline (or aborted by shutdown from another
// thread), so that a silent or slow peer never holds a thread forever.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace libpipe::comm {

struct Address;

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// "No deadline": wait as long as it takes (only where another thread can shut the socket down).
inline Deadline no_deadline() { return Deadline::max(); }
inline Deadline deadline_in(std::chrono::milliseconds ms) { return Clock::now() + ms; }

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close();
  // Wakes every thread blocked on this socket (its reads and writes fail); the fd stays open. Thread-safe.
  void shutdown();

  // Reads exactly `n` bytes. Throws Error(Communication) naming `peer` when the connection closes or fails,
  // or when `deadline` passes first.
  void read_exact(void* data, size_t n, Deadline deadline, const std::string& peer) const;
  void write_all(const void* data, size_t n, Deadline deadline, const std::string& peer) const;
  // Whether bytes (or the end of the stream) can be read before `deadline`; false when it passed.
  bool wait_readable(Deadline deadline) const;

  // "HOST:PORT" of the other end, or "" when unknown.
  std::string peer_name() const;
  // The port this socket is bound to (a listener given port 0).
  uint16_t local_port() const;

 private:
  int fd_ = -1;
};

// A listening socket bound to `address.host` exactly (never the wildcard address, whatever the host
// resolves to first: the first of its addresses that this machine has), port `address.port` (0: a free
// port). Throws Error(Communication) saying what to do when the host is not this machine's or the port is
// taken.
Socket listen_on(const Address& address, const std::string& role);

// Accepts one connection, or returns an invalid Socket when `deadline` passes (or the listener was shut
// down). The connection has TCP_NODELAY set.
Socket accept_one(const Socket& listener, Deadline deadline);

// Connects to `address`, retrying refused connections until `deadline` (the peer may not listen yet).
// Throws Error(Communication) naming the address after the deadline. `local_host`, when given, receives
// the numeric address of this end (the interface on the route to the peer).
Socket connect_to(const Address& address, Deadline deadline, const std::string& role,
                  std::string* local_host = nullptr);

}  // namespace libpipe::comm
