#include "runtime/stage/weights.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <set>

#include "runtime/device/upload.h"
#include "runtime/error.h"
#include "runtime/graph/torchscript/model.h"
#include "runtime/io/safetensors.h"

namespace libpipe::stage {

// One mapped shard: the file stays mapped while any tensor viewing it is alive.
struct Checkpoint::Shard {
  std::string path;
  std::shared_ptr<void> mapping;        // munmap on release
  const unsigned char* data = nullptr;  // start of the data section
  std::map<std::string, io::TensorEntry> entries;
};

namespace {

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::map<std::string, std::string> parse_checkpoint_index(const std::string& text, const std::string& path) {
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::InvalidFormat, "checkpoint index '" + path + "' is not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw Error(Status::InvalidFormat,
                "checkpoint index '" + path + "' has no \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw Error(Status::InvalidFormat, "checkpoint index '" + path + "' maps '" + name + "' to a non-string");
    const std::string f = file.get<std::string>();
    if (f.empty() || f[0] == '/' || f.find("..") != std::string::npos)
      throw Error(Status::InvalidFormat, "checkpoint index '" + path + "' maps '" + name + "' to '" + f +
                                             "'; shards must be files next to the index");
    weight_map[name] = f;
  }
  return weight_map;
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::string& path) {
  auto cp = std::make_shared<Checkpoint>();
  cp->path_ = path;
  cp->dir_ = dir_of(path);
  if (ends_with(path, ".json")) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(Status::NotFound, "cannot open checkpoint index '" + path + "'");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cp->weight_map_ = parse_checkpoint_index(text, path);
  } else {
    // A single file: its header lists the tensors.
    const size_t slash = path.rfind('/');
    const std::string file = slash == std::string::npos ? path : path.substr(slash + 1);
    for (const auto& [name, entry] : cp->shard(file).entries) cp->weight_map_[name] = file;
  }
  std::set<std::string> firsts;
  for (const auto& [name, file] : cp->weight_map_) {
    const size_t dot = name.find('.');
    if (dot != std::string::npos) firsts.insert(name.substr(0, dot + 1));
  }
  cp->prefixes_.assign(firsts.begin(), firsts.end());
  return cp;
}

Checkpoint::Shard& Checkpoint::shard(const std::string& file) {
  if (auto it = shards_.find(file); it != shards_.end()) return *it->second;
  auto s = std::make_shared<Shard>();
  s->path = dir_ + "/" + file;
  const int fd = ::open(s->path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(Status::NotFound, "checkpoint shard '" + s->path + "' is missing (named by '" + path_ + "')");
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(Status::Io, "cannot stat checkpoint shard '" + s->path + "'");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    throw Error(Status::InvalidFormat, "malformed safetensors: checkpoint shard '" + s->path + "' is " +
                                           std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  // Private and writable: a stage may update its weights in place without touching the file.
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) throw Error(Status::Io, "cannot map checkpoint shard '" + s->path + "'");
  s->mapping = std::shared_ptr<void>(base, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const unsigned char*>(base);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8)
    throw Error(Status::InvalidFormat, "malformed safetensors: checkpoint shard '" + s->path + "' declares a " +
                                           std::to_string(header_len) + "-byte header but has " +
                                           std::to_string(size - 8) + " bytes after the length field");
  std::vector<io::TensorEntry> entries;
  try {
    entries = io::parse_safetensors_header(std::string(reinterpret_cast<const char*>(bytes) + 8, header_len),
                                           size - 8 - header_len);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " (in checkpoint shard '" + s->path + "')");
  }
  s->data = bytes + 8 + header_len;
  for (auto& e : entries) s->entries.emplace(e.name, std::move(e));
  return *shards_.emplace(file, std::move(s)).first->second;
}

std::string Checkpoint::resolve(const std::string& name, const std::vector<std::string>& aliases) const {
  std::vector<std::string> names = {name};
  names.insert(names.end(), aliases.begin(), aliases.end());
  for (const auto& n : names)
    if (weight_map_.count(n)) return n;
  // Checkpoints saved from a wrapper carry a prefix the model lacks, or the other way round.
  for (const auto& n : names) {
    for (const auto& p : prefixes_)
      if (weight_map_.count(p + n)) return p + n;
    const size_t dot = n.find('.');
    if (dot != std::string::npos && weight_map_.count(n.substr(dot + 1))) return n.substr(dot + 1);
  }
  return "";
}

uint64_t Checkpoint::bytes(const std::string& key) {
  const auto& e = shard(weight_map_.at(key)).entries.at(key);
  return e.end - e.begin;
}

at::Tensor Checkpoint::load(const std::string& key) {
  Shard& s = shard(weight_map_.at(key));
  auto it = s.entries.find(key);
  if (it == s.entries.end())
    throw Error(Status::InvalidFormat, "checkpoint index '" + path_ + "' says '" + key + "' is in '" + s.path +
                                           "', but that shard does not hold it");
  const io::TensorEntry& e = it->second;
  void* ptr = const_cast<unsigned char*>(s.data + e.begin);
  const size_t elem = c10::elementSize(e.dtype);
  auto keep = s.mapping;
  const size_t bytes = e.end - e.begin;
  // When the last tensor that reads these bytes in place goes (a weight cast at load, or repacked into panels,
  // runtime/stage/panel_linear.h), its pages leave this process's resident memory, so a load that converts every
  // weight never holds the whole file besides the converted copy. MADV_DONTNEED unmaps them and leaves the file in
  // the page cache (MADV_PAGEOUT, used before, evicted it from there: every later run read the checkpoint from
  // disk again, and a 1B Llama's untied embedding, still mapped, took 3.7 ms a decode step in page faults). Only
  // the pages wholly inside the tensor: on a private mapping DONTNEED discards what was written to a page, and a
  // page shared with a neighbour may hold that neighbour's in-place writes.
  at::Tensor view = at::from_blob(
      ptr, e.shape,
      [keep, bytes](void* data) {
        const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
        const uintptr_t first = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
        const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
        if (end > first) (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
      },
      at::TensorOptions().dtype(e.dtype));
  // Elements must be aligned to their size to be read in place; otherwise take a copy.
  return reinterpret_cast<uintptr_t>(ptr) % elem == 0 ? view : view.clone();
}

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
