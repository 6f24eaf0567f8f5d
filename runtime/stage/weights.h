// Stage weights from safetensors checkpoints: one file, or shards listed by a Hugging Face style
// index (`*.safetensors.index.json`, "weight_map": tensor name -> shard file). Each stage reads
// only the tensors it holds, memory-mapped: a tensor whose dtype is kept is a view of the mapped
// file (no copy; its pages become resident as the stage touches them), one cast to another dtype
// is read once into new memory. So no process ever materialises the whole model.
#pragma once

#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/graph/plan.h"

namespace libpipe::stage {

struct StageOptions {
  std::string weights;                  // checkpoint file or index; empty: keep the model's tensors
  std::optional<at::ScalarType> dtype;  // cast floating parameters and buffers (and inputs) to this
  // Called as each tensor is loaded: (stage, bytes loaded so far, bytes the stage needs).
  std::function<void(size_t, uint64_t, uint64_t)> progress;
};

// The weight map of a *.index.json (tensor name -> shard file, relative to the index's folder).
// Throws Error(InvalidFormat) naming `path` for invalid JSON, a missing "weight_map" object, a
// non-string entry or a shard path that leaves the index's folder.
std::map<std::string, std::string> parse_checkpoint_index(const std::string& text, const std::string& path);

class Checkpoint {
 public:
  // Opens a .safetensors file or a *.index.json. Throws Error(NotFound) for a missing file,
  // Error(InvalidFormat) for a malformed index. Shards are opened when first needed.
  static std::shared_ptr<Checkpoint> open(const std::string& path);

  // The checkpoint's name for `name` (a stage's parameter or buffer), trying in order: the name
  // itself, any of `aliases` (names sharing the tensor in the model, e.g. a tied lm_head.weight
  // stored once as the embedding), and each with a leading prefix ("model.", "transformer.")
  // added or removed. Empty if none is there.
  std::string resolve(const std::string& name, const std::vector<std::string>& aliases) const;

  // The tensor `key` (a resolved name), a view of the mapped shard. Throws Error(NotFound) if
  // its shard file is missing, Error(InvalidFormat) if the shard is malformed.
  at::Tensor load(const std::string& key);
  uint64_t bytes(const std::string& key);

  const std::string& path() const { return path_; }

 private:
  struct Shard;
  Shard& shard(const std::string& file);

  std::string path_;
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file (relative to dir_)
  std::vector<std::string> prefixes_;              // first components of the checkpoint's names
  std::map<std::string, std::shared_ptr<Shard>> shards_;
};

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
using AliasGroups = std::map<std::string, std::vector<std::string>>;
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
