#include "runtime/schedule/session.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "runtime/log.h"
#include "runtime/planner.h"
#include "runtime/schedule/assignment.h"
#include "runtime/schedule/worker_host.h"
#include "runtime/stage/stage_module.h"

namespace libpipe::schedule {

// ---- Request ----

void Request::fail(Status status, const std::string& why) {
  std::lock_guard lock(mutex_);
  if (failed_ || remaining_ == 0) return;  // the first failure is the one reported
  failed_ = true;
  status_ = status;
  message_ = why;
  done_.notify_all();
}

void Request::finish_one() {
  std::lock_guard lock(mutex_);
  if (remaining_ > 0 && --remaining_ == 0) done_.notify_all();
}

bool Request::failed() {
  std::lock_guard lock(mutex_);
  return failed_;
}

void Request::cancel() { fail(Status::Cancelled, "the call was cancelled"); }

void Request::drain() {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return remaining_ == 0; });
}

bool Request::wait_until(Clock::time_point until) {
  std::unique_lock lock(mutex_);
  const auto limit = std::min(until, deadline_);
  done_.wait_until(lock, limit, [&] { return finished_locked(); });
  if (finished_locked()) return true;
  if (Clock::now() >= deadline_) {
    failed_ = true;
    status_ = Status::DeadlineExceeded;
    message_ = "the call did not finish before its deadline";
    done_.notify_all();
    return true;
  }
  return false;
}

std::vector<NamedTensor> Request::result(const std::vector<chunk::OutputSpec>& specs) {
  wait_until(Clock::time_point::max());
  std::lock_guard lock(mutex_);
  if (failed_) throw Error(status_, message_);
  if (!merged_) {
    c10::InferenceMode inference;
    outputs_ = chunk::merge_outputs(results_, specs);
    results_.clear();
    merged_ = true;
  }
  return outputs_;
}

