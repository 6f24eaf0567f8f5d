// Weights into a TorchScript stage module: from the model, or from a checkpoint (checkpoint.h), cast
// and placed, its in-place state (KV caches) made its own.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include "runtime/graph/plan.h"
#include "runtime/stage/checkpoint.h"
#include "runtime/stage/stage.h"

namespace libpipe::stage {

// Replaces the stage module's parameters and buffers with the checkpoint's (when `options.weights`
// is set), casts floating ones to `options.dtype` (when set), places them on `device`, and fails
// if any tensor of the stage is still on the meta device. A tensor the checkpoint lacks keeps the
// model's data (Hugging Face checkpoints omit non-persistent buffers). A tensor that the stage's
// forward updates in place (graph::in_place_writes: a KV cache) becomes the stage's own: a
// placeholder the checkpoint lacks (an expanded tensor, fewer elements stored than it covers, as
// torch.zeros((), dtype).expand(shape)) becomes a fresh contiguous tensor of its value, allocated
// on `device` in the stage's dtype; the model's data is copied. So sessions (and processes) made
// from one model never share state, and a skeleton need not store its caches. A GPU gets only this
// stage's tensors, straight from the (mapped) file through pinned memory, cast there; tensors
// tied within the stage stay one tensor. Throws Error naming the tensor and the stage: NotFound
// for a tensor that is neither in the checkpoint nor held with data by the model, or a missing
// shard, Input for a shape or dtype mismatch, InvalidFormat for a corrupt shard.
void load_stage_weights(torch::jit::Module& stage, const graph::Plan& plan, size_t stage_index,
                        const StageOptions& options, Checkpoint* checkpoint,
                        const c10::Device& device = c10::Device(c10::kCPU));

// Every parameter or buffer name -> the other names of the same tensor in `model` (tied weights).
AliasGroups alias_groups(const torch::jit::Module& model);

// Replaces every parameter and buffer that `checkpoint` holds (by name or through `aliases`, as
// load_stage_weights resolves it) with a placeholder of the same shape and dtype that holds one
// element, so the stage serializes small; load_stage_weights with the checkpoint fills it. A
// tensor the checkpoint lacks is left as it is (a placeholder cache travels as its few bytes and
// load_stage_weights materializes it on the receiver).
void strip_stage_weights(torch::jit::Module& stage, const Checkpoint& checkpoint, const AliasGroups& aliases);

// As above, for a stage without its plan (a worker process receives the aliases with the stage).
void load_stage_weights(torch::jit::Module& stage, const AliasGroups& aliases, size_t stage_index,
                        const StageOptions& options, Checkpoint* checkpoint,
                        const c10::Device& device = c10::Device(c10::kCPU));

}  // namespace libpipe::stage
