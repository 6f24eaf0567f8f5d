#include "runtime/comm/rendezvous.h"

#include <chrono>
#include <memory>
#include <thread>

#include "runtime/comm/socket.h"
#include "runtime/comm/store_client.h"
#include "runtime/comm/store_server.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::comm {

using std::chrono::milliseconds;

namespace {

std::string short_what(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

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

HostedStore host_store(const Address& address, const Secret& secret, int world_size, milliseconds timeout) {
  HostedStore hosted;
  // Each worker holds a connection or two (joining, heartbeats), the driver its own; strangers get none.
  hosted.server =
      std::make_shared<StoreServer>(address, secret, 4 * world_size + 8, std::min(timeout, milliseconds(10'000)));
  hosted.address = hosted.server->address();
  log::info("store listening on " + format_address(hosted.address));
  hosted.store = c10::make_intrusive<StoreClient>(hosted.address, secret, timeout);
  return hosted;
}

c10::intrusive_ptr<c10d::Store> connect_store(const Address& address, const Secret& secret, milliseconds timeout,
                                              std::string* local_host) {
  return c10::make_intrusive<StoreClient>(address, secret, timeout, local_host);
}

namespace {

// Bumped whenever driver and worker stop understanding each other (wire format or setup).
// 2: workers send heartbeats at the pace the driver's assignment gives.
// 3: libpipe's own store and TCP transport, every connection authenticated.
const std::string kProtocol = "libpipe-distributed-3";

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string str(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }
std::string joined_key(int rank) { return "libpipe/joined/" + std::to_string(rank); }
std::string device_key(int rank) { return "libpipe/device/" + std::to_string(rank); }

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

std::string join_session(c10d::Store& store, int rank, int world_size, const std::string& own_device) {
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
  store.set(device_key(rank), bytes(own_device));
  store.set(joined_key(rank), bytes("1"));  // last: the driver reads the device once it sees this
  return transport;
}

c10::Device joined_device(c10d::Store& store, int rank) {
  const std::string text = str(store.get(device_key(rank)));
  // Only "cpu" and "cuda:N", as rank_device.h writes them: c10's parser accepts more and may abort on the rest.
  const bool cuda = text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 8 &&
                    text.find_first_not_of("0123456789", 5) == std::string::npos && std::stoi(text.substr(5)) < 128;
  if (text == "cpu") return c10::Device(c10::kCPU);
  if (cuda) return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(text.substr(5))));
  throw Error(Status::Communication,
              "rank " + std::to_string(rank) + " told device '" + text.substr(0, 64) + "', which is not a device");
}

}  // namespace libpipe::comm
