#include "runtime/comm/store_client.h"

#include <algorithm>
#include <optional>

#include "runtime/comm/store_protocol.h"
#include "runtime/error.h"

namespace libpipe::comm {

namespace {

using std::chrono::milliseconds;

// An answer comes within this beyond what the request itself waits (Get, Wait).
constexpr milliseconds kAnswerPatience{30'000};
// A Get or Wait waits in the store in slices of at most this, so that the connection's lock is let go between
// them: a thread waiting for a key never holds up another's heartbeat or set() on the same connection.
constexpr milliseconds kSlice{100};

struct Request {
  std::vector<uint8_t> bytes;
  explicit Request(store::Op op) { bytes.push_back(op); }
  Request& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Request& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Request& key(const std::string& k) {
    if (k.size() > store::kMaxKeyBytes)
      throw Error(Status::InvalidArgument, "store key of " + std::to_string(k.size()) + " bytes (at most " +
                                               std::to_string(store::kMaxKeyBytes) + ")");
    u32(static_cast<uint32_t>(k.size()));
    bytes.insert(bytes.end(), k.begin(), k.end());
    return *this;
  }
  Request& value(const std::vector<uint8_t>& v) {
    if (v.size() > store::kMaxValueBytes)
      throw Error(Status::InvalidArgument, "store value of " + std::to_string(v.size()) + " bytes (at most " +
                                               std::to_string(store::kMaxValueBytes) + ")");
    u64(v.size());
    bytes.insert(bytes.end(), v.begin(), v.end());
    return *this;
  }
  Request& keys(const std::vector<std::string>& ks) {
    if (ks.size() > store::kMaxKeysPerRequest)
      throw Error(Status::InvalidArgument, std::to_string(ks.size()) + " store keys in one request (at most " +
                                               std::to_string(store::kMaxKeysPerRequest) + ")");
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) key(k);
    return *this;
  }
};

uint8_t read_u8(const Socket& s, Deadline d, const std::string& peer) {
  uint8_t v = 0;
  s.read_exact(&v, 1, d, peer);
  return v;
}

uint64_t read_u64(const Socket& s, Deadline d, const std::string& peer) {
  uint8_t b[8];
  s.read_exact(b, 8, d, peer);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | b[i];
  return v;
}

std::vector<uint8_t> read_value(const Socket& s, Deadline d, const std::string& peer) {
  const uint64_t n = read_u64(s, d, peer);
  if (n > store::kMaxValueBytes)
    throw Error(Status::Communication, peer + " answered with a value of " + std::to_string(n) + " bytes");
  std::vector<uint8_t> v(n);
  if (n) s.read_exact(v.data(), n, d, peer);
  return v;
}

}  // namespace

StoreClient::StoreClient(const Address& address, Secret secret, milliseconds timeout, std::string* local_host)
    : c10d::Store(timeout), address_(address), secret_(std::move(secret)) {
  name_ = "the rendezvous store at " + format_address(address);
  const Deadline deadline = deadline_in(timeout);
  socket_ = connect_to(address, deadline, "the rendezvous store", local_host);
  authenticate_as_connector(socket_, secret_, store::kPurpose, deadline, name_);
}

template <typename Read>
auto StoreClient::exchange(const std::vector<uint8_t>& request, milliseconds patience, Read&& read) {
  std::lock_guard lock(mutex_);
  if (!broken_.empty()) throw Error(Status::Communication, broken_);
  const Deadline deadline = deadline_in(patience + kAnswerPatience);
  try {
    socket_.write_all(request.data(), request.size(), deadline, name_);
    return read(deadline);
  } catch (const Error& e) {
    // A request timed out in the store is a whole answer; anything else leaves the stream in between.
    if (e.status() != Status::Timeout) {
      broken_ = e.what();
      socket_.shutdown();
    }
    throw;
  }
}

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  return c10::make_intrusive<StoreClient>(address_, secret_, timeout_);
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  Request r(store::Set);
  r.key(key).value(value);
  exchange(r.bytes, milliseconds(0), [&](Deadline d) { return read_u8(socket_, d, name_); });
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  // In slices, so that other threads' requests on this connection go between them.
  const Deadline deadline = deadline_in(timeout_);
  for (;;) {
    const auto slice =
        std::clamp(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(0), kSlice);
    Request r(store::Get);
    r.key(key).u64(static_cast<uint64_t>(slice.count()));
    std::optional<std::vector<uint8_t>> value = exchange(r.bytes, slice, [&](Deadline d) {
      std::optional<std::vector<uint8_t>> v;
      if (read_u8(socket_, d, name_) == 0) v = read_value(socket_, d, name_);
      return v;
    });
    if (value) return std::move(*value);
    if (Clock::now() >= deadline)
      throw Error(Status::Timeout,
                  "'" + key + "' did not appear in " + name_ + " within " + std::to_string(timeout_.count()) + " ms");
  }
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  Request r(store::Add);
  r.key(key).u64(static_cast<uint64_t>(value));
  return exchange(r.bytes, milliseconds(0),
                  [&](Deadline d) { return static_cast<int64_t>(read_u64(socket_, d, name_)); });
}

bool StoreClient::deleteKey(const std::string& key) {
  Request r(store::Delete);
  r.key(key);
  return exchange(r.bytes, milliseconds(0), [&](Deadline d) { return read_u8(socket_, d, name_) != 0; });
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  Request r(store::Check);
  r.keys(keys);
  return exchange(r.bytes, milliseconds(0), [&](Deadline d) { return read_u8(socket_, d, name_) != 0; });
}

int64_t StoreClient::getNumKeys() {
  Request r(store::NumKeys);
  return exchange(r.bytes, milliseconds(0),
                  [&](Deadline d) { return static_cast<int64_t>(read_u64(socket_, d, name_)); });
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  const Deadline deadline = deadline_in(timeout);
  for (;;) {
    const auto slice =
        std::clamp(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(0), kSlice);
    Request r(store::Wait);
    r.keys(keys).u64(static_cast<uint64_t>(slice.count()));
    const bool present = exchange(r.bytes, slice, [&](Deadline d) { return read_u8(socket_, d, name_) == 0; });
    if (present) return;
    if (Clock::now() >= deadline)
      throw Error(Status::Timeout,
                  "keys did not appear in " + name_ + " within " + std::to_string(timeout.count()) + " ms");
  }
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  Request r(store::CompareSet);
  r.key(key).value(expected).value(desired);
  return exchange(r.bytes, milliseconds(0), [&](Deadline d) { return read_value(socket_, d, name_); });
}

}  // namespace libpipe::comm
