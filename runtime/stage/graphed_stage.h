// A GPU stage whose decode steps replay as CUDA graphs (device/cuda_graph.h).
//
// The generation engine marks the calls that may be recorded (GraphableCall): decode steps padded to one of a few
// row counts and context lengths, so that a handful of shapes covers every step. The first such call of a shape runs
// the stage a few times on copies of its inputs (TorchScript's executor specializes for the shape, cuBLAS picks its
// kernels, lazy allocations happen), then records it; later calls of that shape copy their inputs into the
// recorded ones, replay, and copy the outputs out (the next replay overwrites them, while a later stage may still
// be reading them). Every other call, and every call of a shape that could not be recorded (the stage's code waits
// for the GPU somewhere, as a decoder's first stage does when it checks a call), runs the stage as it is.
//
// Running the first call several times is only right for calls that give the same result however often they run:
// a decode step writes the same keys and values to the same cache entries each time, and reads them back.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device/cuda_graph.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

// Marks the calls the calling thread makes to stages while it lives as ones that may be recorded (see above).
class GraphableCall {
 public:
  explicit GraphableCall(bool graphable);
  ~GraphableCall();
  GraphableCall(const GraphableCall&) = delete;
  GraphableCall& operator=(const GraphableCall&) = delete;
  static bool active();

 private:
  bool before_;
};

class GraphedStage final : public Stage {
 public:
  // `graphs` makes the graphs (device::cuda_graph_factory, or a stand-in in tests); `who` names the stage in logs.
  // At most `max_graphs` shapes are recorded; calls of other shapes run unrecorded.
  GraphedStage(std::unique_ptr<Stage> stage, std::function<device::StepGraphFactory()> graphs, std::string who,
               size_t max_graphs = kMaxGraphs);
  c10::IValue forward(std::vector<c10::IValue> inputs) override;

  // Calls replayed from a graph, and shapes recorded (for tests and stats).
  uint64_t replays() const { return replays_; }
  size_t graphs() const { return recorded_; }

  static constexpr size_t kMaxGraphs = 96;
  static constexpr int kWarmups = 3;

 private:
  struct Recording {
    std::unique_ptr<device::StepGraph> graph;  // null: this shape could not be recorded
    std::vector<c10::IValue> inputs;           // what the graph reads, refilled before each replay
    c10::IValue outputs;                       // what it writes
  };
  // The shape of a call: each argument's dtype, device and sizes, or its value; empty when an argument is of a
  // kind no graph takes (lists, objects).
  static std::string shape_of(const std::vector<c10::IValue>& inputs);
  c10::IValue record(Recording& r, std::vector<c10::IValue> inputs);

  std::unique_ptr<Stage> stage_;
  std::function<device::StepGraphFactory()> make_factory_;
  device::StepGraphFactory factory_;
  bool unavailable_ = false;        // the factory could not be made: no call is recorded
  bool told_unrecordable_ = false;  // a shape that could not be recorded was logged at info level
  std::string who_;
  size_t max_graphs_;
  std::map<std::string, Recording> recordings_;
  uint64_t replays_ = 0;
  size_t recorded_ = 0;
};

}  // namespace libpipe::stage
