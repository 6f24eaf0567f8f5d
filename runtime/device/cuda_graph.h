// CUDA graphs for a GPU stage's steps: the kernels one step queues, recorded once and queued again with one call.
//
// A decode step of a small model is hundreds of short kernels, and on a fast GPU the host's time to launch them
// (and TorchScript's to interpret the graph that launches them) is longer than the kernels' own: replaying a
// recorded graph takes that off every step. LibTorch's CUDA graphs live in libtorch_cuda, which libpipe loads only
// when a GPU is used; they are reached through libpipe_cuda_graph.so (cuda_graph_plugin.cpp), loaded here on first
// use. Recording runs nothing: a replay does.
#pragma once

#include <c10/core/Device.h>

#include <array>
#include <functional>
#include <memory>
#include <string>

namespace libpipe::device {

// One recorded step.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  // Records what `work` queues on the calling thread's current stream (a GPU stage's own, never the default
  // stream), without running it. Throws Error(Execution) when the work cannot be recorded (it waits for the GPU,
  // or copies to the host): the stream is left as it was, and the work must then run unrecorded.
  virtual void capture(const std::function<void()>& work) = 0;
  // Queues the recorded work again on the calling thread's current stream. Throws Error(Execution).
  virtual void replay() = 0;
};

// Makes graphs that share one memory pool: the graphs of one stage, which replay one at a time on its stream.
using StepGraphFactory = std::function<std::unique_ptr<StepGraph>()>;

// Graphs on CUDA device `device`, sharing one pool. Throws Error(Unsupported) saying why when they cannot be made
// here (no libpipe_cuda_graph.so beside libpipe, or no CUDA).
StepGraphFactory cuda_graph_factory(const c10::Device& device);

// Whether GPU stages record decode steps as graphs: true unless LIBPIPE_CUDA_GRAPHS=0 (for comparisons).
bool cuda_graphs_enabled();

}  // namespace libpipe::device
