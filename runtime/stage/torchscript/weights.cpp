#include "runtime/stage/torchscript/weights.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>

#include <optional>
#include <set>

#include "runtime/device/upload.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"

namespace libpipe::stage {

namespace {

// A tensor that covers more elements than its storage holds: an expanded one
// (torch.zeros((), dtype).expand(shape)), which a skeleton stores as a few bytes.
bool is_placeholder(const at::Tensor& t) {
  if (t.numel() < 2) return false;
  const auto storage_elems = t.storage().nbytes() / t.element_size();
  return storage_elems < static_cast<size_t>(t.numel());
}

// A fresh contiguous tensor of `t`'s shape and value, in `dtype` on `device`, allocated there
// without ever making the full tensor on the host: one fill when every element is one value.
at::Tensor materialize(const at::Tensor& t, at::ScalarType dtype, const c10::Device& device,
                       device::Uploader* uploader) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  std::optional<c10::StreamGuard> guard;  // on a GPU, on the uploads' stream: finish() waits for it
  if (uploader) guard.emplace(uploader->stream());
  bool uniform = true;
  for (int64_t d = 0; d < t.dim(); ++d) uniform &= t.size(d) < 2 || t.stride(d) == 0;
  if (uniform) return at::full(t.sizes(), t.flatten()[0].item(), options);
  return t.to(options, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

// The submodule holding `dotted`'s leaf, and the leaf's name.
std::pair<torch::jit::Module, std::string> owner_of(const torch::jit::Module& root, const std::string& dotted) {
  torch::jit::Module m = root;
  size_t start = 0;
  for (size_t dot = dotted.find('.'); dot != std::string::npos; dot = dotted.find('.', start)) {
    m = m.attr(dotted.substr(start, dot - start)).toModule();
    start = dot + 1;
  }
  return {m, dotted.substr(start)};
}

}  // namespace

// Names that share one tensor in the model (tied weights), keyed by each name.
AliasGroups alias_groups(const torch::jit::Module& model) {
  std::map<const void*, std::vector<std::string>> by_storage;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (t.defined()) by_storage[t.storage().unsafeGetStorageImpl()].push_back(name);
  };
  for (const auto& p : model.named_parameters()) add(p.name, p.value);
  for (const auto& b : model.named_buffers()) add(b.name, b.value);
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [storage, names] : by_storage)
    for (const auto& n : names)
      for (const auto& other : names)
        if (other != n) out[n].push_back(other);
  return out;
}

void strip_stage_weights(torch::jit::Module& stage, const Checkpoint& checkpoint, const AliasGroups& aliases) {
  std::vector<std::tuple<std::string, bool, at::Tensor>> slots;
  for (const auto& p : stage.named_parameters()) slots.emplace_back(p.name, false, p.value);
  for (const auto& b : stage.named_buffers()) slots.emplace_back(b.name, true, b.value);
  for (const auto& [name, is_buffer, t] : slots) {
    // A tensor the checkpoint lacks travels as it is: its data (the receiver keeps it), or meta
    // (the receiver reports it as load_stage_weights does).
    auto it = aliases.find(name);
    if (checkpoint.resolve(name, it == aliases.end() ? std::vector<std::string>{} : it->second).empty()) continue;
    auto [owner, leaf] = owner_of(stage, name);
    // One element seen through zero strides: the shape and dtype survive serialization, the
    // bytes do not travel.
    owner.register_parameter(leaf, at::zeros({}, t.options().device(at::kCPU)).expand(t.sizes()), is_buffer);
  }
}

void load_stage_weights(torch::jit::Module& stage, const graph::Plan& plan, size_t stage_index,
                        const StageOptions& options, Checkpoint* checkpoint, const c10::Device& device) {
  load_stage_weights(stage, checkpoint ? alias_groups(graph::torchscript_model(plan).module()) : AliasGroups{},
                     stage_index, options, checkpoint, device);
}

