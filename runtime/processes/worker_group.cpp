#include "runtime/processes/worker_group.h"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "runtime/comm/auth.h"
#include "runtime/comm/nccl_transport.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/comm/store_server.h"
#include "runtime/comm/tcp_transport.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/processes/assignment.h"
#include "runtime/processes/heartbeat.h"
#include "runtime/processes/rank_device.h"
#include "runtime/processes/worker_host.h"
#include "runtime/stage/stage.h"

namespace libpipe::processes {

using schedule::stage_io;

namespace {

using comm::Kind;
using comm::Message;

// Aborts `transport` if the setup has not finished by the deadline: Gloo's own timeouts do not
// bound a peer that is alive but silent.
class SetupDeadline {
 public:
  SetupDeadline(comm::Transport& transport, std::chrono::milliseconds timeout) {
    thread_ = std::thread([this, &transport, timeout] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_for(lock, timeout, [&] { return done_; }))
        transport.abort("the workers did not finish setting up within " + std::to_string(timeout.count()) +
                        " ms (joining, loading their stages, warming up); raise comm_timeout_ms for big stages");
    });
  }
  ~SetupDeadline() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

WorkerGroup::WorkerGroup(const graph::Plan& plan, const std::vector<std::pair<size_t, size_t>>& ranges,
                         std::vector<c10::Device> devices, const DistributedOptions& o,
                         const stage::StageOptions& stage_options, int threads_per_stage, bool workers_choose_gpus)
    : world_size_(o.world_size), nccl_(o.transport == TransportKind::Nccl), devices_(std::move(devices)) {
  if (o.connected) {
    if (!o.connected_store)
      throw Error(Status::InvalidArgument, "a connected transport needs a store for the workers' heartbeats");
    transport_ = o.connected;
    store_ = o.connected_store;
  } else {
    if (o.store.empty())
      throw Error(Status::InvalidArgument,
                  "a session over several processes needs a store address (HOST:PORT) that "
                  "its workers can reach");
    // Port 0: the store picks a free port; the workers are told the one it got.
    const auto address = comm::parse_address(o.store, "the store address", comm::PortZero::PicksAFreePort);
    const comm::Secret secret = comm::Secret::from(o.token);
    auto hosted = comm::host_store(address, secret, o.world_size, o.comm_timeout);
    server_ = hosted.server;
    store_ = hosted.store;
    const char* name = o.transport == TransportKind::Nccl ? "nccl" : "tcp";
    comm::announce_session(*store_, o.world_size, name);
    comm::wait_for_workers(*store_, o.world_size, comm::format_address(hosted.address), o.comm_timeout);
    if (workers_choose_gpus || o.transport == TransportKind::Nccl)
      for (int r = 1; r < o.world_size; ++r) {
        const c10::Device told = comm::joined_device(*store_, r);
        for (size_t s = ranges[r].first; s < ranges[r].second; ++s) devices_[s] = told;
      }
    if (o.transport == TransportKind::Nccl)
      transport_ = comm::make_nccl_transport(store_, 0, o.world_size, nccl_device(0), o.comm_timeout);
    else transport_ = comm::make_tcp_transport(*store_, secret, 0, o.world_size, hosted.address.host, o.comm_timeout);
  }

  SetupDeadline deadline(*transport_, o.comm_timeout);
  // Opened here only to see which tensors it holds.
  const auto checkpoint = stage_options.weights.empty() ? nullptr : stage::Checkpoint::open(stage_options.weights);
  for (int r = 1; r < world_size_; ++r) {
    WorkerAssignment a;
    a.world_size = world_size_;
    a.num_values = plan.values().size();
    a.threads_per_stage = threads_per_stage;
    a.heartbeat_interval = heartbeat_interval(o.comm_timeout);  // this side judges the beats
    a.weights = stage_options.weights;
    a.dtype = stage_options.dtype;
    a.quantize = stage_options.quantize;
    a.quantize_group = stage_options.quantize_group;
    a.quantize_head = stage_options.quantize_head;
    a.quantize_embedding = stage_options.quantize_embedding;
    for (size_t s = ranges[r].first; s < ranges[r].second; ++s) {
      a.stages.push_back(stage_io(plan, s));
      a.devices.push_back(devices_.at(s));
      // Built for the device the stage will use on the worker's machine, without the tensors the
      // worker reads from the checkpoint itself.
      auto shipped = stage::ship_stage(plan, s, devices_.at(s), stage_options, checkpoint.get());
      a.modules.push_back(std::move(shipped.bytes));
      a.aliases.push_back(std::move(shipped.aliases));
    }
    transport_->send(r, encode_assignment(a));
  }
  for (int r = 1; r < world_size_; ++r) {
    const Message ready = transport_->recv(r);
    if (ready.kind != Kind::Ready)
      throw Error(Status::Communication, "rank " + std::to_string(r) + " answered its stages with message kind " +
                                             std::to_string(static_cast<int>(ready.kind)));
    if (ready.status != 0) throw Error(static_cast<Status>(ready.status), ready.text);
  }
  transport_->send(1, comm::control(Kind::Warmup));
  const Message back = transport_->recv(world_size_ - 1);
  if (back.kind != Kind::Warmup)
    throw Error(Status::Communication,
                "the warm-up message came back as message kind " + std::to_string(static_cast<int>(back.kind)));
  log::info("session spread over " + std::to_string(world_size_) + " processes; every worker is ready");
}

void WorkerGroup::fail(const std::string& why) {
  if (nccl_) mark_failed_in_store(*store_, 0);
  transport_->abort(why);
}

WorkerGroup::~WorkerGroup() {
  // With NCCL the workers' heartbeats watch this rank's counter: it ended normally unless it was marked failed.
  if (nccl_) {
    try {
      store_->add(heartbeat_key(0), kHeartbeatLeft);
    } catch (const std::exception&) {}
  }
  transport_.reset();  // the connections first, then this process's store connection, then the server
  store_.reset();
  server_.reset();
}

}  // namespace libpipe::processes
