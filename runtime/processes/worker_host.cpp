#include "runtime/processes/worker_host.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/core/InferenceMode.h>

#include <atomic>
#include <mutex>
#include <new>
#include <thread>

#include "runtime/comm/auth.h"
#include "runtime/comm/tcp_transport.h"
#include "runtime/comm/nccl_transport.h"
#include "runtime/comm/rendezvous.h"
#include "runtime/device/cuda_library.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/processes/assignment.h"
#include "runtime/schedule/bounded_queue.h"
#include "runtime/processes/heartbeat.h"
#include "runtime/processes/rank_device.h"
#include "runtime/stage/stage.h"

namespace libpipe::processes {

using schedule::BoundedQueue;
using schedule::run_stage_step;
using schedule::stage_error;
using schedule::StageError;
using schedule::StageIO;

namespace {

using comm::Kind;
using comm::Message;

// Where each of this rank's stages runs: with NCCL, on the transport's GPU (queued on its default
// stream, which NCCL orders its transfers with); otherwise where the driver placed it.
std::vector<c10::Device> stage_devices(const WorkerAssignment& a, int rank, const c10::Device& transport_device,
                                       bool nccl) {
  std::vector<c10::Device> devices;
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const c10::Device d = nccl ? transport_device : a.devices.at(i);
    device::require_device(d, "stage " + std::to_string(a.stages[i].index) + " (on rank " + std::to_string(rank) + ")");
    devices.push_back(d);
  }
  return devices;
}

// Loads this rank's stages; throws Error as building them does. Each stage's bytes move out of `a` into
// its build (they may hold the stage's weights: no copy kept).
std::vector<std::unique_ptr<stage::Stage>> load_stages(WorkerAssignment& a, int rank,
                                                       const std::vector<c10::Device>& devices) {
  std::vector<std::unique_ptr<stage::Stage>> stages;
  auto checkpoint = a.weights.empty() ? nullptr : stage::Checkpoint::open(a.weights);
  stage::StageOptions options;
  options.weights = a.weights;
  options.dtype = a.dtype;
  options.quantize = a.quantize;
  options.quantize_group = a.quantize_group;
  options.quantize_head = a.quantize_head;
  options.quantize_embedding = a.quantize_embedding;
  for (size_t i = 0; i < a.stages.size(); ++i) {
    stage::BuildOptions build;
    build.options = &options;
    build.checkpoint = checkpoint.get();
    build.device = devices[i];
    build.cpu_rewrites = true;  // worker processes share the machine: no cores are lent
    stages.push_back(
        stage::receive_stage({std::move(a.modules[i]), a.aliases[i]}, a.stages[i].index, build,
                             "stage " + std::to_string(a.stages[i].index) + " on rank " + std::to_string(rank)));
  }
  return stages;
}

// A message inside this worker, with the GPU work its values wait for.
struct Envelope {
  Message message;
  device::Ready ready;
};

}  // namespace

