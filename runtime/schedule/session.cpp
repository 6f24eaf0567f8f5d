#include "runtime/schedule/session.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "runtime/comm/nccl_transport.h"
#include "runtime/device/cuda_graph.h"
#include "runtime/device/cuda_library.h"
#include "runtime/device/placement.h"
#include "runtime/log.h"
#include "runtime/planner/planner.h"
#include "runtime/processes/assignment.h"
#include "runtime/schedule/op_timer.h"
#include "runtime/processes/rank_device.h"
#include "runtime/stage/graphed_stage.h"
#include "runtime/stage/preamble_split.h"
#include "runtime/stage/stage.h"

namespace libpipe::schedule {

using processes::kMinDistributedCommTimeout;
using processes::own_gpu;
using processes::place_stages;
using processes::TransportKind;

namespace {

int64_t since_us(Clock::time_point epoch, Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - epoch).count();
}

}  // namespace

Session::Session(std::shared_ptr<const graph::Plan> plan, SessionOptions options)
    : plan_(std::move(plan)), options_(std::move(options)) {
  const size_t n = plan_->num_stages();
  if (options_.num_microbatches < 1)
    throw Error(Status::InvalidArgument,
                "num_microbatches must be at least 1, got " + std::to_string(options_.num_microbatches));
  if (options_.threads_per_stage < 0)
    throw Error(Status::InvalidArgument, "threads_per_stage must be 0 (automatic) or positive, got " +
                                             std::to_string(options_.threads_per_stage));
  if (options_.max_inflight < 0)
    throw Error(Status::InvalidArgument,
                "max_inflight must be 0 (automatic) or positive, got " + std::to_string(options_.max_inflight));
  const size_t num_inputs = plan_->model().input_names().size();
  if (options_.input_specs.size() > num_inputs)
    throw Error(Status::InvalidArgument, std::to_string(options_.input_specs.size()) +
                                             " input specs given but the model takes " + std::to_string(num_inputs) +
                                             " inputs");
  if (options_.max_inflight == 0)
    options_.max_inflight = std::max<int64_t>(2 * options_.num_microbatches, 4 * static_cast<int64_t>(n));
  total_stages_ = n;

  const auto& dist = options_.distributed;
  if (dist.transport != TransportKind::Local && dist.world_size < 2)
    throw Error(Status::InvalidArgument,
                "a TCP or NCCL session needs world_size >= 2 (this process and at least one worker), got " +
                    std::to_string(dist.world_size));
  if (dist.world_size < 1)
    throw Error(Status::InvalidArgument, "the world size must be at least 1, got " + std::to_string(dist.world_size));
  if (dist.transport == TransportKind::Local && !dist.connected && !dist.store.empty())
    throw Error(Status::InvalidArgument,
                "the store is set but the transport is local; choose the TCP or NCCL transport, or leave the "
                "store empty");
  if (dist.transport == TransportKind::Nccl) {
    std::string why;
    if (!comm::nccl_available(&why)) throw Error(Status::Unsupported, why);
  }
  if (dist.transport == TransportKind::Local && !dist.connected && dist.world_size != 1)
    throw Error(Status::InvalidArgument,
                "the local transport runs every stage in this process (world size 1); "
                "choose the TCP or NCCL transport to spread stages over " +
                    std::to_string(dist.world_size) + " processes");
  if (dist.comm_timeout.count() <= 0)
    throw Error(Status::InvalidArgument,
                "the comm timeout must be positive, got " + std::to_string(dist.comm_timeout.count()) + " ms");
  const bool distributed = dist.world_size > 1;
  // Workers beat every comm_timeout/8 (at least every 10 ms); a timeout of a few beats' length
  // would fail healthy workers whenever a beat is late.
  if (distributed && dist.comm_timeout < kMinDistributedCommTimeout)
    throw Error(Status::InvalidArgument, "the comm timeout of a distributed session must be at least " +
                                             std::to_string(kMinDistributedCommTimeout.count()) + " ms, got " +
                                             std::to_string(dist.comm_timeout.count()) +
                                             " ms: workers send a heartbeat every comm_timeout/8, and a shorter "
                                             "timeout leaves no room for one that is late");
  const bool nccl = distributed && dist.transport == TransportKind::Nccl;
  const auto ranges = place_stages(n, dist.world_size);
  const size_t local = ranges[0].second;
  if (nccl) {
    if (!options_.devices.empty())
      throw Error(Status::InvalidArgument,
                  "with the NCCL transport each process runs its stages on its own GPU; leave "
                  "the device list empty (it was '" +
                      options_.devices + "')");
    for (size_t r = 0; r < ranges.size(); ++r)
      for (size_t s = ranges[r].first; s < ranges[r].second; ++s)
        devices_.push_back(processes::nccl_device(static_cast<int>(r)));
  } else if (distributed && device::is_auto(options_.devices)) {
    // Across processes each takes its own GPU (rank_device.h): this one's for its stages; the workers
    // tell theirs when they join (WorkerGroup), meanwhile assumed to be of the same kind.
    const auto gpu = own_gpu(0);
    devices_.assign(n, gpu ? *gpu : c10::Device(c10::kCPU));
  } else {
    devices_ = device::stage_devices(options_.devices, n);
  }
  // The cores go to the stages that compute on them; a GPU stage's thread only queues kernels.
  const size_t cpu_stages =
      std::count_if(devices_.begin(), devices_.end(), [](const c10::Device& d) { return d.is_cpu(); });
  threads_per_stage_ = options_.threads_per_stage > 0 ? options_.threads_per_stage
                                                      : default_threads_per_stage(std::max<size_t>(cpu_stages, 1));

  // Stages with one thread each may borrow the cores of stages that are idle (stage/spare_cores.h);
  // with more, OpenMP splits their operators already. Worker processes share the machine: not there.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // More CPU stages than cores, all here: one worker thread per core, sharing the stages (stage_sharing.h).
  if (options_.stage_workers < 0 || static_cast<size_t>(options_.stage_workers) > n)
    throw Error(Status::InvalidArgument, "stage_workers must be 0 (automatic) or 1 .. the " + std::to_string(n) +
                                             " stages, got " + std::to_string(options_.stage_workers));
  const bool all_here_on_cpu = !distributed && cpu_stages == n;
  size_t num_workers = local;
  if (options_.stage_workers > 0) {
    if (!all_here_on_cpu && static_cast<size_t>(options_.stage_workers) != n)
      throw Error(Status::InvalidArgument,
                  "stages can share worker threads only when they all run on the CPU in this process; give "
                  "stage_workers 0");
    num_workers = static_cast<size_t>(options_.stage_workers);
  } else if (all_here_on_cpu && options_.threads_per_stage == 0 && n > static_cast<size_t>(cores)) {
    const char* env = std::getenv("LIBPIPE_STAGE_SHARING");
    if (!(env && std::string(env) == "0")) num_workers = static_cast<size_t>(cores);
  }
  if (num_workers < local)
    threads_per_stage_ =
        options_.threads_per_stage > 0 ? options_.threads_per_stage : default_threads_per_stage(num_workers);
  // A lone CPU stage computes on one thread with the other cores as its pool's helpers rather than on an OpenMP
  // team: only its pool reads the next weights ahead, and a one-row product's hand-over costs less than a team's
  // (SmolLM2 on 2 cores, one sequence: bf16 decode 97-102 tokens/s against 80-87, TTFT 124-135 ms against 261-284).
  const bool may_lend = !distributed && options_.threads_per_stage == 0 && stage::SpareCores::enabled();
  if (may_lend && cpu_stages == 1 && n == 1 && cores > 1) {
    threads_per_stage_ = 1;
    spare_cores_ = std::make_unique<stage::SpareCores>(cores);
  } else if (may_lend && threads_per_stage_ == 1 && cpu_stages > 1 && num_workers > 1) {
    spare_cores_ = std::make_unique<stage::SpareCores>(
        std::min({static_cast<int>(cpu_stages), static_cast<int>(num_workers), cores}));
  }
  auto checkpoint = options_.stage.weights.empty() ? nullptr : stage::Checkpoint::open(options_.stage.weights);
  for (size_t s = 0; s < local; ++s) {
    stage::BuildOptions build;
    build.options = &options_.stage;
    build.checkpoint = checkpoint.get();
    build.device = devices_[s];
    build.cpu_rewrites = true;
    // A GPU stage replays a generation engine's decode steps as CUDA graphs (LIBPIPE_CUDA_GRAPHS=0: never); the
    // first from its first layer on, its preamble (a decoder's checks) run as it is. Not on the default stream that
    // NCCL's stages share (a graph is recorded on a stream of its own).
    const bool graphs = devices_[s].is_cuda() ? device::cuda_graphs_enabled() : options_.graph_cpu_stages;
    if (options_.graph_steps && !nccl && graphs) {
      const c10::Device device = devices_[s];
      const std::string who = "stage " + std::to_string(s);
      auto factory = options_.graph_factory;
      auto graphed = [device, who, factory](std::unique_ptr<stage::Stage> stage) -> std::unique_ptr<stage::Stage> {
        return std::make_unique<stage::GraphedStage>(
            std::move(stage),
            [device, factory] { return factory ? factory(device) : device::cuda_graph_factory(device); }, who);
      };
      std::unique_ptr<stage::Stage> split = s == 0 ? stage::PreambleSplitStage::build(*plan_, build, graphed) : nullptr;
      stages_.push_back(split ? std::move(split) : graphed(stage::build_stage(*plan_, s, build)));
    } else {
      stages_.push_back(stage::build_stage(*plan_, s, build));
    }
    // NCCL orders its transfers with the default stream, so its stages queue there too.
    places_.push_back(nccl ? device::Place::with_default_stream(devices_[s])
                           : device::Place::with_own_stream(devices_[s]));
  }
  for (size_t s = 0; s < n; ++s) stage_io_.push_back(stage_io(*plan_, s));
  std::unique_ptr<processes::WorkerGroup> group;
  if (distributed) {
    group = std::make_unique<processes::WorkerGroup>(*plan_, ranges, devices_, dist, options_.stage, threads_per_stage_,
                                                     device::is_auto(options_.devices));
    devices_ = group->devices();
  }
  for (size_t s = 0; s < local; ++s) counters_.push_back(std::make_unique<StageCounters>());
  sharing_ = std::make_unique<StageSharing>(local, num_workers);
  if (sharing_->shares())
    log::info(std::to_string(local) + " stages share " + std::to_string(num_workers) +
              " worker threads, one per core (stage_sharing.h)");
  {
    const char* env = std::getenv("LIBPIPE_RUN_ALONE");
    run_alone_ =
        spare_cores_ && all_here_on_cpu && local > 1 && !sharing_->shares() && !(env && std::string(env) == "0");
  }
  for (size_t w = 0; w < num_workers; ++w) {
    auto worker = std::make_unique<Worker>();
    // Admission bounds what is inside the pipeline, so a queue never holds more than that.
    worker->queue = std::make_unique<BoundedQueue<MicroBatch>>(static_cast<size_t>(options_.max_inflight));
    workers_.push_back(std::move(worker));
  }
  for (size_t w = 0; w < num_workers; ++w) workers_[w]->thread = std::thread([this, w] { worker_loop(w); });
  if (group)
    ring_ = std::make_unique<processes::Ring>(
        std::move(group), static_cast<size_t>(options_.max_inflight), dist.comm_timeout, shutting_down_,
        // What travels must be where the transport carries it from.
        nccl ? device::Place::with_default_stream(devices_[local]) : device::Place(),
        [this](const std::shared_ptr<Request>& r, Status st, const std::string& why) { retire(r, st, why); });
}

