// A first stage cut before its first layer, so that a GPU can replay its layers as CUDA graphs.
//
// A decoder's first stage begins with the call's checks and the packing of its tokens (libpipe.decoders' check_call
// and pack_call): they read values on the host (is any length out of range, how many tokens are valid), which waits
// for the GPU, and a CUDA graph cannot record that. Everything from the first layer on reads only tensors. So the
// stage runs as two: the preamble, as it is, then the layers (and, in a one-stage pipeline, the head), which a
// GraphedStage may record. Both parts are cut from the same plan with one more cut at the first layer's start
// (graph::segment's layers), and the stage's inputs and outputs stay those of the plan's first stage.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "runtime/stage/stage.h"

namespace libpipe::stage {

class PreambleSplitStage final : public Stage {
 public:
  // Builds plan stage 0 as a preamble and a body (`wrap_body` may wrap the body, as in a GraphedStage). Returns null
  // when stage 0 has no layer start after its first node (nothing to cut off), or the cut cannot be made.
  static std::unique_ptr<Stage> build(const graph::Plan& plan, const BuildOptions& build,
                                      const std::function<std::unique_ptr<Stage>(std::unique_ptr<Stage>)>& wrap_body);

  c10::IValue forward(std::vector<c10::IValue> inputs) override;

 private:
  // Where each part's arguments come from, and where stage 0's results come from: an index into the values of one
  // call (stage 0's inputs, then the preamble's results, then the body's).
  std::unique_ptr<Stage> preamble_, body_;
  std::vector<size_t> preamble_args_, body_args_, results_;
  size_t preamble_outputs_ = 0, body_outputs_ = 0;
  bool last_ = false;  // plan stage 0 is the last: the body's result is the model's
};

}  // namespace libpipe::stage