void serve(comm::Transport& transport, const c10::Device& device, std::chrono::milliseconds comm_timeout,
           int threads_per_stage, c10::intrusive_ptr<c10d::Store> store) {
  const int rank = transport.rank(), world = transport.world_size();
  const int prev = rank - 1, next = (rank + 1) % world;
  WorkerAssignment a = decode_assignment(transport.recv(0, comm_timeout));
  const bool nccl = !device.is_cpu();

  // receiver -> queues[0] -> stage 0 -> queues[1] -> ... -> queues[k] -> sender. The driver's
  // admission bounds what is in flight; the bound here only keeps memory finite if it did not.
  const size_t k = a.stages.size();
  std::vector<std::unique_ptr<BoundedQueue<Envelope>>> queues;
  for (size_t i = 0; i <= k; ++i) queues.push_back(std::make_unique<BoundedQueue<Envelope>>(4096));
  std::mutex failure_mutex;
  std::string failure;     // guarded by failure_mutex
  bool passed_on = false;  // this worker sent the Shutdown on; guarded by failure_mutex
  // Ends this worker's part: the first reason is kept, the transport and the queues stop.
  auto stop_here = [&](const std::string& why) {
    {
      std::lock_guard lock(failure_mutex);
      if (failure.empty()) failure = why;
    }
    transport.abort(why);
    for (auto& q : queues) q->close();
  };
  // Once it has sent the Shutdown on, the driver may end and take its store along, and its peers may end:
  // neither is a failure then.
  const auto after_passing_on = [&] {
    std::lock_guard lock(failure_mutex);
    return passed_on;
  };
  // From here until it returns, this worker tells the driver it is alive, whatever its stages do, and learns
  // that the driver is gone when the driver's store stops answering (then there is no store to mark anything in).
  std::unique_ptr<Heartbeat> heartbeat = std::make_unique<Heartbeat>(std::move(store), rank, a.heartbeat_interval,
                                                                     comm_timeout, [&](const std::string& why) {
                                                                       if (!after_passing_on()) stop_here(why);
                                                                     });
  // A failure of this worker's own: the peers that watch this rank (NCCL's) fail at once; its counter never
  // says "left".
  auto fail = [&](const std::string& why) {
    heartbeat->mark_failed();
    stop_here(why);
  };
  // The heartbeat's threads call the lambdas above: it goes first, whichever way this function ends.
  struct EndHeartbeat {
    std::unique_ptr<Heartbeat>& heartbeat;
    ~EndHeartbeat() { heartbeat.reset(); }
  } end_heartbeat{heartbeat};
  // NCCL never notices a dead peer (its kernels wait for ever): the heartbeat watches every other worker for it,
  // and the driver's counter for its failed mark; a peer that ended normally is one the transport stops waiting
  // for. A TCP connection fails by itself when its peer's process ends.
  if (nccl) {
    std::vector<int> peers;
    for (int r = 1; r < world; ++r)
      if (r != rank) peers.push_back(r);
    heartbeat->watch_peers(
        peers, {0},
        [&](const std::string& why) {
          if (!after_passing_on()) fail(why);
        },
        [&transport](int peer) { transport.peer_left(peer); });
  }

  std::vector<std::unique_ptr<stage::Stage>> stages;
  std::vector<device::Place> places;
  try {
    const auto devices = stage_devices(a, rank, device, nccl);
    stages = load_stages(a, rank, devices);
    for (const auto& d : devices)
      places.push_back(nccl ? device::Place::with_default_stream(d) : device::Place::with_own_stream(d));
  } catch (const std::exception& e) {  // the driver is told why, whatever failed, instead of seeing a lost rank
    Message ready = comm::control(Kind::Ready);
    const auto* own = dynamic_cast<const Error*>(&e);
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const bool out_of_memory =
        dynamic_cast<const std::bad_alloc*>(&e) || dynamic_cast<const c10::OutOfMemoryError*>(&e);
    ready.status = static_cast<int32_t>(own ? own->status() : out_of_memory ? Status::OutOfMemory : Status::Internal);
    ready.text = "rank " + std::to_string(rank) + ": " +
                 (c10_error ? c10_error->what_without_backtrace() : std::string(e.what()));
    heartbeat->mark_failed();  // a worker that could not load failed: never "left"
    transport.send(0, ready);
    throw;
  }
  transport.send(0, comm::control(Kind::Ready));
  const int threads = threads_per_stage > 0 ? threads_per_stage : a.threads_per_stage;
  log::info("rank " + std::to_string(rank) + " serves stages " + std::to_string(a.stages.front().index) + ".." +
            std::to_string(a.stages.back().index) + " with " + std::to_string(threads) + " thread(s) each");

  std::vector<std::thread> threads_;
  for (size_t i = 0; i < k; ++i)
    threads_.emplace_back([&, i] {
      at::set_num_threads(threads);
      c10::InferenceMode inference;
      const StageIO& io = a.stages[i];
      while (auto item = queues[i]->pop()) {
        Envelope env = std::move(*item);
        Message& m = env.message;
        if (m.kind == Kind::Data) {
          try {
            if (m.values.size() != a.num_values)
              throw Error(Status::Internal, "a micro-batch arrived with " + std::to_string(m.values.size()) +
                                                " values instead of " + std::to_string(a.num_values));
            // Waiting for all the work before it (not only its producers') costs nothing here:
            // the earlier stages of this rank already waited for the rest.
            c10::IValue out = run_stage_step(*stages[i], io, m.values, places[i], env.ready);
            if (io.last) {
              m.kind = Kind::Result;
              m.values = {std::move(out)};
            }
            if (auto done = places[i].mark()) env.ready.push_back(std::move(done));
          } catch (const std::exception& e) {
            const StageError err = stage_error(io.index, m.microbatch, e);
            m = Message{Kind::Error, m.request, m.microbatch, static_cast<int32_t>(err.status), {}, err.message};
          }
        }
        const bool last = m.kind == Kind::Shutdown;
        if (!queues[i + 1]->push(std::move(env)) || last) return;
      }
    });
  threads_.emplace_back([&] {
    // What travels must be where the transport carries it from: the CPU for Gloo, the GPU's
    // default stream for NCCL.
    device::Place transport_place = nccl ? device::Place::with_default_stream(device) : device::Place();
    while (auto item = queues[k]->pop()) {
      Message& m = item->message;
      const bool last = m.kind == Kind::Shutdown;
      try {
        transport_place.receive(m.values, item->ready);
      } catch (const c10::Error& e) {
        m = Message{Kind::Error,
                    m.request,
                    m.microbatch,
                    static_cast<int32_t>(Status::Execution),
                    {},
                    "rank " + std::to_string(rank) + " could not bring micro-batch " + std::to_string(m.microbatch) +
                        " to " + device.str() + " for the transport: " + e.what_without_backtrace()};
      }
      if (last) {
        std::lock_guard lock(failure_mutex);
        passed_on = true;
      }
      try {
        transport.send(next, m);
      } catch (const std::exception& e) {
        fail(e.what());
        return;
      }
      if (last) return;
    }
  });
  for (;;) {
    Message m;
    try {
      m = transport.recv(prev);
    } catch (const std::exception& e) {
      fail(e.what());
      break;
    }
    const bool last = m.kind == Kind::Shutdown;
    Envelope env{std::move(m), {}};
    // Values received on a GPU (NCCL) are ordered after this thread's current stream there.
    for (const auto& v : env.message.values)
      if (device::holds_gpu_tensor(v)) {
        env.ready.push_back(device::mark_current(device));
        break;
      }
    if (!queues[0]->push(std::move(env)) || last) break;
  }
  // A Shutdown passes every queue after what was queued before it; each thread returns once it
  // passed it on (or when a failure closed the queues).
  for (auto& t : threads_) t.join();
  std::lock_guard lock(failure_mutex);
  if (!failure.empty())
    throw Error(Status::Communication, "rank " + std::to_string(rank) + " lost its session: " + failure);
}

