#include "runtime/comm/store_server.h"

#include <algorithm>
#include <cstring>

#include "runtime/comm/store_protocol.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace libpipe::comm {

namespace {

using std::chrono::milliseconds;

// Fields of a request arrive together; a peer that stops in the middle of one is cut off after this.
constexpr milliseconds kFieldPatience{10'000};

struct Reader {
  const Socket& s;
  const std::string& peer;
  Deadline deadline;

  uint32_t u32() {
    uint8_t b[4];
    s.read_exact(b, 4, deadline, peer);
    return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
  }
  uint64_t u64() {
    uint8_t b[8];
    s.read_exact(b, 8, deadline, peer);
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = v << 8 | b[i];
    return v;
  }
  int64_t i64() { return static_cast<int64_t>(u64()); }
  // Throws Error(InvalidArgument) for a size beyond the bound: the caller closes the connection.
  std::string key() {
    const uint32_t n = u32();
    if (n > store::kMaxKeyBytes)
      throw Error(Status::InvalidArgument,
                  "a key of " + std::to_string(n) + " bytes (at most " + std::to_string(store::kMaxKeyBytes) + ")");
    std::string k(n, '\0');
    if (n) s.read_exact(k.data(), n, deadline, peer);
    return k;
  }
  std::vector<uint8_t> value() {
    const uint64_t n = u64();
    if (n > store::kMaxValueBytes)
      throw Error(Status::InvalidArgument,
                  "a value of " + std::to_string(n) + " bytes (at most " + std::to_string(store::kMaxValueBytes) + ")");
    std::vector<uint8_t> v(n);
    if (n) s.read_exact(v.data(), n, deadline, peer);
    return v;
  }
  std::vector<std::string> keys() {
    const uint32_t n = u32();
    if (n > store::kMaxKeysPerRequest)
      throw Error(Status::InvalidArgument, std::to_string(n) + " keys in one request (at most " +
                                               std::to_string(store::kMaxKeysPerRequest) + ")");
    std::vector<std::string> out;
    for (uint32_t i = 0; i < n; ++i) out.push_back(key());
    return out;
  }
};

struct Writer {
  std::vector<uint8_t> bytes;
  void u8(uint8_t v) { bytes.push_back(v); }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void value(const std::vector<uint8_t>& v) {
    u64(v.size());
    bytes.insert(bytes.end(), v.begin(), v.end());
  }
};

milliseconds clamp_timeout(int64_t ms) { return milliseconds(std::clamp<int64_t>(ms, 0, int64_t{24} * 3600 * 1000)); }

}  // namespace

StoreServer::StoreServer(const Address& address, Secret secret, int max_clients, milliseconds handshake_timeout)
    : address_(address),
      secret_(std::move(secret)),
      max_clients_(std::max(max_clients, 1)),
      handshake_timeout_(handshake_timeout) {
  listener_ = listen_on(address, "the rendezvous store");
  address_.port = listener_.local_port();
  acceptor_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (auto& c : connections_) c.socket->shutdown();
  }
  changed_.notify_all();
  listener_.shutdown();
  acceptor_.join();
  // No new connection now; every thread returns once its socket is shut down.
  std::list<Connection> left;
  {
    std::lock_guard lock(mutex_);
    left.splice(left.end(), connections_);
  }
  for (auto& c : left) c.thread.join();
}

void StoreServer::refuse(const std::string& peer, const std::string& why) {
  const uint64_t n = ++refused_;
  // A flood of strangers must not flood the log: the first ten, then one in a thousand.
  if (n <= 10 || n % 1000 == 0)
    log::warning("the rendezvous store refused a connection from " + (peer.empty() ? "an unknown peer" : peer) + ": " +
                 why + (n > 10 ? " (" + std::to_string(n) + " refused so far)" : ""));
}