Session::~Session() {
  shutting_down_ = true;
  {
    std::lock_guard lock(admission_mutex_);
    stopping_ = true;
  }
  admission_cv_.notify_all();
  for (auto& w : workers_) w->queue->close();
  for (auto& w : workers_) w->thread.join();
  if (ring_) ring_->stop();
  timer_.reset();  // last: deadlines of calls still held in a stage above fire until then
}

void Session::admit(const std::shared_ptr<Request>& request) {
  std::unique_lock lock(admission_mutex_);
  admission_cv_.wait_until(lock, request->deadline(),
                           [&] { return stopping_ || inflight_ < options_.max_inflight || request->failed(); });
  if (stopping_) throw Error(Status::Cancelled, "the session is shutting down");
  if (request->failed()) throw Error(Status::Cancelled, "");  // the request already says why
  if (inflight_ >= options_.max_inflight)
    throw Error(Status::DeadlineExceeded, "the call's deadline passed while it waited for room in the pipeline");
  ++inflight_;
  --promised_;
  if (spare_cores_) spare_cores_->set_pipeline_load(inflight_);
}

void Session::unpromise(int64_t count) {
  if (count == 0) return;
  std::lock_guard lock(admission_mutex_);
  promised_ -= count;
}

void Session::release() {
  {
    std::lock_guard lock(admission_mutex_);
    --inflight_;
    if (spare_cores_) spare_cores_->set_pipeline_load(inflight_);
  }
  admission_cv_.notify_one();
}

