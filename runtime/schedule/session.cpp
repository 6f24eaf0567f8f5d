#include "runtime/schedule/session.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "runtime/chunk/microbatch.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/planner.h"
#include "runtime/stage/stage_module.h"

namespace libpipe::schedule {

// The state of one run() call shared by its micro-batches.
struct Session::Call {
  explicit Call(size_t n) : remaining(n), results(n) {}

  void fail(Status s, const std::string& why) {
    std::lock_guard lock(mutex);
    if (failed) return;  // the first failure is the one reported
    failed = true;
    status = s;
    message = why;
  }
  bool has_failed() {
    std::lock_guard lock(mutex);
    return failed;
  }
  void finish_one() {
    std::lock_guard lock(mutex);
    if (--remaining == 0) done.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    done.wait(lock, [&] { return remaining == 0; });
  }

  std::mutex mutex;
  std::condition_variable done;
  size_t remaining;
  std::vector<c10::IValue> results;  // one per micro-batch, written by the last stage
  bool failed = false;
  Status status = Status::Ok;
  std::string message;
};

namespace {

// A stage's error as one line. Errors raised inside TorchScript carry the interpreter's
// traceback, many lines long, whose last line is the error itself ("RuntimeError: mat1 and mat2
// shapes cannot be multiplied ..."); that line is the message, and the whole text is logged at
// debug level for whoever needs the traceback.
std::string stage_failure(size_t stage, size_t microbatch, const std::string& what) {
  const std::string prefix =
      "stage " + std::to_string(stage) + " failed on micro-batch " + std::to_string(microbatch) + ": ";
  std::string last;
  size_t begin = 0;
  while (begin < what.size()) {
    size_t end = what.find('\n', begin);
    if (end == std::string::npos) end = what.size();
    if (what.find_first_not_of(" \t\r", begin) < end) last = what.substr(begin, end - begin);
    begin = end + 1;
  }
  if (last.size() != what.size()) log::debug(prefix + what);
  return prefix + last.substr(std::min(last.find_first_not_of(' '), last.size()));
}

}  // namespace

Session::Session(std::shared_ptr<const graph::Plan> plan, SessionOptions options)
    : plan_(std::move(plan)), options_(options) {
  if (options_.num_microbatches < 1)
    throw Error(Status::InvalidArgument, "num_microbatches must be at least 1, got " +
                                             std::to_string(options_.num_microbatches));
  if (options_.threads_per_stage < 0)
    throw Error(Status::InvalidArgument, "threads_per_stage must be 0 (automatic) or positive, got " +
                                             std::to_string(options_.threads_per_stage));
  const size_t n = plan_->num_stages();
  threads_per_stage_ =
      options_.threads_per_stage > 0 ? options_.threads_per_stage : default_threads_per_stage(n);

  for (size_t s = 0; s < n; ++s) stages_.push_back(stage::build_stage_module(*plan_, s));
  // Room for every micro-batch of a couple of calls per stage; a full queue makes callers wait.
  const size_t capacity = static_cast<size_t>(2 * options_.num_microbatches);
  for (size_t s = 0; s < n; ++s) queues_.push_back(std::make_unique<BoundedQueue<MicroBatch>>(capacity));
  for (size_t s = 0; s < n; ++s) workers_.emplace_back([this, s] { worker_loop(s); });
}

Session::~Session() {
  for (auto& q : queues_) q->close();
  for (auto& w : workers_) w.join();
}

void Session::worker_loop(size_t s) {
  // Per-thread with OpenMP: this stage's operators use their share of the cores only.
  at::set_num_threads(threads_per_stage_);
  c10::InferenceMode inference;
  const bool last = s + 1 == stages_.size();
  while (auto item = queues_[s]->pop()) {
    MicroBatch mb = std::move(*item);
    if (!mb.call->has_failed()) {
      try {
        run_stage(s, mb);
      } catch (const Error& e) {
        mb.call->fail(e.status(), e.what());
      } catch (const c10::Error& e) {
        mb.call->fail(Status::Execution, stage_failure(s, mb.index, e.what_without_backtrace()));
      } catch (const std::exception& e) {
        mb.call->fail(Status::Execution, stage_failure(s, mb.index, e.what()));
      }
    }
    if (last || mb.call->has_failed()) {
      mb.call->finish_one();
      continue;
    }
    auto call = mb.call;
    if (!queues_[s + 1]->push(std::move(mb))) {
      call->fail(Status::Execution, "the session was destroyed while the call was running");
      call->finish_one();
    }
  }
}

void Session::run_stage(size_t s, MicroBatch& mb) {
  const graph::StagePlan& sp = plan_->stage(s);
  std::vector<c10::IValue> args;
  args.reserve(sp.inputs.size());
  for (size_t id : sp.inputs) args.push_back(mb.env[id]);
  c10::IValue out = stages_[s].forward(std::move(args));

  if (s + 1 == stages_.size()) {
    mb.call->results[mb.index] = std::move(out);  // each micro-batch owns its own slot
    return;
  }
  const auto& items = out.toTupleRef().elements();
  for (size_t k = 0; k < sp.outputs.size(); ++k) mb.env[sp.outputs[k]] = items[k];
  // Drop what no later stage reads, so memory follows the pipeline rather than the call.
  for (size_t id = 0; id < plan_->values().size(); ++id)
    if (plan_->values()[id].last_consumer() <= static_cast<int>(s)) mb.env[id] = c10::IValue();
}

std::vector<NamedTensor> Session::run(const std::vector<c10::IValue>& inputs) {
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
      throw Error(Status::Input, "input '" + names[i] + "' is on " +
                                     inputs[i].toTensor().device().str() +
                                     " but this session's first stage runs on the CPU; pass a CPU tensor");
  }

  auto microbatches = chunk::split_inputs(inputs, names, options_.num_microbatches);
  auto call = std::make_shared<Call>(microbatches.size());
  for (size_t m = 0; m < microbatches.size(); ++m) {
    MicroBatch mb{call, m, std::vector<c10::IValue>(plan_->values().size())};
    for (size_t id = 0; id < plan_->values().size(); ++id) {
      const auto& cv = plan_->values()[id];
      if (cv.producer < 0) mb.env[id] = microbatches[m][cv.input_index];
    }
    if (!queues_[0]->push(std::move(mb))) {
      call->fail(Status::Execution, "the session was destroyed while the call was running");
      call->finish_one();
    }
  }
  call->wait();
  if (call->failed) throw Error(call->status, call->message);

  c10::InferenceMode inference;
  return chunk::merge_outputs(call->results);
}

}  // namespace libpipe::schedule
