#include "runtime/comm/tcp_transport.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/comm/rendezvous.h"
#include "runtime/comm/socket.h"
#include "runtime/comm/wire.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::comm {

namespace {

using std::chrono::milliseconds;

constexpr size_t kPreambleBytes = wire::kPreambleWords * sizeof(int64_t);
constexpr int kMaxHandshakes = 64;

std::string address_key(int rank) { return "libpipe/tcp/" + std::to_string(rank); }

// What a link's authentication is bound to: the two ranks, the connector's first.
std::string purpose(int connector, int listener) {
  return "libpipe-link-1 " + std::to_string(connector) + ">" + std::to_string(listener);
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

class TcpTransport final : public Transport {
 public:
  TcpTransport(c10d::Store& store, const Secret& secret, int rank, int world_size, const std::string& host,
               milliseconds timeout)
      : rank_(rank), world_size_(world_size), peers_(static_cast<size_t>(world_size)) {
    const Deadline deadline = deadline_in(timeout);
    Socket listener;
    if (rank < world_size - 1) {
      Address here;
      here.host = host;
      listener = listen_on(here, "rank " + std::to_string(rank) + "'s connections");
      here.port = listener.local_port();
      store.set(address_key(rank), bytes_of(format_address(here)));
    }
    std::thread acceptor;
    if (listener.valid()) acceptor = std::thread([&] { accept_higher(listener, secret, deadline); });
    std::string failure;
    try {
      for (int q = 0; q < rank; ++q) connect_lower(store, secret, q, deadline);
    } catch (const Error& e) {
      failure = e.what();
    }
    {
      std::unique_lock lock(mutex_);
      setup_done_.wait_until(lock, failure.empty() ? deadline : Clock::now(), [&] { return higher_connected(); });
      setup_over_ = true;
    }
    listener.shutdown();  // no connection is accepted after setup: the port closes
    if (acceptor.joinable()) acceptor.join();
    {
      // A stranger still in its handshake is cut off now, not at the deadline.
      std::lock_guard lock(mutex_);
      for (auto& s : handshake_sockets_) s->shutdown();
    }
    for (auto& t : handshakes_) t.join();
    handshake_sockets_.clear();
    if (!failure.empty()) throw Error(Status::Communication, "rank " + std::to_string(rank) + ": " + failure);
    std::string missing;
    for (int r = rank + 1; r < world_size; ++r)
      if (!peers_[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    if (!missing.empty())
      throw Error(Status::Communication, "rank " + std::to_string(rank) + ": rank(s) " + missing +
                                             " did not connect within " + std::to_string(timeout.count()) + " ms");
  }

  ~TcpTransport() override { abort("the transport is being destroyed"); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void send(int peer, const Message& message) override {
    Link& link = link_of(peer);
    wire::Frame frame = wire::encode(message);
    for (const auto& t : frame.tensors)
      if (t.nbytes() > 0 && !t.device().is_cpu())
        throw Error(Status::Unsupported, "the TCP transport carries CPU tensors only, got one on " + t.device().str());
    std::lock_guard lock(link.send_mutex);
    guard(link, [&] {
      const Deadline none = no_deadline();
      link.socket.write_all(frame.preamble.data(), kPreambleBytes, none, link.name);
      if (!frame.meta.empty())
        link.socket.write_all(frame.meta.data(), frame.meta.size() * sizeof(int64_t), none, link.name);
      if (!frame.bytes.empty()) link.socket.write_all(frame.bytes.data(), frame.bytes.size(), none, link.name);
      for (const auto& t : frame.tensors)
        if (t.nbytes() > 0) link.socket.write_all(t.data_ptr(), t.nbytes(), none, link.name);
    });
  }

  Message recv(int peer, milliseconds timeout) override {
    Link& link = link_of(peer);
    std::lock_guard lock(link.recv_mutex);
    Message out;
    guard(link, [&] {
      if (timeout.count() > 0 && !link.socket.wait_readable(deadline_in(timeout)))
        throw Error(Status::Communication,
                    link.name + " sent nothing within " + std::to_string(timeout.count()) + " ms");
      const Deadline none = no_deadline();
      wire::Preamble preamble{};
      link.socket.read_exact(preamble.data(), kPreambleBytes, none, link.name);
      const auto sizes = wire::announced(preamble);  // bounded before anything is allocated
      std::vector<int64_t> meta(sizes.meta_words);
      if (!meta.empty()) link.socket.read_exact(meta.data(), meta.size() * sizeof(int64_t), none, link.name);
      std::vector<uint8_t> bytes(sizes.bytes);
      if (!bytes.empty()) link.socket.read_exact(bytes.data(), bytes.size(), none, link.name);
      auto tensors = wire::allocate(meta, at::TensorOptions());
      for (auto& t : tensors)
        if (t.nbytes() > 0) link.socket.read_exact(t.data_ptr(), t.nbytes(), none, link.name);
      out = wire::decode(preamble, bytes, std::move(tensors));
    });
    return out;
  }

  void abort(const std::string& why) override {
    std::lock_guard lock(mutex_);
    if (!aborted_) why_ = why;
    aborted_ = true;
    for (auto& link : peers_)
      if (link) link->socket.shutdown();
  }

 private:
  struct Link {
    Socket socket;
    std::string name;  // "rank N (HOST:PORT)"
    std::mutex send_mutex, recv_mutex;
  };

  Link& link_of(int peer) {
    if (peer < 0 || peer >= world_size_ || peer == rank_ || !peers_[static_cast<size_t>(peer)])
      throw Error(Status::Internal,
                  "rank " + std::to_string(rank_) + " has no connection to rank " + std::to_string(peer));
    std::lock_guard lock(mutex_);
    if (aborted_) throw Error(Status::Communication, why_);
    return *peers_[static_cast<size_t>(peer)];
  }

  // Runs one send or receive; a failure leaves the stream in between, so the transport is then done with.
  template <typename Fn>
  void guard(Link& link, Fn&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      std::lock_guard lock(mutex_);
      if (aborted_) throw Error(Status::Communication, why_);
      aborted_ = true;
      why_ = e.status() == Status::Communication ? std::string(e.what())
                                                 : "the message from or to " + link.name + " was refused: " + e.what();
      for (auto& l : peers_)
        if (l) l->socket.shutdown();
      throw Error(Status::Communication, why_);
    }
  }

  bool higher_connected() const {
    for (int r = rank_ + 1; r < world_size_; ++r)
      if (!peers_[static_cast<size_t>(r)]) return false;
    return true;
  }

  void connect_lower(c10d::Store& store, const Secret& secret, int q, Deadline deadline) {
    const auto left = std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
    store.wait({address_key(q)}, left);
    const auto value = store.get(address_key(q));
    const Address address =
        parse_address(std::string(value.begin(), value.end()), "rank " + std::to_string(q) + "'s address in the store");
    auto link = std::make_unique<Link>();
    link->name = "rank " + std::to_string(q) + " (" + format_address(address) + ")";
    link->socket = connect_to(address, deadline, link->name);
    const uint32_t me = static_cast<uint32_t>(rank_);
    uint8_t hello[4] = {static_cast<uint8_t>(me), static_cast<uint8_t>(me >> 8), static_cast<uint8_t>(me >> 16),
                        static_cast<uint8_t>(me >> 24)};
    link->socket.write_all(hello, sizeof hello, deadline, link->name);
    authenticate_as_connector(link->socket, secret, purpose(rank_, q), deadline, link->name);
    std::lock_guard lock(mutex_);
    peers_[static_cast<size_t>(q)] = std::move(link);
  }

  void accept_higher(const Socket& listener, const Secret& secret, Deadline deadline) {
    for (;;) {
      Socket s = accept_one(listener, deadline);
      if (!s.valid()) break;
      {
        std::lock_guard lock(mutex_);
        if (setup_over_) break;
      }
      const std::string from = s.peer_name();
      if (in_progress_.load() >= kMaxHandshakes) {
        log::warning("rank " + std::to_string(rank_) + " refused a connection from " + from +
                     ": too many connections authenticating at once");
        continue;
      }
      ++in_progress_;
      auto shared = std::make_shared<Socket>(std::move(s));
      std::lock_guard lock(mutex_);
      handshake_sockets_.push_back(shared);
      handshakes_.emplace_back([this, shared, from, &secret, deadline] {
        handshake(*shared, from, secret, deadline);
        --in_progress_;
      });
    }
    // Handshakes still running end at the deadline (or when their sockets close).
  }

  void handshake(Socket& s, const std::string& from, const Secret& secret, Deadline deadline) {
    try {
      uint8_t hello[4];
      s.read_exact(hello, sizeof hello, deadline, from);
      const uint32_t claimed =
          uint32_t{hello[0]} | uint32_t{hello[1]} << 8 | uint32_t{hello[2]} << 16 | uint32_t{hello[3]} << 24;
      if (claimed <= static_cast<uint32_t>(rank_) || claimed >= static_cast<uint32_t>(world_size_))
        throw Error(Status::Communication, "it claimed rank " + std::to_string(claimed) + ", not a rank above " +
                                               std::to_string(rank_) + " in this session of " +
                                               std::to_string(world_size_));
      const int r = static_cast<int>(claimed);
      authenticate_as_listener(s, secret, purpose(r, rank_), deadline, from);
      std::lock_guard lock(mutex_);
      if (setup_over_ || peers_[static_cast<size_t>(r)])
        throw Error(Status::Communication, "rank " + std::to_string(r) + " is connected already");
      auto link = std::make_unique<Link>();
      link->name = "rank " + std::to_string(r) + " (" + from + ")";
      link->socket = std::move(s);
      peers_[static_cast<size_t>(r)] = std::move(link);
      setup_done_.notify_all();
    } catch (const Error& e) {
      s.shutdown();  // the stranger learns that much at once
      log::warning("rank " + std::to_string(rank_) + " refused a connection from " + from + ": " + e.what());
    }
  }

  const int rank_, world_size_;
  std::vector<std::unique_ptr<Link>> peers_;  // by rank; written during setup under mutex_, read-only after
  std::mutex mutex_;
  std::condition_variable setup_done_;
  bool setup_over_ = false;
  std::list<std::thread> handshakes_;                       // under mutex_ while setting up
  std::vector<std::shared_ptr<Socket>> handshake_sockets_;  // theirs, to cut them off (under mutex_)
  std::atomic<int> in_progress_{0};
  bool aborted_ = false;
  std::string why_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(c10d::Store& store, const Secret& secret, int rank, int world_size,
                                              const std::string& host, milliseconds timeout) {
  return std::make_unique<TcpTransport>(store, secret, rank, world_size, host, timeout);
}

}  // namespace libpipe::comm