int64_t Session::promise_microbatches() {
  const int64_t requested = options_.num_microbatches;
  std::lock_guard lock(admission_mutex_);
  int64_t count = requested;
  // Alone, the call must fill the pipeline by itself: all M. Otherwise the micro-batches
  // already inside (or about to enter) count towards the one-per-stage that keeps every stage
  // busy.
  const int64_t others = inflight_ + promised_;
  if (options_.adaptive_microbatches && others > 0)
    count = std::clamp<int64_t>(static_cast<int64_t>(concurrent_stages()) - others, 1, requested);
  promised_ += count;
  return count;
}

void Session::worker_loop(size_t w) {
  // Per-thread with OpenMP (and MKL): this stage's operators use their share of the cores only.
  // ATen sets a thread's count on the thread's first parallel operation, to the count any thread
  // set last (another session's, whose stages may have another share): that first time is now, so
  // that what this thread sets stays.
  (void)at::get_num_threads();
  at::set_num_threads(threads_per_stage_);
  c10::InferenceMode inference;
  stage::SpareCores* spare = devices_[sharing_->first_stage(w)].is_cpu() ? spare_cores_.get() : nullptr;
  stage::SpareCores::Lend lend(spare);
  Worker& me = *workers_[w];
  auto waited_from = Clock::now();
  while (auto item = me.queue->pop()) {
    const auto start = Clock::now();
    me.idle_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(start - waited_from).count();
    MicroBatch mb = std::move(*item);
    if (w == 0) mb.ticket.order = sharing_->enter();
    size_t s = mb.next_stage;
    for (;;) {
      run_counted(w, s, mb, spare);
      // A failed call leaves at once, unless stages are shared: then it passes the later stages without running
      // them, so that every stage still sees the micro-batches in order.
      if (s + 1 == total_stages_ || (mb.request->failed() && !sharing_->shares())) {
        // Release before finishing: a caller woken by its last micro-batch then finds the pipeline
        // as it is, not one slot fuller (which would make its next call's cut depend on timing).
        auto r = mb.request;
        mb = MicroBatch{};  // free this micro-batch's tensors before the caller wakes
        release();
        r->finish_one();
        break;
      }
      if (sharing_->keep(w, s + 1, mb.ticket) || runs_alone(s + 1)) {
        ++s;
        continue;
      }
      mb.next_stage = s + 1;
      auto r = mb.request;
      // Unshared, worker s + 1 owns stage s + 1 (w < s where a micro-batch ran alone until others came).
      const size_t to = sharing_->shares() ? w + 1 : s + 1;
      const bool pushed = s + 1 == stages_.size() ? ring_->push(std::move(mb)) : hand_to(to, std::move(mb));
      if (!pushed) {
        r->fail(Status::Cancelled, "the session was destroyed while the call was running");
        release();
        r->finish_one();
      }
      break;
    }
    sharing_->done(w);
    waited_from = Clock::now();
  }
}

