#include "runtime/schedule/stage_step.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "runtime/log.h"

namespace libpipe::schedule {

StageIO stage_io(const graph::Plan& plan, size_t s) {
  const graph::StagePlan& sp = plan.stage(s);
  StageIO io;
  io.index = s;
  io.inputs = sp.inputs;
  io.outputs = sp.outputs;
  io.last = s + 1 == plan.num_stages();
  for (size_t id = 0; id < plan.values().size(); ++id)
    if (plan.values()[id].last_consumer() <= static_cast<int>(s)) io.dead_after.push_back(id);
  for (size_t id : io.inputs) {
    const int producer = plan.values()[id].producer;
    if (std::find(io.producers.begin(), io.producers.end(), producer) == io.producers.end())
      io.producers.push_back(producer);
  }
  return io;
}

c10::IValue run_stage_step(stage::Stage& stage, const StageIO& io, std::vector<c10::IValue>& env, device::Place& place,
                           const device::Ready& ready) {
  std::vector<c10::IValue> args;
  args.reserve(io.inputs.size());
  for (size_t id : io.inputs) args.push_back(env.at(id));
  place.receive(args, ready);
  c10::IValue out;
  {
    auto on_stream = place.activate();
    out = stage.forward(std::move(args));
  }
  if (io.last) return out;
  const auto& items = out.toTupleRef().elements();
  for (size_t k = 0; k < io.outputs.size(); ++k) env.at(io.outputs[k]) = items[k];
  // Drop what no later stage reads, so memory follows the pipeline rather than the call.
  for (size_t id : io.dead_after) env[id] = c10::IValue();
  return c10::IValue();
}

std::string stage_failure(size_t stage, size_t microbatch, const std::string& what) {
  const std::string prefix =
      "stage " + std::to_string(stage) + " failed on micro-batch " + std::to_string(microbatch) + ": ";
  // nativert's errors quote the failing node and its arguments, then the kernel's error, then
  // where c10 raised it (with a C++ backtrace) and the Python stack the node was exported from:
  // the error is the last line before those.
  size_t stop = what.size();
  for (const char* tail : {"\nException raised from ", "\nOriginal Python stacktrace:"})
    stop = std::min(stop, what.find(tail));
  std::string last;
  size_t begin = 0;
  while (begin < stop) {
    size_t end = what.find('\n', begin);
    if (end == std::string::npos || end > stop) end = stop;
    if (what.find_first_not_of(" \t\r", begin) < end) last = what.substr(begin, end - begin);
    begin = end + 1;
  }
  if (last.size() != what.size()) log::debug(prefix + what);
  return prefix + last.substr(std::min(last.find_first_not_of(' '), last.size()));
}

StageError stage_error(size_t stage, size_t microbatch, const std::exception& e) {
  if (const auto* own = dynamic_cast<const Error*>(&e)) return {own->status(), own->what()};
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10_error ? c10_error->what_without_backtrace() : e.what();
  const bool out_of_memory =
      dynamic_cast<const c10::OutOfMemoryError*>(&e) || what.find("out of memory") != std::string::npos ||
      what.find("OutOfMemoryError") != std::string::npos || what.find("can't allocate memory") != std::string::npos;
  return {out_of_memory ? Status::OutOfMemory : Status::Execution, stage_failure(stage, microbatch, what)};
}

}  // namespace libpipe::schedule
