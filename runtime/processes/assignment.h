// What the driver tells each worker process: which stages it hosts and how to run them. Sent as
// one Setup message: the description as JSON text, the stage modules as serialized TorchScript
// (values, one uint8 tensor each; without their weights when the worker reads them from a
// checkpoint itself).
#pragma once

#include <ATen/core/ScalarType.h>
#include <c10/core/Device.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm/transport.h"
#include "runtime/schedule/stage_step.h"
#include "runtime/stage/stage.h"

namespace libpipe::processes {

// The stages of each rank, [first, end), in order: contiguous groups as equal in count as
// possible, the larger ones first. Throws Error(InvalidArgument) for fewer stages than ranks.
std::vector<std::pair<size_t, size_t>> place_stages(size_t num_stages, int world_size);

struct WorkerAssignment {
  int world_size = 0;
  size_t num_values = 0;                    // size of a micro-batch's environment
  std::vector<schedule::StageIO> stages;    // this rank's, in order
  std::vector<c10::Device> devices;         // where each of them runs (on the worker's machine)
  std::vector<std::string> modules;         // serialized stage modules, one per stage
  std::vector<stage::AliasGroups> aliases;  // tied-weight names per stage (checkpoint lookups)
  int threads_per_stage = 1;
  std::string weights;  // checkpoint each worker reads; empty: inside the modules
  std::optional<at::ScalarType> dtype;
  stage::WeightQuantization quantize = stage::WeightQuantization::None;
  int64_t quantize_group = 0;                              // int4: inputs per scale (0: the default)
  std::optional<stage::WeightQuantization> quantize_head;  // nullopt: the default (stage::head_quantization)
  stage::WeightQuantization quantize_embedding = stage::WeightQuantization::None;  // None or Int8
  // How often the worker sends its heartbeat: set from the driver's comm timeout, which judges it.
  std::chrono::milliseconds heartbeat_interval{1000};
};

comm::Message encode_assignment(const WorkerAssignment& assignment);
// Throws Error(Communication) for a message that is not an assignment from this libpipe version.
WorkerAssignment decode_assignment(const comm::Message& message);

}  // namespace libpipe::processes