bool Session::runs_alone(size_t next) {
  if (!run_alone_ || next >= stages_.size() || expected_steps_.load(std::memory_order_relaxed) > 1) return false;
  std::lock_guard lock(admission_mutex_);
  return inflight_ == 1 && promised_ == 0;
}

void Session::run_counted(size_t w, size_t s, MicroBatch& mb, stage::SpareCores* spare) {
  StageCounters& counters = *counters_[s];
  const auto& request = mb.request;
  if (shutting_down_.load(std::memory_order_relaxed))
    request->fail(Status::Cancelled, "the session was destroyed while the call was running");
  if (Clock::now() >= request->deadline())
    request->fail(Status::DeadlineExceeded, "the call did not finish before its deadline");
  if (request->failed()) {
    sharing_->passed_over(s);
    return;
  }
  std::optional<OpTimer> op_timer;
  if (tracing() && trace_operators_.load(std::memory_order_relaxed)) op_timer.emplace();
  bool ok = true;
  const auto start = Clock::now();
  try {
    stage::SpareCores::Busy busy(spare);
    run_stage(s, mb);
  } catch (const std::exception& e) {
    ok = false;
    const StageError err = stage_error(s, mb.index, e);
    request->fail(err.status, err.message);
  }
  const auto end = Clock::now();
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  counters.microbatches++;
  counters.busy_ns += ns;
  if (ok) {
    sharing_->passed(s, static_cast<double>(ns), mb.ticket);
  } else {
    counters.failures++;
    sharing_->passed_over(s);
  }
  if (tracing()) {
    std::lock_guard lock(counters.trace_mutex);
    counters.trace.push_back({w, request->id(), mb.index, since_us(epoch_, start), since_us(epoch_, end), ok,
                              op_timer ? op_timer->totals() : TraceArgs{}});
  }
}

