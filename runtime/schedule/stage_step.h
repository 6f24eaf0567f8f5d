// One stage's step on one micro-batch, shared by the session's stage threads and by worker
// processes: read the stage's inputs from the micro-batch's environment of crossing values, run
// the stage, write its outputs back and drop what no later stage reads.
#pragma once

#include <string>
#include <vector>

#include "runtime/device/place.h"
#include "runtime/error.h"
#include "runtime/graph/plan.h"
#include "runtime/stage/stage.h"

namespace libpipe::schedule {

struct StageIO {
  size_t index = 0;
  std::vector<size_t> inputs;      // crossing-value ids: the stage's forward arguments
  std::vector<size_t> outputs;     // crossing-value ids it defines (not for the last stage)
  std::vector<size_t> dead_after;  // ids no stage after this one reads
  std::vector<int> producers;      // stages that define its inputs, once each (-1: the caller)
  bool last = false;               // returns the model's own result
};

StageIO stage_io(const graph::Plan& plan, size_t stage);

// Runs the stage on `env` (indexed by crossing-value id) at `place`: its inputs are brought there
// after the GPU work in `ready`, and its code runs on the place's stream. The last stage's result
// is returned; other stages update `env` and return None. Nothing waits for the GPU here: mark()
// the place afterwards for the readers of the results.
c10::IValue run_stage_step(stage::Stage& stage, const StageIO& io, std::vector<c10::IValue>& env, device::Place& place,
                           const device::Ready& ready);

// A stage's error as one line, for the caller: "stage S failed on micro-batch M: <error>".
// TorchScript errors carry the interpreter's traceback, nativert's the failing node, its arguments, a
// C++ backtrace and the Python stack the node came from; the error itself is kept, and
// the whole text is logged at debug level.
std::string stage_failure(size_t stage, size_t microbatch, const std::string& what);

// A stage's exception as the status and message its call fails with: libpipe's own Error keeps
// its status; running out of memory on the stage's device is Status::OutOfMemory (the
// TorchScript interpreter rethrows LibTorch's OutOfMemoryError as a plain error, so it is known
// by its message); anything else is Status::Execution.
struct StageError {
  Status status;
  std::string message;
};
StageError stage_error(size_t stage, size_t microbatch, const std::exception& e);

}  // namespace libpipe::schedule
