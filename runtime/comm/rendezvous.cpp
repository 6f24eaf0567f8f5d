#include "runtime/comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "runtime/error.h"
#include "runtime/libtorch_log.h"
#include "runtime/log.h"

namespace libpipe::comm {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string short_what(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

// Resolves host:port for TCP; throws Error(Communication) when the name does not resolve.
void resolve(const Address& address, AddrInfo& out, const std::string& role) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(address.port);
  const int rc = getaddrinfo(address.host.c_str(), port.c_str(), &hints, &out.list);
  if (rc != 0)
    throw Error(Status::Communication, role + " address " + format_address(address) + ": host '" + address.host +
                                           "' does not resolve (" + gai_strerror(rc) + "); give a host name or IP " +
                                           "address the processes can reach");
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

std::string numeric_host(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (getnameinfo(sa, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

// One non-blocking connect attempt, bounded by `budget`. Returns 0 or the errno.
int try_connect(const addrinfo* ai, milliseconds budget, std::string* local_host) {
  Fd s;
  s.fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (s.fd < 0) return errno;
  if (connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return errno;
    pollfd p{s.fd, POLLOUT, 0};
    const int n = poll(&p, 1, static_cast<int>(std::max<int64_t>(budget.count(), 1)));
    if (n == 0) return ETIMEDOUT;
    if (n < 0) return errno;
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return err;
  }
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  if (local_host && getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
    *local_host = numeric_host(reinterpret_cast<sockaddr*>(&local), len);
  return 0;
}

// c10d logs its retries and failures to stderr itself, with C++ backtraces, before throwing the
// error libpipe reports anyway: only fatal messages may pass (process-wide; LibTorch offers no
// per-component switch).
void quiet_c10d_logging() { log::raise_libtorch_log_level(3); }

}  // namespace

std::string format_address(const Address& a) {
  return (a.host.find(':') != std::string::npos ? "[" + a.host + "]" : a.host) + ":" + std::to_string(a.port);
}

Address parse_address(const std::string& value, const std::string& what, PortZero zero) {
  const std::string hint = what + " must be HOST:PORT (e.g. 10.0.0.5:29500 or [::1]:29500), got '" + value + "'";
  Address a;
  std::string port;
  if (!value.empty() && value[0] == '[') {
    const auto close = value.find(']');
    if (close == std::string::npos || close + 1 >= value.size() || value[close + 1] != ':')
      throw Error(Status::InvalidArgument, hint);
    a.host = value.substr(1, close - 1);
    port = value.substr(close + 2);
  } else {
    const auto colon = value.rfind(':');
    if (colon == std::string::npos) throw Error(Status::InvalidArgument, hint);
    a.host = value.substr(0, colon);
    port = value.substr(colon + 1);
  }
  if (a.host.empty() || port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    throw Error(Status::InvalidArgument, hint);
  const long p = std::stol(port);
  if (p == 0 && zero == PortZero::Refused)
    throw Error(Status::InvalidArgument, what + " '" + value + "' has port 0, which only the driver may give (its " +
                                             "store then picks a free port and reports it as \"store listening on " +
                                             "HOST:PORT\"); give the port the driver reported");
  if (p > 65535) throw Error(Status::InvalidArgument, what + ": port " + port + " is not in 0..65535");
  a.port = static_cast<uint16_t>(p);
  return a;
}

HostedStore host_store(const Address& address, int world_size, milliseconds timeout) {
  quiet_c10d_logging();
  // The workers are told to reach this process at address.host, and its transport listens
  // there: it must be one of this machine's addresses. Binding to it proves that at once,
  // where a wrong address would otherwise only show as workers that never arrive.
  AddrInfo ai;
  resolve(address, ai, "the store");
  bool local = false;
  for (const addrinfo* p = ai.list; p && !local; p = p->ai_next) {
    Fd s;
    s.fd = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
    if (s.fd < 0) continue;
    sockaddr_storage any{};
    std::memcpy(&any, p->ai_addr, p->ai_addrlen);
    if (any.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&any)->sin_port = 0;
    if (any.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&any)->sin6_port = 0;
    local = bind(s.fd, reinterpret_cast<sockaddr*>(&any), p->ai_addrlen) == 0;
  }
  if (!local)
    throw Error(Status::Communication, "the store address " + format_address(address) +
                                           " is not an address of this machine; " +
                                           "the driver hosts the store, so give one of its own addresses " +
                                           "(127.0.0.1 when every process runs here)");
  c10d::TCPStoreOptions options;
  options.port = address.port;
  options.isServer = true;
  options.numWorkers = static_cast<size_t>(world_size);
  options.waitWorkers = false;  // the session waits for its workers itself, with its own message
  options.timeout = timeout;
  HostedStore hosted;
  hosted.address = address;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(address.host, options);
    hosted.address.port = store->getPort();
    hosted.store = std::move(store);
  } catch (const std::exception& e) {
    throw Error(Status::Communication, "cannot host the rendezvous store at " + format_address(address) + ": " +
                                           short_what(e) + " (is the port already in use? pick a free one, or give " +
                                           "port 0 to let the store pick one)");
  }
  log::info("store listening on " + format_address(hosted.address));
  return hosted;
}

c10::intrusive_ptr<c10d::Store> connect_store(const Address& address, milliseconds timeout, std::string* local_host) {
  quiet_c10d_logging();
  AddrInfo ai;
  resolve(address, ai, "the store");
  const auto deadline = Clock::now() + timeout;
  int last = 0;
  bool connected = false;
  while (!connected) {
    for (const addrinfo* p = ai.list; p && !connected; p = p->ai_next) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      last = try_connect(p, std::max(left, milliseconds(1)), local_host);
      connected = last == 0;
    }
    if (connected) break;
    if (Clock::now() >= deadline)
      throw Error(Status::Communication, "no rendezvous store answered at " + format_address(address) + " within " +
                                             std::to_string(timeout.count()) + " ms (" + std::strerror(last) +
                                             "); is the driver running, and is that its --store address?");
    std::this_thread::sleep_for(
        std::min(milliseconds(100), std::chrono::duration_cast<milliseconds>(deadline - Clock::now())));
  }
  c10d::TCPStoreOptions options;
  options.port = address.port;
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(address.host, options);
  } catch (const std::exception& e) {
    throw Error(Status::Communication,
                "cannot join the rendezvous store at " + format_address(address) + ": " + short_what(e));
  }
}

namespace {

// Bumped whenever driver and worker stop understanding each other (wire format or setup).
// 2: workers send heartbeats at the pace the driver's assignment gives.
const std::string kProtocol = "libpipe-distributed-2";

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string str(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }
std::string joined_key(int rank) { return "libpipe/joined/" + std::to_string(rank); }

}  // namespace

void announce_session(c10d::Store& store, int world_size, const std::string& transport) {
  store.set("libpipe/world_size", bytes(std::to_string(world_size)));
  store.set("libpipe/transport", bytes(transport));
  store.set("libpipe/protocol", bytes(kProtocol));  // last: workers wait for this key
}

void wait_for_workers(c10d::Store& store, int world_size, const std::string& address, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int r = 1; r < world_size; ++r)
      if (!store.check({joined_key(r)})) missing.push_back(r);
    if (missing.empty()) return;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(milliseconds(20));
  }
  std::string list;
  for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
  throw Error(Status::Communication, std::to_string(world_size - 1 - static_cast<int>(missing.size())) + " of " +
                                         std::to_string(world_size - 1) + " workers joined within " +
                                         std::to_string(timeout.count()) + " ms (missing rank" +
                                         (missing.size() == 1 ? " " : "s ") + list +
                                         "); start each with `pipe worker --rank R --world-size " +
                                         std::to_string(world_size) + " --store " + address + "` (or pipe_worker_run)");
}

std::string join_session(c10d::Store& store, int rank, int world_size) {
  std::string protocol;
  try {
    protocol = str(store.get("libpipe/protocol"));
  } catch (const std::exception& e) {
    throw Error(Status::Communication,
                "the rendezvous store answered but no session was announced in it: " + short_what(e));
  }
  if (protocol != kProtocol)
    throw Error(Status::Communication, "the driver speaks '" + protocol + "' but this worker speaks '" + kProtocol +
                                           "': run the same libpipe version everywhere");
  const int driver_world = std::stoi(str(store.get("libpipe/world_size")));
  if (driver_world != world_size)
    throw Error(Status::InvalidArgument, "this worker was started with world size " + std::to_string(world_size) +
                                             " but the driver's session has " + std::to_string(driver_world));
  if (store.add("libpipe/rank/" + std::to_string(rank), 1) > 1)
    throw Error(Status::Communication, "rank " + std::to_string(rank) +
                                           " has already joined this session; give each "
                                           "worker its own rank");
  const std::string transport = str(store.get("libpipe/transport"));
  store.set(joined_key(rank), bytes("1"));
  return transport;
}

}  // namespace libpipe::comm
