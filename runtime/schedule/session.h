// Session: one worker thread per stage, each fed by a bounded queue. A call is cut into
// micro-batches; each micro-batch carries the values that cross stage boundaries (an
// "environment" indexed by the plan's crossing values) from worker to worker. Micro-batches of
// concurrent calls interleave freely, so the stages stay busy under load. A stage that throws
// fails only the call that micro-batch belongs to.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <thread>
#include <vector>

#include "runtime/graph/plan.h"
#include "runtime/named_tensor.h"
#include "runtime/schedule/bounded_queue.h"

namespace libpipe::schedule {

struct SessionOptions {
  int64_t num_microbatches = 1;
  int threads_per_stage = 0;  // 0: max(1, cores / stages)
};

class Session {
 public:
  // Builds every stage module and starts the workers. Throws Error on invalid options.
  Session(std::shared_ptr<const graph::Plan> plan, SessionOptions options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Runs one call (forward's arguments in order) and blocks until its outputs are merged.
  // Thread-safe. Throws Error(Input) for bad inputs and Error(Execution) if a stage failed.
  std::vector<NamedTensor> run(const std::vector<c10::IValue>& inputs);

  size_t num_stages() const { return stages_.size(); }
  const torch::jit::Module& stage_module(size_t i) const { return stages_.at(i); }

 private:
  struct Call;
  struct MicroBatch {
    std::shared_ptr<Call> call;
    size_t index = 0;
    std::vector<c10::IValue> env;  // indexed by crossing-value id
  };

  void worker_loop(size_t stage);
  void run_stage(size_t stage, MicroBatch& mb);

  std::shared_ptr<const graph::Plan> plan_;
  SessionOptions options_;
  std::vector<torch::jit::Module> stages_;
  std::vector<std::unique_ptr<BoundedQueue<MicroBatch>>> queues_;
  std::vector<std::thread> workers_;
  int threads_per_stage_ = 1;
};

}  // namespace libpipe::schedule
