// A .pt2 archive (torch.export.save): the records of one zip, read with LibTorch's own zip reader
// after io::check_model_archive has vetted the file. Written archives (a stage's program) come from
// PyTorchStreamWriter too, so both sides agree with PyTorch on the layout: records stored
// uncompressed, 64-byte aligned, under one top-level folder.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace libpipe::graph::exported {

class Pt2Archive {
 public:
  // Throws Error(InvalidFormat) for a file that is not a torch.export archive, Error(NotFound) for
  // a missing one. `name` names it in messages (the path, or "stage 1 from rank 0").
  static std::shared_ptr<Pt2Archive> open(const std::string& path);
  static std::shared_ptr<Pt2Archive> from_bytes(std::string bytes, const std::string& name);
  ~Pt2Archive();

  const std::string& name() const { return name_; }
  // Names of the programs it holds (models/<name>.json), sorted.
  const std::vector<std::string>& programs() const { return programs_; }
  bool has(const std::string& record) const;
  // A record's bytes, by its name inside the top-level folder ("models/model.json"). Throws
  // Error(InvalidFormat) naming the archive when it is missing.
  std::string read(const std::string& record) const;
  size_t size(const std::string& record) const;
  // Reads a record into `dst` (exactly `bytes` of it).
  void read_into(const std::string& record, void* dst, size_t bytes) const;

 private:
  Pt2Archive() = default;
  void index();

  std::string name_;
  std::shared_ptr<std::string> bytes_;  // when read from memory
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  mutable std::mutex mutex_;
  std::vector<std::string> programs_;
};

// Builds an archive record by record, as torch.export.save lays it out: in memory, or straight into
// `sink`, which takes the bytes in order and returns false when it cannot (the writer then throws).
class Pt2Writer {
 public:
  using Sink = std::function<bool(const void* data, size_t size)>;
  explicit Pt2Writer(Sink sink = nullptr);
  ~Pt2Writer();
  void add(const std::string& record, const void* data, size_t size);
  void add(const std::string& record, const std::string& text) { add(record, text.data(), text.size()); }
  // Adds the format records (archive_format, archive_version, byteorder) and the zip's directory;
  // returns the archive's bytes (nothing when they went to a sink). Nothing may be added afterwards.
  std::string finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace libpipe::graph::exported
