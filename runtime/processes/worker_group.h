// The driver's side of a session spread over processes: the rendezvous, handing each worker
// process its stages, and the two ends of the ring the micro-batches travel (out to rank 1, back
// from the last rank).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm/transport.h"
#include "runtime/graph/plan.h"
#include "runtime/stage/stage.h"

namespace libpipe::comm {
class StoreServer;
}  // namespace libpipe::comm

namespace libpipe::processes {

// Tcp: CPU stages over processes, libpipe's authenticated connections (comm/tcp_transport.h).
enum class TransportKind { Local, Tcp, Nccl };

// The shortest comm timeout a distributed session accepts (runtime/processes/heartbeat.h: workers
// beat every comm_timeout/8, at least every 10 ms).
inline constexpr std::chrono::milliseconds kMinDistributedCommTimeout{100};

struct DistributedOptions {
  TransportKind transport = TransportKind::Local;
  int world_size = 1;  // the driver included
  std::string store;   // "HOST:PORT" the driver hosts (PORT 0: a free one)
  std::string token;   // the session's secret (comm/auth.h); empty: LIBPIPE_TOKEN
  std::chrono::milliseconds comm_timeout{60000};
  // Tests: rank 0's end of an already connected transport (e.g. in-process ranks), and the store
  // the workers' heartbeats go to (e.g. a c10d::HashStore that serve() is given too).
  std::shared_ptr<comm::Transport> connected;
  c10::intrusive_ptr<c10d::Store> connected_store;
};

class WorkerGroup {
 public:
  // Hosts the store and waits for the workers (unless options.connected), sends rank r the
  // stages ranges[r] to run on devices[s] (of the worker's machine), waits until every worker
  // has loaded them and warms up the ring, all within options.comm_timeout. With NCCL, or with
  // `workers_choose_gpus` (devices "auto"), rank r's stages go instead where the worker said it would
  // run them when it joined (rank_device.h), and are built for that device. Throws Error:
  // Communication for a worker that does not come, cannot be reached or fails to load (with its
  // own status when it reported one, e.g. Unsupported for a device it does not have).
  WorkerGroup(const graph::Plan& plan, const std::vector<std::pair<size_t, size_t>>& ranges,
              std::vector<c10::Device> devices, const DistributedOptions& options,
              const stage::StageOptions& stage_options, int threads_per_stage, bool workers_choose_gpus = false);
  ~WorkerGroup();

  // The ring: micro-batches go to rank 1 and come back from the last rank. Both throw
  // Error(Communication) once the transport failed or was aborted.
  void send(const comm::Message& message) { transport_->send(1, message); }
  comm::Message receive() { return transport_->recv(world_size_ - 1); }
  // Makes every blocked send/receive fail; the group can only be destroyed afterwards.
  void abort(const std::string& why) { transport_->abort(why); }
  // The same when the session broke: with NCCL, this rank's counter in the store is marked failed first, since the
  // workers' transports would otherwise wait on this side for ever (their heartbeats watch the mark).
  void fail(const std::string& why);
  // Whether the ring runs over NCCL (whose transports cannot see a peer fail: heartbeat.h).
  bool nccl() const { return nccl_; }

  int world_size() const { return world_size_; }
  // Where every stage runs, the workers' choices included.
  const std::vector<c10::Device>& devices() const { return devices_; }
  // Where the workers' heartbeats arrive (heartbeat.h).
  c10d::Store& store() { return *store_; }

 private:
  std::shared_ptr<comm::StoreServer> server_;  // the store this driver hosts (none with `connected`)
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<comm::Transport> transport_;
  int world_size_ = 1;
  bool nccl_ = false;
  std::vector<c10::Device> devices_;
};

}  // namespace libpipe::processes
