// Stage weights from safetensors checkpoints: one file, or shards listed by a Hugging Face style
// index (`*.safetensors.index.json`, "weight_map": tensor name -> shard file). Each stage reads
// only the tensors it holds, memory-mapped: a tensor whose dtype is kept is a view of the mapped
// file (no copy; its pages become resident as the stage touches them), one cast to another dtype
// is read once into new memory. So no process ever materialises the whole model. Each format's
// stage builder (stage/torchscript/weights.h, stage/exported/) puts the tensors in its stages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace libpipe::stage {

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

// A tensor's name -> the other names of the same tensor in the whole model (tied weights), so that a
// stage finds a tied tensor in a checkpoint that stores it under another name.
using AliasGroups = std::map<std::string, std::vector<std::string>>;

}  // namespace libpipe::stage
