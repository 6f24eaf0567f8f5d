#include "runtime/comm/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "runtime/comm/rendezvous.h"
#include "runtime/error.h"

namespace libpipe::comm {

namespace {

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

void resolve(const Address& address, AddrInfo& out, const std::string& role, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_NUMERICSERV;
  const std::string port = std::to_string(address.port);
  const int rc = getaddrinfo(address.host.c_str(), port.c_str(), &hints, &out.list);
  if (rc != 0)
    throw Error(Status::Communication, role + " address " + format_address(address) + ": host '" + address.host +
                                           "' does not resolve (" + gai_strerror(rc) + "); give a host name or IP " +
                                           "address the processes can reach");
}

// Milliseconds poll() may wait before `deadline`: -1 for none, 0 once it passed.
int poll_timeout(Deadline deadline) {
  if (deadline == no_deadline()) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left + 1, 60'000));
}

// Waits for `events` on fd until `deadline`; false when it passed.
bool wait_for(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int timeout = poll_timeout(deadline);
    const int n = ::poll(&p, 1, timeout);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return true;  // let the read or write report the error
    if (n == 0 && deadline != no_deadline() && Clock::now() >= deadline) return false;
  }
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string numeric(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (getnameinfo(sa, len, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) return "";
  Address a;
  a.host = host;
  a.port = static_cast<uint16_t>(std::atoi(port));
  return format_address(a);
}

}  // namespace

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

bool Socket::wait_readable(Deadline deadline) const { return wait_for(fd_, POLLIN, deadline); }

void Socket::read_exact(void* data, size_t n, Deadline deadline, const std::string& peer) const {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t got = ::recv(fd_, p, n, 0);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0) throw Error(Status::Communication, "the connection to " + peer + " closed");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      throw Error(Status::Communication, "the connection to " + peer + " failed: " + std::strerror(errno));
    if (!wait_for(fd_, POLLIN, deadline))
      throw Error(Status::Communication, peer + " sent nothing before the deadline");
  }
}

void Socket::write_all(const void* data, size_t n, Deadline deadline, const std::string& peer) const {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      throw Error(Status::Communication, "the connection to " + peer + " failed: " + std::strerror(errno));
    if (!wait_for(fd_, POLLOUT, deadline))
      throw Error(Status::Communication, peer + " took nothing before the deadline");
  }
}

std::string Socket::peer_name() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  return numeric(reinterpret_cast<sockaddr*>(&ss), len);
}

uint16_t Socket::local_port() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

Socket listen_on(const Address& address, const std::string& role) {
  AddrInfo ai;
  resolve(address, ai, role, true);
  int last = 0;
  bool address_in_use = false;
  for (const addrinfo* p = ai.list; p; p = p->ai_next) {
    Socket s(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
    if (!s.valid()) continue;
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (p->ai_family == AF_INET6) ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (::bind(s.fd(), p->ai_addr, p->ai_addrlen) != 0) {
      last = errno;
      address_in_use = address_in_use || errno == EADDRINUSE;
      continue;
    }
    if (::listen(s.fd(), 128) != 0) {
      last = errno;
      continue;
    }
    set_nonblocking(s.fd());
    return s;
  }
  if (address_in_use)
    throw Error(Status::Communication, "cannot listen for " + role + " at " + format_address(address) +
                                           ": the port is in use (pick a free one, or give port 0 to let the " +
                                           "system pick one)");
  throw Error(Status::Communication, "cannot listen for " + role + " at " + format_address(address) + " (" +
                                         std::strerror(last) + "): '" + address.host +
                                         "' is not an address of this machine; give one of its own addresses " +
                                         "(127.0.0.1 when every process runs here)");
}

Socket accept_one(const Socket& listener, Deadline deadline) {
  for (;;) {
    if (!wait_for(listener.fd(), POLLIN, deadline)) return Socket();
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int fd = ::accept4(listener.fd(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      set_nodelay(fd);
      return Socket(fd);
    }
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // Out of descriptors for now: do not spin, and let the caller's deadline decide.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (deadline != no_deadline() && Clock::now() >= deadline) return Socket();
      continue;
    }
    return Socket();  // the listener was shut down or closed
  }
}

Socket connect_to(const Address& address, Deadline deadline, const std::string& role, std::string* local_host) {
  AddrInfo ai;
  resolve(address, ai, role, false);
  int last = 0;
  for (;;) {
    for (const addrinfo* p = ai.list; p; p = p->ai_next) {
      Socket s(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, p->ai_protocol));
      if (!s.valid()) {
        last = errno;
        continue;
      }
      if (::connect(s.fd(), p->ai_addr, p->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
          last = errno;
          continue;
        }
        if (!wait_for(s.fd(), POLLOUT, deadline)) {
          last = ETIMEDOUT;
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
          last = err;
          continue;
        }
      }
      set_nodelay(s.fd());
      if (local_host) {
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        char host[NI_MAXHOST] = {};
        if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len) == 0 &&
            getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) == 0)
          *local_host = host;
      }
      return s;
    }
    if (Clock::now() >= deadline)
      throw Error(Status::Communication, "nothing answered for " + role + " at " + format_address(address) + " (" +
                                             std::strerror(last) + "); is it running, and is that its address?");
    std::this_thread::sleep_for(std::min(
        std::chrono::milliseconds(50), std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now())));
  }
}

}  // namespace libpipe::comm