bool Session::hand_to(size_t w, MicroBatch&& mb) {
  sharing_->given(w);
  if (workers_[w]->queue->push(std::move(mb))) return true;
  sharing_->done(w);
  return false;
}

void Session::run_stage(size_t s, MicroBatch& mb) {
  device::Place& place = places_[s];
  const StageIO& io = stage_io_[s];
  stage::GraphableCall graphable(mb.graphable);
  c10::IValue out = run_stage_step(*stages_[s], io, mb.env, place, mb.ready_for(io.producers));
  if (io.last) {
    // Each micro-batch owns its slot. Results for the CPU come down on the stage's stream; the
    // caller waits for that (Request::result), this thread goes on.
    if (!options_.outputs_on_device) out = place.send_to_cpu(out);
    mb.request->result_ready_[mb.index] = place.mark();
    mb.request->results_[mb.index] = std::move(out);
  } else if (place.on_gpu()) {
    if (mb.stage_ready.size() <= s) mb.stage_ready.resize(s + 1);
    mb.stage_ready[s] = place.mark();
  }
}

std::string Session::broken() const { return ring_ ? ring_->broken() : std::string(); }

void Session::retire(const std::shared_ptr<Request>& request, Status status, const std::string& why) {
  if (status != Status::Ok) request->fail(status, why);
  release();
  request->finish_one();
}