void serve_worker(const WorkerOptions& o) {
  if (o.world_size < 2)
    throw Error(Status::InvalidArgument, "a worker's world size must be at least 2 (the driver and this worker), got " +
                                             std::to_string(o.world_size));
  if (o.rank < 1 || o.rank >= o.world_size)
    throw Error(Status::InvalidArgument, "a worker's rank must be in 1.." + std::to_string(o.world_size - 1) +
                                             " (rank 0 is the driver), got " + std::to_string(o.rank));
  if (o.comm_timeout.count() <= 0)
    throw Error(Status::InvalidArgument,
                "the comm timeout must be positive, got " + std::to_string(o.comm_timeout.count()));
  const auto address = comm::parse_address(o.store, "the store address");
  const comm::Secret secret = comm::Secret::from(o.token);
  std::string local_host;
  auto store = comm::connect_store(address, secret, o.comm_timeout, &local_host);
  // The driver builds this rank's stages for the GPU it tells (NCCL's, or devices "auto").
  const auto gpu = own_gpu(o.rank);
  const std::string transport_name = comm::join_session(*store, o.rank, o.world_size, gpu ? gpu->str() : "cpu");
  std::unique_ptr<comm::Transport> transport;
  c10::Device device(c10::kCPU);
  if (transport_name == "tcp") {
    transport = comm::make_tcp_transport(*store, secret, o.rank, o.world_size, local_host, o.comm_timeout);
  } else if (transport_name == "nccl") {
    device = nccl_device(o.rank);
    transport = comm::make_nccl_transport(store, o.rank, o.world_size, device, o.comm_timeout);  // watched by serve()
  } else {
    throw Error(Status::Communication,
                "the driver asked for transport '" + transport_name + "', which this worker does not know");
  }
  serve(*transport, device, o.comm_timeout, o.threads_per_stage, store);
}

}  // namespace libpipe::processes