// ---- Session ----

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
    throw Error(Status::InvalidArgument, "max_inflight must be 0 (automatic) or positive, got " +
                                             std::to_string(options_.max_inflight));
  const size_t num_inputs = plan_->model().input_names().size();
  if (options_.input_specs.size() > num_inputs)
    throw Error(Status::InvalidArgument, std::to_string(options_.input_specs.size()) +
                                             " input specs given but the model takes " + std::to_string(num_inputs) +
                                             " inputs");
  if (options_.max_inflight == 0)
    options_.max_inflight = std::max<int64_t>(2 * options_.num_microbatches, 4 * static_cast<int64_t>(n));
  threads_per_stage_ = options_.threads_per_stage > 0 ? options_.threads_per_stage : default_threads_per_stage(n);
  total_stages_ = n;

  const auto& dist = options_.distributed;
  if (dist.world_size < 1)
    throw Error(Status::InvalidArgument, "the world size must be at least 1, got " + std::to_string(dist.world_size));
  if (dist.transport == TransportKind::Local && !dist.connected && dist.world_size != 1)
    throw Error(Status::InvalidArgument, "the local transport runs every stage in this process (world size 1); "
                                         "choose the Gloo or NCCL transport to spread stages over " +
                                             std::to_string(dist.world_size) + " processes");
  if (dist.comm_timeout.count() <= 0)
    throw Error(Status::InvalidArgument,
                "the comm timeout must be positive, got " + std::to_string(dist.comm_timeout.count()) + " ms");
  const bool distributed = dist.world_size > 1;
  if (distributed && dist.transport == TransportKind::Nccl) device_ = nccl_device(0);
  const auto ranges = place_stages(n, dist.world_size);
  const size_t local = ranges[0].second;

  auto checkpoint = options_.stage.weights.empty() ? nullptr : stage::Checkpoint::open(options_.stage.weights);
  for (size_t s = 0; s < local; ++s) {
    stages_.push_back(stage::build_stage_module(*plan_, s, device_));
    stage::load_stage_weights(stages_.back(), *plan_, s, options_.stage, checkpoint.get());
    if (!device_.is_cpu()) stages_.back().to(device_);
  }
  for (size_t s = 0; s < n; ++s) stage_io_.push_back(stage_io(*plan_, s));
  if (distributed) {
    group_ = std::make_unique<WorkerGroup>(*plan_, ranges, dist, options_.stage, threads_per_stage_);
    outbound_ = std::make_unique<BoundedQueue<MicroBatch>>(static_cast<size_t>(options_.max_inflight));
  }
  for (size_t s = 0; s < local; ++s) {
    auto w = std::make_unique<Worker>();
    // Admission bounds what is inside the pipeline, so a queue never holds more than that.
    w->queue = std::make_unique<BoundedQueue<MicroBatch>>(static_cast<size_t>(options_.max_inflight));
    workers_.push_back(std::move(w));
  }
  for (size_t s = 0; s < local; ++s) workers_[s]->thread = std::thread([this, s] { worker_loop(s); });
  if (group_) {
    last_progress_ = Clock::now();
    sender_ = std::thread([this] { sender_loop(); });
    receiver_ = std::thread([this] { receiver_loop(); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }
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
  if (group_) stop_ring();
}

void Session::admit(const std::shared_ptr<Request>& request) {
  std::unique_lock lock(admission_mutex_);
  admission_cv_.wait_until(lock, request->deadline(), [&] {
    return stopping_ || inflight_ < options_.max_inflight || request->failed();
  });
  if (stopping_) throw Error(Status::Cancelled, "the session is shutting down");
  if (request->failed()) throw Error(Status::Cancelled, "");  // the request already says why
  if (inflight_ >= options_.max_inflight)
    throw Error(Status::DeadlineExceeded, "the call's deadline passed while it waited for room in the pipeline");
  ++inflight_;
  --promised_;
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
    count = std::clamp<int64_t>(static_cast<int64_t>(total_stages_) - others, 1, requested);
  promised_ += count;
  return count;
}

void Session::worker_loop(size_t s) {
  // Per-thread with OpenMP: this stage's operators use their share of the cores only.
  at::set_num_threads(threads_per_stage_);
  c10::InferenceMode inference;
  Worker& me = *workers_[s];
  const bool last = s + 1 == total_stages_;
  const bool to_ring = !last && s + 1 == stages_.size();
  auto waited_from = Clock::now();
  while (auto item = me.queue->pop()) {
    const auto start = Clock::now();
    me.idle_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(start - waited_from).count();
    MicroBatch mb = std::move(*item);
    const auto& request = mb.request;
    bool ran = false, ok = true;
    if (shutting_down_.load(std::memory_order_relaxed))
      request->fail(Status::Cancelled, "the session was destroyed while the call was running");
    if (Clock::now() >= request->deadline())
      request->fail(Status::DeadlineExceeded, "the call did not finish before its deadline");
    if (!request->failed()) {
      ran = true;
      try {
        run_stage(s, mb);
      } catch (const Error& e) {
        ok = false;
        request->fail(e.status(), e.what());
      } catch (const c10::Error& e) {
        ok = false;
        request->fail(Status::Execution, stage_failure(s, mb.index, e.what_without_backtrace()));
      } catch (const std::exception& e) {
        ok = false;
        request->fail(Status::Execution, stage_failure(s, mb.index, e.what()));
      }
    }
    waited_from = Clock::now();
    if (ran) {
      me.microbatches++;
      if (!ok) me.failures++;
      me.busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(waited_from - start).count();
      if (tracing_.load(std::memory_order_relaxed)) {
        std::lock_guard lock(me.trace_mutex);
        me.trace.push_back({request->id(), mb.index, since_us(epoch_, start), since_us(epoch_, waited_from), ok});
      }
    }
    // Release before finishing: a caller woken by its last micro-batch then finds the pipeline
    // as it is, not one slot fuller (which would make its next call's cut depend on timing).
    if (last || request->failed()) {
      auto r = mb.request;
      mb = MicroBatch{};  // free this micro-batch's tensors before the caller wakes
      release();
      r->finish_one();
      continue;
    }
    auto r = mb.request;
    auto& next = to_ring ? *outbound_ : *workers_[s + 1]->queue;
    if (!next.push(std::move(mb))) {
      r->fail(Status::Cancelled, "the session was destroyed while the call was running");
      release();
      r->finish_one();
    }
  }
}

void Session::run_stage(size_t s, MicroBatch& mb) {
  c10::IValue out = run_stage_step(stages_[s], stage_io_[s], mb.env);
  if (stage_io_[s].last) mb.request->results_[mb.index] = std::move(out);  // each micro-batch owns its slot
}

// ---- the ring through worker processes ----

std::string Session::broken() const {
  std::lock_guard lock(ring_mutex_);
  return broken_;
}

void Session::retire(const std::shared_ptr<Request>& request, Status status, const std::string& why) {
  if (status != Status::Ok) request->fail(status, why);
  release();
  request->finish_one();
}

void Session::sender_loop() {
  while (auto item = outbound_->pop()) {
    MicroBatch mb = std::move(*item);
    auto request = std::move(mb.request);
    std::string why;
    Status status = Status::Ok;
    {
      std::lock_guard lock(ring_mutex_);
      if (!broken_.empty()) {
        status = Status::Communication;
        why = "the session is broken: " + broken_;
      } else if (shutting_down_) {
        status = Status::Cancelled;
        why = "the session was destroyed while the call was running";
      } else if (!request->failed()) {
        if (remote_.empty()) last_progress_ = Clock::now();  // the silence is timed from here
        remote_[{request->id(), mb.index}] = request;
      }
    }
    if (status != Status::Ok || request->failed()) {
      retire(request, status, why);
      continue;
    }
    comm::Message m{comm::Kind::Data, request->id(), mb.index, 0, std::move(mb.env), {}};
    try {
      group_->send(m);
    } catch (const std::exception& e) {
      break_session(e.what());
    }
  }
  // Closed by ~Session once the local stages stopped: tell the workers to finish.
  if (broken().empty()) {
    try {
      group_->send(comm::control(comm::Kind::Shutdown));
    } catch (const std::exception& e) {
      break_session(e.what());
    }
  }
}

void Session::receiver_loop() {
  for (;;) {
    comm::Message m;
    try {
      m = group_->receive();
    } catch (const std::exception& e) {
      break_session(e.what());
      return;
    }
    std::shared_ptr<Request> request;
    {
      std::lock_guard lock(ring_mutex_);
      last_progress_ = Clock::now();
      if (m.kind == comm::Kind::Shutdown) {
        ring_closed_ = true;
        ring_cv_.notify_all();
        return;
      }
      auto it = remote_.find({m.request, static_cast<size_t>(m.microbatch)});
      if (it == remote_.end()) continue;  // already failed when the session broke
      request = std::move(it->second);
      remote_.erase(it);
    }
    if (m.kind == comm::Kind::Result && m.values.size() == 1) {
      request->results_.at(m.microbatch) = std::move(m.values[0]);
      retire(request, Status::Ok, "");
    } else if (m.kind == comm::Kind::Error) {
      retire(request, static_cast<Status>(m.status), m.text);
    } else {
      retire(request, Status::Internal,
             "a worker answered with message kind " + std::to_string(static_cast<int>(m.kind)));
    }
  }
}

void Session::watchdog_loop() {
  const auto timeout = options_.distributed.comm_timeout;
  const auto tick = std::clamp<std::chrono::milliseconds>(timeout / 20, std::chrono::milliseconds(5),
                                                          std::chrono::milliseconds(200));
  std::unique_lock lock(ring_mutex_);
  while (!stop_watchdog_) {
    ring_cv_.wait_for(lock, tick);
    if (stop_watchdog_ || !broken_.empty() || remote_.empty()) continue;
    if (Clock::now() - last_progress_ < timeout) continue;
    const std::string why = "the worker processes held " + std::to_string(remote_.size()) +
                            " micro-batch(es) and sent nothing back for " + std::to_string(timeout.count()) +
                            " ms (the comm timeout): a worker stopped answering";
    lock.unlock();
    break_session(why);
    lock.lock();
  }
}

void Session::break_session(const std::string& why) {
  std::map<std::pair<uint64_t, size_t>, std::shared_ptr<Request>> held;
  {
    std::lock_guard lock(ring_mutex_);
    if (!broken_.empty() || ring_closed_) return;
    broken_ = why;
    held.swap(remote_);
    ring_cv_.notify_all();
  }
  // Info, not error: every call it fails says why, and a caller's one-line error report stays one line.
  log::info("the session is broken: " + why);
  group_->abort(why);
  for (auto& [key, request] : held) retire(request, Status::Communication, why);
}

void Session::stop_ring() {
  // The local stages have stopped: whatever reaches the sender now is dropped, then it sends the
  // Shutdown, which each worker passes on after everything it holds.
  outbound_->close();
  sender_.join();
  {
    std::unique_lock lock(ring_mutex_);
    if (!ring_cv_.wait_for(lock, options_.distributed.comm_timeout,
                           [&] { return ring_closed_ || !broken_.empty(); })) {
      lock.unlock();
      break_session("the workers did not finish within the comm timeout as the session was destroyed");
    }
  }
  group_->abort("the session was destroyed");
  receiver_.join();
  {
    std::lock_guard lock(ring_mutex_);
    stop_watchdog_ = true;
  }
  ring_cv_.notify_all();
  watchdog_.join();
  std::map<std::pair<uint64_t, size_t>, std::shared_ptr<Request>> held;
  {
    std::lock_guard lock(ring_mutex_);
    held.swap(remote_);
  }
  for (auto& [key, request] : held)
    retire(request, Status::Cancelled, "the session was destroyed while the call was running");
  group_.reset();
}

std::shared_ptr<Request> Session::submit(const std::vector<c10::IValue>& inputs, const RunOptions& options) {
  if (group_) {
    const std::string why = broken();
    if (!why.empty())
      throw Error(Status::Communication, "the session is broken (" + why + "); destroy it, restart its workers and create "
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
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].isTensor() && !inputs[i].toTensor().device().is_cpu())
      throw Error(Status::Input, "input '" + names[i] + "' is on " + inputs[i].toTensor().device().str() +
                                     " but this session's first stage runs on the CPU; pass a CPU tensor");
  }

  std::vector<c10::IValue> cast;
  if (options_.stage.dtype || !device_.is_cpu()) {
    // The weights were cast: floating inputs follow, so the first stage sees one dtype; and they
    // go where the first stage runs.
    cast = inputs;
    for (auto& v : cast) {
      if (!v.isTensor()) continue;
      at::Tensor t = v.toTensor().to(device_);
      if (options_.stage.dtype && at::isFloatingType(t.scalar_type())) t = t.to(*options_.stage.dtype);
      v = t;
    }
  }
  // Whatever happens below, the micro-batches promised and not admitted are given back.
  struct Unpromise {
    Session& session;
    int64_t left;
    ~Unpromise() { session.unpromise(left); }
  } promised{*this, promise_microbatches()};
  auto microbatches = chunk::split_inputs(cast.empty() ? inputs : cast, names, promised.left, options_.input_specs);
  auto request = std::make_shared<Request>(next_request_id_++, microbatches.size(), options.deadline);
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
    MicroBatch mb{request, m, std::vector<c10::IValue>(plan_->values().size())};
    for (size_t id = 0; id < plan_->values().size(); ++id) {
      const auto& cv = plan_->values()[id];
      if (cv.producer < 0) mb.env[id] = microbatches[m][cv.input_index];
    }
    if (!workers_[0]->queue->push(std::move(mb))) {
      request->fail(Status::Cancelled, "the session was destroyed while the call was running");
      release();
      for (size_t rest = m; rest < microbatches.size(); ++rest) request->finish_one();
      break;
    }
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
  if (stage >= workers_.size()) return st;  // hosted by a worker process
  const Worker& w = *workers_.at(stage);
  st.microbatches = w.microbatches.load();
  st.failures = w.failures.load();
  st.busy_ms = static_cast<double>(w.busy_ns.load()) / 1e6;
  st.idle_ms = static_cast<double>(w.idle_ns.load()) / 1e6;
  st.queue_depth = w.queue->size();
  return st;
}

void Session::start_trace() {
  for (auto& w : workers_) {
    std::lock_guard lock(w->trace_mutex);
    w->trace.clear();
  }
  tracing_ = true;
}

std::string Session::stop_trace() {
  tracing_ = false;
  using Json = nlohmann::json;
  Json events = Json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "libpipe session"}}}});
  for (size_t s = 0; s < workers_.size(); ++s) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", s},
                      {"args", {{"name", "stage " + std::to_string(s)}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 1}, {"tid", s},
                      {"args", {{"sort_index", s}}}});
    std::lock_guard lock(workers_[s]->trace_mutex);
    for (const auto& e : workers_[s]->trace)
      events.push_back({{"name", "request " + std::to_string(e.request) + " mb " + std::to_string(e.microbatch)},
                        {"cat", e.ok ? "microbatch" : "failed"},
                        {"ph", "X"},
                        {"pid", 1},
                        {"tid", s},
                        {"ts", e.start_us},
                        {"dur", std::max<int64_t>(e.end_us - e.start_us, 1)},
                        {"args", {{"request", e.request}, {"microbatch", e.microbatch}}}});
    workers_[s]->trace.clear();
  }
  return Json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace libpipe::schedule