std::shared_ptr<Request> Session::submit(const std::vector<c10::IValue>& inputs, const RunOptions& options) {
  if (ring_) {
    const std::string why = ring_->broken();
    if (!why.empty())
      throw Error(Status::Communication, "the session is broken (" + why +
                                             "); destroy it, restart its workers and create "
                                             "a new one");
  }
  const auto& names = plan_->model().input_names();
  if (inputs.size() != names.size()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw Error(Status::Input, "the model takes " + std::to_string(names.size()) + " input" +
                                   (names.size() == 1 ? "" : "s") + " (" + list + ") but " +
                                   std::to_string(inputs.size()) + " were given");
  }
  // Inputs may be on any device this process can use; the stages that read them bring them over
  // once the caller's work queued on them so far (its current streams) is done.
  std::vector<c10::Device> input_devices;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor() || inputs[i].toTensor().device().is_cpu()) continue;
    const c10::Device d = inputs[i].toTensor().device();
    try {
      device::require_device(d, "input '" + names[i] + "'");
    } catch (const Error& e) {
      throw Error(Status::Input, e.what());
    }
    if (std::find(input_devices.begin(), input_devices.end(), d) == input_devices.end()) input_devices.push_back(d);
  }
  std::vector<c10::IValue> cast;
  if (options_.stage.dtype) {
    // The weights were cast: floating inputs follow, so the first stage sees one dtype.
    cast = inputs;
    for (auto& v : cast) {
      if (!v.isTensor()) continue;
      const at::Tensor& t = v.toTensor();
      if (at::isFloatingType(t.scalar_type())) v = t.to(*options_.stage.dtype);
    }
  }
  device::Ready input_ready;
  for (const auto& d : input_devices) input_ready.push_back(device::mark_current(d));
  // Whatever happens below, the micro-batches promised and not admitted are given back.
  struct Unpromise {
    Session& session;
    int64_t left;
    ~Unpromise() { session.unpromise(left); }
  } promised{*this, promise_microbatches()};
  auto microbatches = chunk::split_inputs(cast.empty() ? inputs : cast, names, promised.left, options_.input_specs);
  // Each micro-batch (what the first stages see; a batch dimension may have a range) is checked as the
  // model's format needs: an exported program's stages check nothing they are given.
  for (size_t m = 0; m < microbatches.size(); ++m)
    plan_->model().check_inputs(
        microbatches[m], microbatches.size() == 1
                             ? std::string()
                             : "micro-batch " + std::to_string(m) + " of " + std::to_string(microbatches.size()));
  auto request =
      std::make_shared<Request>(next_request_id_++, microbatches.size(), options.deadline, options_.outputs_on_device);
  for (size_t m = 0; m < microbatches.size(); ++m) {
    try {
      admit(request);
      --promised.left;
    } catch (const Error& e) {
      if (!request->failed()) request->fail(e.status(), e.what());
      // Micro-batches never admitted will never finish by themselves.
      for (size_t rest = m; rest < microbatches.size(); ++rest) request->finish_one();
      break;
    }
    MicroBatch mb{request, m, std::vector<c10::IValue>(plan_->values().size()), input_ready, {}, 0, {}};
    for (size_t id = 0; id < plan_->values().size(); ++id) {
      const auto& cv = plan_->values()[id];
      if (cv.producer < 0) mb.env[id] = microbatches[m][cv.input_index];
    }
    if (!hand_to(0, std::move(mb))) {
      request->fail(Status::Cancelled, "the session was destroyed while the call was running");
      release();
      for (size_t rest = m; rest < microbatches.size(); ++rest) request->finish_one();
      break;
    }
  }
  // Watched from here on, not during admission, which fails a call that waits past its deadline
  // with its own message; until submit returns, nobody can have asked to be told.
  if (options.deadline != Clock::time_point::max()) {
    std::lock_guard lock(timer_mutex_);
    if (!timer_) timer_ = std::make_unique<DeadlineTimer>();
    timer_->watch(request);
  }
  return request;
}

std::shared_ptr<Request> Session::submit_step(std::vector<c10::IValue>&& inputs, bool graphable) {
  if (ring_) {
    const std::string why = ring_->broken();
    if (!why.empty())
      throw Error(Status::Communication,
                  "the session is broken (" + why + "); destroy it, restart its workers and create a new one");
  }
  auto request = std::make_shared<Request>(next_request_id_++, 1, Clock::time_point::max(), options_.outputs_on_device);
  {
    std::lock_guard lock(admission_mutex_);
    if (stopping_) throw Error(Status::Cancelled, "the session is shutting down");
    ++inflight_;  // counted like any micro-batch, so release() balances it; the caller bounds how many
  }
  MicroBatch mb{request, 0, std::vector<c10::IValue>(plan_->values().size()), {}, {}, 0, {}};
  mb.graphable = graphable;
  for (size_t id = 0; id < plan_->values().size(); ++id) {
    const auto& cv = plan_->values()[id];
    if (cv.producer < 0) mb.env[id] = inputs.at(cv.input_index);  // a reference, not a copy of the data
  }
  if (!hand_to(0, std::move(mb))) {
    request->fail(Status::Cancelled, "the session was destroyed while the call was running");
    release();
    request->finish_one();
  }
  return request;
}

