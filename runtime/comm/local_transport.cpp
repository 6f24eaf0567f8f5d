#include "runtime/comm/local_transport.h"

#include <condition_variable>
#include <deque>
#include <mutex>

#include "runtime/error.h"

namespace libpipe::comm {

namespace {

using Clock = std::chrono::steady_clock;

struct Hub {
  explicit Hub(int world) : world_size(world), boxes(static_cast<size_t>(world * world)) {}
  std::deque<Message>& box(int from, int to) { return boxes[static_cast<size_t>(from * world_size + to)]; }

  const int world_size;
  std::mutex mutex;
  std::condition_variable arrived;
  std::vector<std::deque<Message>> boxes;  // [from][to]
  bool aborted = false;
  std::string why;
};

class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return hub_->world_size; }

  void send(int peer, const Message& message) override {
    check(peer);
    {
      std::lock_guard lock(hub_->mutex);
      if (hub_->aborted) throw Error(Status::Communication, hub_->why);
      hub_->box(rank_, peer).push_back(message);
    }
    hub_->arrived.notify_all();
  }

  Message recv(int peer, std::chrono::milliseconds timeout) override {
    check(peer);
    std::unique_lock lock(hub_->mutex);
    auto& box = hub_->box(peer, rank_);
    auto ready = [&] { return hub_->aborted || !box.empty(); };
    if (timeout.count() > 0) {
      if (!hub_->arrived.wait_for(lock, timeout, ready)) {
        hub_->aborted = true;
        hub_->why =
            "no message from rank " + std::to_string(peer) + " within " + std::to_string(timeout.count()) + " ms";
        hub_->arrived.notify_all();
      }
    } else {
      hub_->arrived.wait(lock, ready);
    }
    if (hub_->aborted) throw Error(Status::Communication, hub_->why);
    Message m = std::move(box.front());
    box.pop_front();
    return m;
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard lock(hub_->mutex);
      if (!hub_->aborted) hub_->why = why;
      hub_->aborted = true;
    }
    hub_->arrived.notify_all();
  }

 private:
  void check(int peer) const {
    if (peer < 0 || peer >= hub_->world_size || peer == rank_)
      throw Error(Status::Internal, "local transport: rank " + std::to_string(rank_) + " addressed rank " +
                                        std::to_string(peer) + " of " + std::to_string(hub_->world_size));
  }
  std::shared_ptr<Hub> hub_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size) {
  auto hub = std::make_shared<Hub>(world_size);
  std::vector<std::unique_ptr<Transport>> endpoints;
  for (int r = 0; r < world_size; ++r) endpoints.push_back(std::make_unique<LocalTransport>(hub, r));
  return endpoints;
}

}  // namespace libpipe::comm
