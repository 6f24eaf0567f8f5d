#include "runtime/stage/checkpoint.h"

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

}  // namespace libpipe::stage