std::vector<NamedTensor> Session::run(const std::vector<c10::IValue>& inputs, const RunOptions& options) {
  auto request = submit(inputs, options);
  try {
    return request->result(options_.output_specs);
  } catch (...) {
    request->drain();
    throw;
  }
}

StageStats Session::stats(size_t stage) const {
  StageStats st;
  if (stage >= total_stages_) throw Error(Status::InvalidArgument, "no stage " + std::to_string(stage));
  if (stage >= counters_.size()) return st;  // hosted by a worker process
  const StageCounters& c = *counters_[stage];
  st.microbatches = c.microbatches.load();
  st.failures = c.failures.load();
  st.busy_ms = static_cast<double>(c.busy_ns.load()) / 1e6;
  if (const int owner = sharing_->owner(stage); owner >= 0) {
    const Worker& w = *workers_[static_cast<size_t>(owner)];
    st.idle_ms = static_cast<double>(w.idle_ns.load()) / 1e6;
    st.queue_depth = w.queue->size();
  }
  return st;
}

void Session::start_trace(bool operators) {
  for (auto& c : counters_) {
    std::lock_guard lock(c->trace_mutex);
    c->trace.clear();
  }
  {
    std::lock_guard lock(other_trace_mutex_);
    other_trace_.clear();
  }
  trace_operators_ = operators;
  tracing_ = true;
}

void Session::trace_event(const std::string& track, std::string name, Clock::time_point start, Clock::time_point end,
                          TraceArgs args) {
  if (!tracing()) return;
  std::lock_guard lock(other_trace_mutex_);
  other_trace_.push_back({track, std::move(name), since_us(epoch_, start), since_us(epoch_, end), std::move(args)});
}

std::string Session::stop_trace() {
  tracing_ = false;
  using Json = nlohmann::json;
  Json events = Json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "libpipe session"}}}});
  for (size_t s = 0; s < counters_.size(); ++s) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", s},
                      {"args", {{"name", "stage " + std::to_string(s)}}}});
    events.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 1}, {"tid", s}, {"args", {{"sort_index", s}}}});
    std::lock_guard lock(counters_[s]->trace_mutex);
    for (const auto& e : counters_[s]->trace) {
      Json args{{"request", e.request}, {"microbatch", e.microbatch}};
      if (sharing_->shares() || e.worker != s) args["worker"] = e.worker;  // which thread ran it
      if (!e.operators_us.empty()) {
        Json ops = Json::object();
        for (const auto& [op, us] : e.operators_us) ops[op] = us;
        args["operators_us"] = std::move(ops);
      }
      events.push_back({{"name", "request " + std::to_string(e.request) + " mb " + std::to_string(e.microbatch)},
                        {"cat", e.ok ? "microbatch" : "failed"},
                        {"ph", "X"},
                        {"pid", 1},
                        {"tid", s},
                        {"ts", e.start_us},
                        {"dur", std::max<int64_t>(e.end_us - e.start_us, 1)},
                        {"args", std::move(args)}});
    }
    counters_[s]->trace.clear();
  }
  // The callers' tracks (trace_event) below the stages', one per name in the order they appeared.
  std::lock_guard lock(other_trace_mutex_);
  std::vector<std::string> tracks;
  for (const auto& e : other_trace_) {
    auto at = std::find(tracks.begin(), tracks.end(), e.track);
    const size_t tid = counters_.size() + static_cast<size_t>(at - tracks.begin());
    if (at == tracks.end()) {
      tracks.push_back(e.track);
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", tid}, {"args", {{"name", e.track}}}});
      events.push_back(
          {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 1}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
    }
    Json args = Json::object();
    for (const auto& [k, v] : e.args) {
      // Counts and ids read as integers, as the stages' slices have them.
      if (std::nearbyint(v) == v && std::fabs(v) < 9e15) args[k] = static_cast<int64_t>(v);
      else args[k] = v;
    }
    events.push_back({{"name", e.name},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", tid},
                      {"ts", e.start_us},
                      {"dur", std::max<int64_t>(e.end_us - e.start_us, 1)},
                      {"args", std::move(args)}});
  }
  other_trace_.clear();
  return Json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace libpipe::schedule