void load_stage_weights(torch::jit::Module& stage, const AliasGroups& aliases, size_t stage_index,
                        const StageOptions& options, Checkpoint* checkpoint, const c10::Device& device) {
  const std::string where = " (stage " + std::to_string(stage_index) + ")";
  struct Slot {
    std::string name;
    bool is_buffer;
    at::Tensor current;
  };
  std::vector<Slot> slots;
  for (const auto& p : stage.named_parameters()) slots.push_back({p.name, false, p.value});
  for (const auto& b : stage.named_buffers()) slots.push_back({b.name, true, b.value});
  std::vector<bool> from_checkpoint(slots.size(), false);

  if (checkpoint) {
    std::vector<std::string> keys;
    uint64_t total = 0, done = 0;
    for (const auto& slot : slots) {
      auto it = aliases.find(slot.name);
      const std::string key =
          checkpoint->resolve(slot.name, it == aliases.end() ? std::vector<std::string>{} : it->second);
      // A checkpoint need not hold everything: Hugging Face never stores non-persistent buffers
      // (rotary inv_freq, position_ids), so a tensor the model holds with data keeps it. Only a
      // tensor with data nowhere is an error.
      if (key.empty() && slot.current.is_meta())
        throw Error(Status::NotFound, "tensor '" + slot.name + "'" + where + " is not in checkpoint '" +
                                          checkpoint->path() +
                                          "' (also tried tied names and with a prefix such as "
                                          "'model.' added or removed) and the model holds no data for it (it is on "
                                          "the meta device): add it to the checkpoint, or keep its data in the "
                                          "skeleton (libpipe.save_skeleton(traced, path, module=model) keeps the "
                                          "buffers a checkpoint does not store; keep=[names] keeps others)");
      keys.push_back(key);
      if (!key.empty()) total += checkpoint->bytes(key);
    }
    std::map<std::string, at::Tensor> loaded;  // a tensor tied within the stage is loaded once
    for (size_t i = 0; i < slots.size(); ++i) {
      Slot& slot = slots[i];
      if (keys[i].empty()) continue;  // the model's own data
      auto cached = loaded.find(keys[i]);
      at::Tensor t = cached != loaded.end() ? cached->second : checkpoint->load(keys[i]);
      if (t.sizes() != slot.current.sizes())
        throw Error(Status::Input, "tensor '" + slot.name + "'" + where + ": the model expects shape " +
                                       c10::str(slot.current.sizes()) + " but checkpoint tensor '" + keys[i] +
                                       "' has shape " + c10::str(t.sizes()));
      const bool cast = options.dtype && at::isFloatingType(t.scalar_type());
      if (!cast && t.scalar_type() != slot.current.scalar_type())
        throw Error(Status::Input, "tensor '" + slot.name + "'" + where + ": the model expects dtype " +
                                       c10::toString(slot.current.scalar_type()) + " but checkpoint tensor '" +
                                       keys[i] + "' has " + c10::toString(t.scalar_type()) +
                                       " (ask for a dtype to convert floating weights)");
      if (cached == loaded.end()) {
        loaded[keys[i]] = t;
        done += checkpoint->bytes(keys[i]);
        if (options.progress) options.progress(stage_index, done, total);
      }
      slot.current = t;
      from_checkpoint[i] = true;
    }
  }
  // Tensors the stage's forward updates in place (KV caches) become the stage's own: never the
  // model's (which every session built from it would share), never a placeholder.
  std::set<std::string> written_names;
  if (auto forward = stage.find_method("forward"))
    for (const auto& w : graph::in_place_writes(*forward->graph())) {
      std::string name;
      for (const auto& p : w.path) name += (name.empty() ? "" : ".") + p;
      written_names.insert(name);
    }
  std::set<const c10::TensorImpl*> written;  // by tensor, so that a tie to a written one follows it
  for (const auto& slot : slots)
    if (written_names.count(slot.name)) written.insert(slot.current.unsafeGetTensorImpl());

  std::unique_ptr<device::Uploader> uploader;
  if (device.is_cuda()) uploader = std::make_unique<device::Uploader>(device);
  std::map<const c10::TensorImpl*, at::Tensor> placed;  // tied tensors are placed once
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& slot = slots[i];
    if (slot.current.is_meta())
      throw Error(Status::InvalidArgument, "tensor '" + slot.name + "'" + where +
                                               " has no data (it is on the meta device): give its weights with a "
                                               "checkpoint (--weights / pipe_stage_options.weights)");
    const at::Tensor& t = slot.current;
    auto [it, fresh] = placed.try_emplace(t.unsafeGetTensorImpl());
    if (fresh) {
      const bool cast = options.dtype && at::isFloatingType(t.scalar_type()) && t.scalar_type() != *options.dtype;
      const bool own = written.count(t.unsafeGetTensorImpl()) > 0;
      const auto dtype = cast ? *options.dtype : t.scalar_type();
      if (own && !from_checkpoint[i] && is_placeholder(t)) {
        it->second = materialize(t, dtype, device, uploader.get());
      } else if (uploader) {
        it->second = uploader->upload(t, cast ? options.dtype : std::nullopt);
      } else if (cast) {
        it->second = t.to(*options.dtype);
      } else if (own && !from_checkpoint[i]) {
        // A checkpoint's tensor is a view of this load's own private mapping; the model's is shared.
        it->second = t.clone(at::MemoryFormat::Contiguous);
      } else {
        it->second = t;
      }
    }
    slot.current = it->second;
    auto [owner, leaf] = owner_of(stage, slot.name);
    owner.register_parameter(leaf, slot.current, slot.is_buffer);
  }
  if (uploader) uploader->finish();
  // Tensors held as plain attributes (not parameters or buffers) cannot be loaded; they must not
  // be left on meta either.
  for (const auto& a : stage.named_attributes())
    if (a.value.isTensor() && a.value.toTensor().is_meta())
      throw Error(Status::InvalidArgument, "tensor attribute '" + a.name + "'" + where +
                                               " is on the meta device and no checkpoint entry can fill it");
}

}  // namespace libpipe::stage