void StoreServer::reap() {
  // Under mutex_: threads of closed connections are joined (they returned or are about to).
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void StoreServer::accept_loop() {
  for (;;) {
    Socket s = accept_one(listener_, no_deadline());
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    if (!s.valid()) continue;
    reap();
    const std::string peer = s.peer_name();
    if (handshakes_.load() >= kMaxHandshakes) {
      refuse(peer, "too many connections authenticating at once");
      continue;
    }
    ++handshakes_;
    connections_.emplace_back();
    Connection& c = connections_.back();
    c.socket = std::make_shared<Socket>(std::move(s));
    c.thread = std::thread([this, &c, peer] { serve(c, peer); });
  }
}

void StoreServer::serve(Connection& c, std::string peer) {
  const Socket& s = *c.socket;
  bool authenticated = false;
  try {
    authenticate_as_listener(s, secret_, store::kPurpose, deadline_in(handshake_timeout_), peer);
    authenticated = true;
  } catch (const Error& e) {
    refuse(peer, e.what());
  }
  --handshakes_;
  if (authenticated) {
    bool admitted = false;
    {
      std::lock_guard lock(mutex_);
      if (!stopping_ && clients_ < max_clients_) {
        ++clients_;
        admitted = true;
      }
    }
    if (!admitted) {
      refuse(peer, "more than " + std::to_string(max_clients_) + " connections from this session's processes");
    } else {
      std::string why;
      try {
        while (answer(s, peer, why)) {}
      } catch (const Error& e) {
        why = e.what();
      }
      if (!why.empty()) refuse(peer, why);
      std::lock_guard lock(mutex_);
      --clients_;
    }
  }
  c.socket->shutdown();
  c.done.store(true);
}

bool StoreServer::answer(const Socket& s, const std::string& peer, std::string& why) {
  uint8_t op = 0;
  // Between requests a client may be quiet for as long as it likes (until the session ends).
  if (!s.wait_readable(no_deadline())) return false;
  try {
    s.read_exact(&op, 1, deadline_in(kFieldPatience), peer);
  } catch (const Error&) {
    return false;  // closed: the client is done
  }
  Reader in{s, peer, deadline_in(kFieldPatience)};
  Writer out;
  try {
    switch (op) {
      case store::Set: {
        const std::string key = in.key();
        std::vector<uint8_t> value = in.value();
        {
          std::lock_guard lock(mutex_);
          auto it = data_.find(key);
          const uint64_t old = it == data_.end() ? 0 : it->second.size() + key.size();
          if ((it == data_.end() && data_.size() >= store::kMaxEntries) ||
              stored_bytes_ - old + key.size() + value.size() > store::kMaxStoredBytes)
            throw Error(Status::InvalidArgument, "the store is full");
          stored_bytes_ = stored_bytes_ - old + key.size() + value.size();
          data_[key] = std::move(value);
        }
        changed_.notify_all();
        out.u8(0);
        break;
      }
      case store::Get: {
        const std::string key = in.key();
        const milliseconds timeout = clamp_timeout(in.i64());
        std::unique_lock lock(mutex_);
        const bool found =
            changed_.wait_for(lock, timeout, [&] { return stopping_ || data_.count(key) > 0; }) && !stopping_;
        if (stopping_) return false;
        if (found) {
          out.u8(0);
          out.value(data_.at(key));
        } else {
          out.u8(1);
        }
        break;
      }
      case store::Add: {
        const std::string key = in.key();
        const int64_t delta = in.i64();
        int64_t now = 0;
        {
          std::lock_guard lock(mutex_);
          auto it = data_.find(key);
          if (it != data_.end()) {
            const std::string text(it->second.begin(), it->second.end());
            char* end = nullptr;
            now = std::strtoll(text.c_str(), &end, 10);
            if (text.empty() || *end != '\0')
              throw Error(Status::InvalidArgument, "add() on key '" + key + "', which holds no integer");
          } else if (data_.size() >= store::kMaxEntries) {
            throw Error(Status::InvalidArgument, "the store is full");
          }
          now = static_cast<int64_t>(static_cast<uint64_t>(now) + static_cast<uint64_t>(delta));
          const std::string text = std::to_string(now);
          const uint64_t old = it == data_.end() ? 0 : it->second.size() + key.size();
          stored_bytes_ = stored_bytes_ - old + key.size() + text.size();
          data_[key] = std::vector<uint8_t>(text.begin(), text.end());
        }
        changed_.notify_all();
        out.u64(static_cast<uint64_t>(now));
        break;
      }
      case store::Check: {
        const auto keys = in.keys();
        std::lock_guard lock(mutex_);
        out.u8(std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; }));
        break;
      }
      case store::Wait: {
        const auto keys = in.keys();
        const milliseconds timeout = clamp_timeout(in.i64());
        std::unique_lock lock(mutex_);
        const auto all = [&] {
          return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
        };
        const bool found = changed_.wait_for(lock, timeout, [&] { return stopping_ || all(); }) && !stopping_;
        if (stopping_) return false;
        out.u8(found ? 0 : 1);
        break;
      }
      case store::Delete: {
        const std::string key = in.key();
        std::lock_guard lock(mutex_);
        auto it = data_.find(key);
        const bool deleted = it != data_.end();
        if (deleted) {
          stored_bytes_ -= it->second.size() + key.size();
          data_.erase(it);
        }
        out.u8(deleted);
        break;
      }
      case store::NumKeys: {
        std::lock_guard lock(mutex_);
        out.u64(data_.size());
        break;
      }
      case store::CompareSet: {
        const std::string key = in.key();
        const std::vector<uint8_t> expected = in.value();
        std::vector<uint8_t> desired = in.value();
        {
          std::lock_guard lock(mutex_);
          auto it = data_.find(key);
          // c10d's semantics: set when absent and `expected` is empty, or when equal to `expected`.
          if ((it == data_.end() && expected.empty()) || (it != data_.end() && it->second == expected)) {
            const uint64_t old = it == data_.end() ? 0 : it->second.size() + key.size();
            if ((it == data_.end() && data_.size() >= store::kMaxEntries) ||
                stored_bytes_ - old + key.size() + desired.size() > store::kMaxStoredBytes)
              throw Error(Status::InvalidArgument, "the store is full");
            stored_bytes_ = stored_bytes_ - old + key.size() + desired.size();
            data_[key] = desired;
            out.value(desired);
          } else {
            out.value(it == data_.end() ? expected : it->second);
          }
        }
        changed_.notify_all();
        break;
      }
      default: why = "an unknown request (" + std::to_string(op) + ")"; return false;
    }
  } catch (const Error& e) {
    why = e.what();
    return false;
  }
  s.write_all(out.bytes.data(), out.bytes.size(), deadline_in(kFieldPatience), peer);
  return true;
}

}  // namespace libpipe::comm
