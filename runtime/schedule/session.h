// Session: one worker thread per stage, each fed by a bounded queue (more CPU stages than cores share one
// thread per core instead: runtime/schedule/stage_sharing.h). A call is cut into
// micro-batches; each micro-batch carries the values that cross stage boundaries (an
// "environment" indexed by the plan's crossing values) from worker to worker. Micro-batches of
// concurrent calls interleave freely, so the stages stay busy under load and there is no
// fill-and-drain bubble per call. A stage that throws fails only the call that micro-batch
// belongs to. Admission is bounded: at most `max_inflight` micro-batches are inside the
// pipeline at once, and submitting more waits (backpressure instead of unbounded memory).
// Under concurrent load, calls are cut more coarsely (SessionOptions::adaptive_microbatches).
// With worker processes (SessionOptions::distributed), this process runs the first stages; a
// micro-batch that leaves them goes around a ring through the workers and comes back as a
// result, and a watchdog breaks the session when the workers hold work but stay silent.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/chunk/microbatch.h"
#include "runtime/device/cuda_graph.h"
#include "runtime/device/place.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/named_tensor.h"
#include "runtime/schedule/bounded_queue.h"
#include "runtime/schedule/deadline_timer.h"
#include "runtime/schedule/request.h"
#include "runtime/processes/ring.h"
#include "runtime/schedule/stage_step.h"
#include "runtime/processes/worker_group.h"
#include "runtime/stage/spare_cores.h"
#include "runtime/stage/stage.h"

namespace libpipe::schedule {

struct SessionOptions {
  int64_t num_microbatches = 1;
  int threads_per_stage = 0;  // 0: the stage's share of the cores
  // Worker threads of the local stages (stage_sharing.h). 0: one per stage, or one per core when all stages are CPU
  // stages of this process, more than the cores, with threads_per_stage 0 (LIBPIPE_STAGE_SHARING=0: one per stage).
  // Fewer than the stages needs CPU stages in this process only.
  int stage_workers = 0;
  int64_t max_inflight = 0;  // micro-batches inside the pipeline at once; 0: max(2·M, 4·stages)
  // Adaptive: a call that arrives while others are in flight is cut into only as many
  // micro-batches as it takes to bring the pipeline to one per stage (at least 1, at most M);
  // a call that finds the pipeline empty gets all M. Once other calls keep the stages busy,
  // finer cuts only cost efficiency (smaller GEMMs, weights streamed once per micro-batch).
  // Fixed: every call gets M, e.g. to bound the activation memory of one micro-batch.
  bool adaptive_microbatches = true;
  std::vector<chunk::InputSpec> input_specs;    // by forward argument; missing: default
  std::vector<chunk::OutputSpec> output_specs;  // by flattened output; missing: concat along 0
  stage::StageOptions stage;                    // weights and dtype of every stage
  // Where each stage runs (device::stage_devices): "" every stage on the CPU, "auto", one device
  // for all, or one per stage ("cpu,cuda:0"). With the NCCL transport it stays empty: each
  // process's stages run on its own GPU.
  std::string devices;
  // Results stay on the last stage's device (a GPU) instead of coming to the CPU.
  bool outputs_on_device = false;
  // A generation engine's session: its GPU stages may record the engine's decode steps as CUDA graphs and replay
  // them (stage/graphed_stage.h; LIBPIPE_CUDA_GRAPHS=0 turns that off), the first one with its preamble cut off
  // (stage/preamble_split.h).
  bool graph_steps = false;
  // How those stages make their graphs: null for device::cuda_graph_factory. Tests give a stand-in and set
  // graph_cpu_stages to run the whole path (the preamble cut, recording, replays) on CPU stages.
  std::function<device::StepGraphFactory(const c10::Device&)> graph_factory;
  bool graph_cpu_stages = false;
  // Stages spread over worker processes (rank 0, this process, keeps the first ones).
  processes::DistributedOptions distributed;
};

struct RunOptions {
  Clock::time_point deadline = Clock::time_point::max();  // the call fails once it is past
};

struct StageStats {
  uint64_t microbatches = 0;  // run by this stage (failed ones included)
  double busy_ms = 0;         // running the stage's code
  double idle_ms = 0;         // its worker thread waiting for work (0 for a stage that workers share)
  uint64_t queue_depth = 0;   // micro-batches waiting now for its worker
  uint64_t failures = 0;      // micro-batches whose stage code raised
};

class Session {
 public:
  // Builds every stage module and starts the workers. Throws Error on invalid options.
  Session(std::shared_ptr<const graph::Plan> plan, SessionOptions options);
  // Fails every call still in flight (Status::Cancelled) and stops the workers.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Starts one call (forward's arguments in order) and returns at once, or after waiting for
  // room when max_inflight micro-batches are already admitted. The call reads `inputs` until it
  // is drained: copy them first if they may change or be freed sooner. Thread-safe. Throws
  // Error(Input) for inputs that cannot be cut into micro-batches.
  std::shared_ptr<Request> submit(const std::vector<c10::IValue>& inputs, const RunOptions& options = {});
  // submit() and wait for the merged outputs; a failed call returns (throws) only once it is
  // drained, so the caller's inputs are free to go when run() returns. Thread-safe.
  std::vector<NamedTensor> run(const std::vector<c10::IValue>& inputs, const RunOptions& options = {});
  // One step of a generation engine (runtime/generate): `inputs` are moved in, not copied, cut, cast or checked
  // (the engine makes them right), and run as one micro-batch; Request::take_single() gives the last stage's
  // result as it is. Never waits for admission: the caller keeps fewer than max_inflight steps in flight, and
  // learns that one finished from Request::on_done. Thread-safe. Throws Error(Communication) on a broken session.
  // `graphable`: a decode step that this process's GPU stages may record and replay as a CUDA graph
  // (stage/graphed_stage.h; the engine pads such steps to a few shapes, and each runs alike however often it runs).
  std::shared_ptr<Request> submit_step(std::vector<c10::IValue>&& inputs, bool graphable = false);
  // How many steps the engine means to keep in flight now (its in-flight policy's limit, or 1 where only one can be:
  // one sequence decoding): a step alone in the pipeline runs on one thread (run_alone_) only while that is 1, so
  // that a pipelined engine's step that is alone for a moment (the next one not launched yet) does not take the
  // next stage's turn and stall the one behind it. 1 until an engine says otherwise. Thread-safe.
  void expect_steps_in_flight(int64_t steps) { expected_steps_.store(steps, std::memory_order_relaxed); }

