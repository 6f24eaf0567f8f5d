#include "runtime/graph/exported/archive.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <algorithm>
#include <cstring>

#include "runtime/error.h"
#include "runtime/io/archive_check.h"

namespace libpipe::graph::exported {

namespace {

// The zip reader's view of an archive held in memory.
class MemoryAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MemoryAdapter(std::shared_ptr<std::string> bytes) : bytes_(std::move(bytes)) {}
  size_t size() const override { return bytes_->size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_->size()) return 0;
    n = std::min<size_t>(n, bytes_->size() - pos);
    std::memcpy(buf, bytes_->data() + pos, n);
    return n;
  }

 private:
  std::shared_ptr<std::string> bytes_;
};

}  // namespace

Pt2Archive::~Pt2Archive() = default;

std::shared_ptr<Pt2Archive> Pt2Archive::open(const std::string& path) {
  if (io::check_model_archive(path) != io::ModelFormat::Exported)
    throw Error(Status::InvalidFormat, "'" + path + "' is a TorchScript archive, not a torch.export program");
  std::shared_ptr<Pt2Archive> archive(new Pt2Archive());
  archive->name_ = path;
  try {
    archive->reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat,
                "'" + path + "' cannot be read as a torch.export archive: " + e.what_without_backtrace());
  }
  archive->index();
  return archive;
}

std::shared_ptr<Pt2Archive> Pt2Archive::from_bytes(std::string bytes, const std::string& name) {
  auto shared = std::make_shared<std::string>(std::move(bytes));
  if (io::check_model_archive(shared->data(), shared->size(), name) != io::ModelFormat::Exported)
    throw Error(Status::InvalidFormat, "'" + name + "' is a TorchScript archive, not a torch.export program");
  std::shared_ptr<Pt2Archive> archive(new Pt2Archive());
  archive->name_ = name;
  archive->bytes_ = shared;
  try {
    archive->reader_ =
        std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<MemoryAdapter>(shared));
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat,
                "'" + name + "' cannot be read as a torch.export archive: " + e.what_without_backtrace());
  }
  archive->index();
  return archive;
}

void Pt2Archive::index() {
  const std::string dir = "models/", ext = ".json";
  for (const auto& record : reader_->getAllRecords())
    if (record.size() > dir.size() + ext.size() && record.compare(0, dir.size(), dir) == 0 &&
        record.compare(record.size() - ext.size(), ext.size(), ext) == 0 &&
        record.find('/', dir.size()) == std::string::npos)
      programs_.push_back(record.substr(dir.size(), record.size() - dir.size() - ext.size()));
  std::sort(programs_.begin(), programs_.end());
}

bool Pt2Archive::has(const std::string& record) const {
  std::lock_guard lock(mutex_);
  return reader_->hasRecord(record);
}

size_t Pt2Archive::size(const std::string& record) const {
  std::lock_guard lock(mutex_);
  if (!reader_->hasRecord(record)) throw Error(Status::InvalidFormat, "'" + name_ + "' has no record " + record);
  return reader_->getRecordSize(record);
}

std::string Pt2Archive::read(const std::string& record) const {
  std::string out(size(record), '\0');
  read_into(record, out.data(), out.size());
  return out;
}

void Pt2Archive::read_into(const std::string& record, void* dst, size_t bytes) const {
  std::lock_guard lock(mutex_);
  if (!reader_->hasRecord(record)) throw Error(Status::InvalidFormat, "'" + name_ + "' has no record " + record);
  if (reader_->getRecordSize(record) != bytes)
    throw Error(Status::InvalidFormat, "'" + name_ + "': record " + record + " holds " +
                                           std::to_string(reader_->getRecordSize(record)) + " bytes, not the " +
                                           std::to_string(bytes) + " its metadata says");
  try {
    reader_->getRecord(record, dst, bytes);
  } catch (const c10::Error& e) {
    throw Error(Status::InvalidFormat,
                "'" + name_ + "': record " + record + " cannot be read: " + e.what_without_backtrace());
  }
}

struct Pt2Writer::Impl {
  explicit Impl(Sink s) : sink(std::move(s)) {}
  // The zip writer's own destructor finishes an unfinished archive and throws if that fails (as it will after a
  // failed write), which would end the process: an archive abandoned by an error is finished here, quietly.
  ~Impl() {
    if (writer.finalized()) return;
    try {
      writer.writeEndOfFile();
    } catch (...) {  // the error that abandoned the archive is already on its way
    }
  }
  Sink sink;
  std::string bytes;
  // A sink's failure is reported as a short write (the zip writer then throws its own error).
  caffe2::serialize::PyTorchStreamWriter writer{[this](const void* data, size_t n) -> size_t {
    if (sink) return sink(data, n) ? n : 0;
    bytes.append(static_cast<const char*>(data), n);
    return n;
  }};
};

Pt2Writer::Pt2Writer(Sink sink) : impl_(std::make_unique<Impl>(std::move(sink))) {}
Pt2Writer::~Pt2Writer() = default;

void Pt2Writer::add(const std::string& record, const void* data, size_t size) {
  try {
    impl_->writer.writeRecord(record, data, size);
  } catch (const c10::Error& e) {
    throw Error(Status::Io, "cannot write record " + record + " of a stage program: " + e.what_without_backtrace());
  }
}

std::string Pt2Writer::finish() {
  // What torch.export.pt2_archive's writer adds beside the programs: readers check them.
  add("archive_format", std::string("pt2"));
  add("archive_version", std::string("0"));
  add("byteorder", std::string("little"));
  try {
    impl_->writer.writeEndOfFile();
  } catch (const c10::Error& e) {
    throw Error(Status::Io, std::string("cannot finish a stage program: ") + e.what_without_backtrace());
  }
  return std::move(impl_->bytes);
}

}  // namespace libpipe::graph::exported
