// c10d's ProcessGroupGloo exists only with USE_C10D_GLOO (LibTorch's own build defines it; the
// class vanishes without it), and its header includes gloo's, which the PyTorch wheel does not
// ship: they come from Debian's libgloo-dev (headers only; the code is the copy inside
// libtorch_cpu). This file is compiled without the shared precompiled header for that reason.
#define USE_C10D_GLOO 1
#include "runtime/comm/gloo_transport.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>

#include "runtime/comm/wire.h"
#include "runtime/error.h"

namespace libpipe::comm {

namespace {

using std::chrono::milliseconds;

// What Gloo's timeouts mean here: any timed-out wait closes that connection for good, on both
// sides, so they are not a way to poll. Waits for traffic use this instead of "forever" (which
// overflows inside Gloo), and the session's own watchdog decides when a peer is gone.
constexpr milliseconds kPatience = std::chrono::hours(24 * 30);
constexpr int kTag = 0;  // one ordered stream per pair and direction

// Every Gloo transfer is a rendezvous (the send completes once the receiver posted its receive),
// so a message's small parts travel together: a fixed-size head carries the preamble and, when
// they fit, the meta and the bytes; otherwise they follow as one overflow transfer. Tensors
// follow, one transfer each.
constexpr size_t kHeadBytes = 4096;
constexpr size_t kPreambleBytes = wire::kPreambleWords * sizeof(int64_t);
constexpr size_t kInlineBytes = kHeadBytes - kPreambleBytes;

std::string short_what(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

class GlooTransport final : public Transport {
 public:
  GlooTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, const std::string& host,
                milliseconds timeout)
      : rank_(rank), world_size_(world_size) {
    // The group's own timeout bounds connecting the full mesh (all ranks are in the store by
    // now, so this is quick unless one died meanwhile); every later wait passes its own.
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    try {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("libpipe/gloo", store), rank, world_size, options);
    } catch (const std::exception& e) {
      throw Error(Status::Communication, "rank " + std::to_string(rank) + " could not connect to its peers over Gloo " +
                                             "(listening on " + host + "): " + short_what(e));
    }
  }

  ~GlooTransport() override { abort("the transport is being destroyed"); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void send(int peer, const Message& message) override {
    wire::Frame frame = wire::encode(message);
    const size_t meta_bytes = frame.meta.size() * sizeof(int64_t);
    const size_t small = meta_bytes + frame.bytes.size();
    std::vector<uint8_t> head(kHeadBytes), overflow(small > kInlineBytes ? small : 0);
    std::memcpy(head.data(), frame.preamble.data(), kPreambleBytes);
    uint8_t* rest = small > kInlineBytes ? overflow.data() : head.data() + kPreambleBytes;
    if (meta_bytes) std::memcpy(rest, frame.meta.data(), meta_bytes);
    if (!frame.bytes.empty()) std::memcpy(rest + meta_bytes, frame.bytes.data(), frame.bytes.size());

    std::vector<std::vector<at::Tensor>> parts;  // kept alive until every send completed
    parts.push_back({at::from_blob(head.data(), {static_cast<int64_t>(head.size())}, at::kByte)});
    if (!overflow.empty())
      parts.push_back({at::from_blob(overflow.data(), {static_cast<int64_t>(overflow.size())}, at::kByte)});
    for (const auto& t : frame.tensors)
      if (t.nbytes() > 0) {
        if (!t.device().is_cpu())
          throw Error(Status::Unsupported,
                      "the Gloo transport carries CPU tensors only, got one on " + t.device().str());
        parts.push_back({wire::byte_view(t)});
      }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& part : parts) works.push_back(post(peer, [&] { return group_->send(part, peer, kTag); }));
    for (auto& w : works) finish(w, peer, kPatience, "send to");
  }

  Message recv(int peer, milliseconds timeout) override {
    const milliseconds patience = timeout.count() > 0 ? timeout : kPatience;
    std::vector<uint8_t> head(kHeadBytes);
    receive(peer, at::from_blob(head.data(), {static_cast<int64_t>(head.size())}, at::kByte), patience);
    wire::Preamble preamble{};
    std::memcpy(preamble.data(), head.data(), kPreambleBytes);
    const auto sizes = wire::announced(preamble);
    const size_t meta_bytes = sizes.meta_words * sizeof(int64_t);
    const size_t small = meta_bytes + sizes.bytes;
    std::vector<uint8_t> overflow(small > kInlineBytes ? small : 0);
    if (!overflow.empty())
      receive(peer, at::from_blob(overflow.data(), {static_cast<int64_t>(overflow.size())}, at::kByte), patience);
    const uint8_t* rest = overflow.empty() ? head.data() + kPreambleBytes : overflow.data();
    std::vector<int64_t> meta(sizes.meta_words);
    if (meta_bytes) std::memcpy(meta.data(), rest, meta_bytes);
    std::vector<uint8_t> bytes(rest + meta_bytes, rest + small);

    auto tensors = wire::allocate(meta, at::TensorOptions());
    std::vector<std::vector<at::Tensor>> parts;
    for (const auto& t : tensors)
      if (t.nbytes() > 0) parts.push_back({wire::byte_view(t)});
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& part : parts) works.push_back(post(peer, [&] { return group_->recv(part, peer, kTag); }));
    for (auto& w : works) finish(w, peer, patience, "receive from");
    return wire::decode(preamble, bytes, std::move(tensors));
  }

  void abort(const std::string& why) override {
    std::lock_guard lock(mutex_);
    if (!aborted_) why_ = why;
    aborted_ = true;
    // A blocked wait() returns false once its Work is aborted; the connection is unusable after.
    for (const auto& w : pending_) w->abort();
  }

 private:
  template <typename Post>
  c10::intrusive_ptr<c10d::Work> post(int peer, Post&& start) {
    std::lock_guard lock(mutex_);
    if (aborted_) throw Error(Status::Communication, why_);
    try {
      auto work = start();
      pending_.insert(work);
      return work;
    } catch (const std::exception& e) {
      throw Error(Status::Communication,
                  "the connection to rank " + std::to_string(peer) + " failed: " + short_what(e));
    }
  }

  void receive(int peer, at::Tensor into, milliseconds patience) {
    std::vector<at::Tensor> part{std::move(into)};
    finish(post(peer, [&] { return group_->recv(part, peer, kTag); }), peer, patience, "receive from");
  }

  void finish(const c10::intrusive_ptr<c10d::Work>& work, int peer, milliseconds patience, const char* what) {
    std::string failure;
    bool done = false;
    try {
      done = work->wait(patience);
    } catch (const std::exception& e) {
      failure = short_what(e);
    }
    std::lock_guard lock(mutex_);
    pending_.erase(work);
    if (aborted_) throw Error(Status::Communication, why_);
    if (!failure.empty() || !done) {
      aborted_ = true;  // Gloo closed this connection; nothing later may use the transport
      why_ = "could not " + std::string(what) + " rank " + std::to_string(peer) + ": " +
             (failure.empty() ? "no answer within " + std::to_string(patience.count()) + " ms" : failure);
      throw Error(Status::Communication, why_);
    }
  }

  const int rank_, world_size_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  std::mutex mutex_;
  std::set<c10::intrusive_ptr<c10d::Work>> pending_;
  bool aborted_ = false;
  std::string why_;
};

}  // namespace

std::unique_ptr<Transport> make_gloo_transport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                               const std::string& host, milliseconds timeout) {
  return std::make_unique<GlooTransport>(std::move(store), rank, world_size, host, timeout);
}

}  // namespace libpipe::comm