  size_t num_stages() const { return total_stages_; }
  // Stages that can compute at the same time: every stage, unless this process shares its stages among fewer
  // worker threads (stage_sharing.h). A generation engine keeps as many steps in flight.
  size_t concurrent_stages() const { return total_stages_ - stages_.size() + workers_.size(); }
  // The device of every stage, those in worker processes included.
  const std::vector<c10::Device>& devices() const { return devices_; }
  const SessionOptions& options() const { return options_; }
  // Stages hosted by other processes report zeros here.
  StageStats stats(size_t stage) const;
  // Empty while the session works; why it broke once a transport failure broke it (every later
  // call then fails with Status::Communication).
  std::string broken() const;

  // Chrome trace ("Trace Event Format") of the micro-batches run between the two calls, one
  // track per stage; viewable in Perfetto or chrome://tracing. With `operators`, each slice also
  // holds the time its stage spent in each operator (runtime/schedule/op_timer.h), which costs
  // about a microsecond per operator while the trace runs.
  void start_trace(bool operators = false);
  std::string stop_trace();
  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }
  // A slice on a track of the caller's (a generation engine's steps, say) in the trace being
  // recorded; nothing while none is. Thread-safe.
  using TraceArgs = std::vector<std::pair<std::string, double>>;
  // The cores the session's CPU stages lend each other (stage/spare_cores.h), or null. A thread that
  // computes for the pipeline outside the stages (the generation engine sampling) marks itself
  // busy there, so that no stage borrows its core meanwhile.
  stage::SpareCores* spare_cores() { return spare_cores_.get(); }

  void trace_event(const std::string& track, std::string name, Clock::time_point start, Clock::time_point end,
                   TraceArgs args = {});

 private:
  struct TraceEvent {
    size_t worker;
    uint64_t request;
    size_t microbatch;
    int64_t start_us, end_us;
    bool ok;
    TraceArgs operators_us;  // with operator timing only
  };
  struct OtherTraceEvent {
    std::string track, name;
    int64_t start_us, end_us;
    TraceArgs args;
  };
  // Per local stage, whichever worker runs it.
  struct StageCounters {
    std::atomic<uint64_t> microbatches{0}, failures{0};
    std::atomic<int64_t> busy_ns{0};
    std::mutex trace_mutex;
    std::vector<TraceEvent> trace;
  };
  // Per worker thread: one per local stage, or one per core when stages are shared (stage_sharing.h).
  struct Worker {
    std::unique_ptr<BoundedQueue<MicroBatch>> queue;
    std::thread thread;
    std::atomic<int64_t> idle_ns{0};
  };

  void worker_loop(size_t worker);
  // Runs stage s on the micro-batch on worker w's thread (or passes over it: a failed call), with its statistics.
  void run_counted(size_t worker, size_t stage, MicroBatch& mb, stage::SpareCores* spare);
  void run_stage(size_t stage, MicroBatch& mb);
  // Whether the worker done with stage next-1 of a micro-batch runs stage `next` itself because the micro-batch is
  // alone in the pipeline (run_alone_).
  bool runs_alone(size_t next);
  // Hands a micro-batch to worker w's queue; false once the session stops.
  bool hand_to(size_t worker, MicroBatch&& mb);
  // Finishes one micro-batch of `request` that left the pipeline (status Ok: it did not fail).
  void retire(const std::shared_ptr<Request>& request, Status status, const std::string& why);
  void admit(const std::shared_ptr<Request>& request);  // waits for a slot; false if refused
  void release();                                       // a micro-batch left the pipeline
  // How many micro-batches the next call gets; they are promised (counted as in flight for
  // the calls that follow) until admit() takes them or unpromise() gives back the rest.
  int64_t promise_microbatches();
  void unpromise(int64_t count);

  std::shared_ptr<const graph::Plan> plan_;
  SessionOptions options_;
  size_t total_stages_ = 0;
  std::vector<std::unique_ptr<stage::Stage>> stages_;  // the stages this process hosts: the first ones
  std::vector<StageIO> stage_io_;
  std::vector<c10::Device> devices_;                      // every stage's
  std::vector<device::Place> places_;                     // the local stages', each used by its worker thread only
  std::unique_ptr<stage::SpareCores> spare_cores_;        // before workers_: it outlives their threads
  std::vector<std::unique_ptr<StageCounters>> counters_;  // per local stage
  std::unique_ptr<StageSharing> sharing_;                 // which worker runs which local stage
  // A micro-batch alone in the pipeline (nothing else admitted or promised) runs every later stage on the worker that
  // ran its first: all its stages on one thread, the other cores lent to it (stage/spare_cores.h), instead of the
  // stages' threads taking turns. Why: one sequence's decode step, which is one micro-batch, ran 12-16% faster so on
  // 2 cores (SmolLM2 in 2 stages, bf16; bench/RESULTS.md). Only where every stage is a CPU stage of this process with
  // a pool of spare cores, stages are not shared, and LIBPIPE_RUN_ALONE is not 0; and while the engine, if any,
  // means to keep one step in flight (expected_steps_).
  bool run_alone_ = false;
  std::atomic<int64_t> expected_steps_{1};
  std::vector<std::unique_ptr<Worker>> workers_;
  int threads_per_stage_ = 1;
  const Clock::time_point epoch_ = Clock::now();

  std::mutex admission_mutex_;
  std::condition_variable admission_cv_;
  int64_t inflight_ = 0;
  int64_t promised_ = 0;  // cut but not yet admitted: calls arriving together see each other
  bool stopping_ = false;
  std::atomic<bool> shutting_down_{false};  // workers drop what they pop
  std::atomic<uint64_t> next_request_id_{1};
  std::atomic<bool> tracing_{false};
  std::atomic<bool> trace_operators_{false};
  std::mutex other_trace_mutex_;
  std::vector<OtherTraceEvent> other_trace_;

  std::unique_ptr<processes::Ring> ring_;  // only with worker processes

  std::mutex timer_mutex_;
  std::unique_ptr<DeadlineTimer> timer_;  // from the first call with a deadline on
};

}  // namespace libpipe::schedule
