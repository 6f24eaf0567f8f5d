#include "runtime/io/archive_check.h"

#include <zip.h>

#include <fstream>
#include <memory>
#include <set>

#include "runtime/error.h"

namespace libpipe::io {

namespace {

// TorchScript and torch.export store tensors uncompressed and deflate at most their code, pickles
// and JSON, which are small; an entry inflating past this is not something either wrote.
constexpr zip_uint64_t kMaxInflatedEntry = 256ull << 20;

[[noreturn]] void refuse(const std::string& name, const std::string& why) {
  throw Error(Status::InvalidFormat,
              "'" + name + "' is not a loadable model archive (TorchScript or torch.export): " + why);
}

struct ArchiveCloser {
  void operator()(zip_t* z) const { zip_discard(z); }
};

ModelFormat check_entries(zip_t* archive, const std::string& name) {
  const zip_int64_t count = zip_get_num_entries(archive, 0);
  if (count <= 0) refuse(name, "the zip archive is empty");
  std::string root;
  bool has_data = false, has_code = false, has_format = false, has_program = false;
  for (zip_int64_t i = 0; i < count; ++i) {
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(archive, static_cast<zip_uint64_t>(i), 0, &st) != 0 || !(st.valid & ZIP_STAT_NAME))
      refuse(name, "entry " + std::to_string(i) + " cannot be read (" + zip_strerror(archive) + ")");
    const std::string entry = st.name;
    const size_t slash = entry.find('/');
    if (slash == std::string::npos || slash == 0)
      refuse(name, "entry '" + entry + "' is not inside the archive's top-level folder");
    const std::string top = entry.substr(0, slash);
    if (root.empty()) root = top;
    if (top != root)
      refuse(name, "entries lie under both '" + root + "/' and '" + top + "/'; model archives have one folder");
    const std::string rest = entry.substr(slash + 1);
    has_data |= rest == "data.pkl";
    has_code |= rest.compare(0, 5, "code/") == 0;
    has_format |= rest == "archive_format";
    has_program |=
        rest.compare(0, 7, "models/") == 0 && rest.size() > 12 && rest.compare(rest.size() - 5, 5, ".json") == 0;
    if ((st.valid & ZIP_STAT_ENCRYPTION_METHOD) && st.encryption_method != ZIP_EM_NONE)
      refuse(name, "entry '" + entry + "' is encrypted");
    if (st.valid & ZIP_STAT_COMP_METHOD) {
      if (st.comp_method != ZIP_CM_STORE && st.comp_method != ZIP_CM_DEFLATE)
        refuse(name, "entry '" + entry + "' uses compression method " + std::to_string(st.comp_method) +
                         "; model archives use none or deflate");
      if (st.comp_method == ZIP_CM_STORE && (st.valid & ZIP_STAT_SIZE) && (st.valid & ZIP_STAT_COMP_SIZE) &&
          st.size != st.comp_size)
        refuse(name, "entry '" + entry + "' is stored uncompressed but its sizes disagree (" + std::to_string(st.size) +
                         " vs " + std::to_string(st.comp_size) + " bytes)");
      if (st.comp_method == ZIP_CM_DEFLATE && (st.valid & ZIP_STAT_SIZE) && st.size > kMaxInflatedEntry)
        refuse(name, "entry '" + entry + "' would inflate to " + std::to_string(st.size) +
                         " bytes, far more than code, pickles or a program's JSON take");
    }
  }
  if (has_data && has_code) return ModelFormat::TorchScript;
  if (has_format && has_program) return ModelFormat::Exported;
  if (has_data)
    refuse(name,
           "the archive has no code/ folder: it looks like a torch.save() file (weights or a pickled "
           "module), not a model; export the model with torch.jit.trace(...) or torch.jit.script(...) "
           "and .save() that, or with torch.export.export(...) and torch.export.save(...)");
  if (has_format)
    refuse(name, "it has " + root + "/archive_format but no program under " + root +
                     "/models/ (an AOTInductor package holds compiled code, which cannot be split); save the "
                     "ExportedProgram itself with torch.export.save(...)");
  refuse(name, "the zip archive has neither " + root + "/data.pkl and code/ (TorchScript) nor " + root +
                   "/archive_format and models/ (torch.export)");
}

ModelFormat check(zip_source_t* source, const std::string& name, const unsigned char* head, size_t head_size) {
  if (head_size < 4 || head[0] != 'P' || head[1] != 'K') {
    zip_source_free(source);
    refuse(name,
           "it is not a zip archive (TorchScript and torch.export files start with \"PK\"); save the model "
           "with torch.jit.trace(...).save(), torch.jit.script(...).save() or torch.export.save(...)");
  }
  zip_error_t error;
  zip_error_init(&error);
  // ZIP_CHECKCONS: also compare every local header with the central directory, which catches
  // truncation and tampering that a central-directory-only reader would miss.
  std::unique_ptr<zip_t, ArchiveCloser> archive(zip_open_from_source(source, ZIP_RDONLY | ZIP_CHECKCONS, &error));
  if (!archive) {
    zip_source_free(source);
    const std::string why = zip_error_strerror(&error);
    zip_error_fini(&error);
    refuse(name, "the zip archive is damaged (" + why + "); it may be truncated: copy or export it again");
  }
  zip_error_fini(&error);
  return check_entries(archive.get(), name);
}

}  // namespace

ModelFormat check_model_archive(const void* data, size_t size, const std::string& name) {
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source = zip_source_buffer_create(data, size, 0, &error);
  zip_error_fini(&error);
  if (!source) throw Error(Status::OutOfMemory, "cannot read '" + name + "' from memory");
  return check(source, name, static_cast<const unsigned char*>(data), size);
}

ModelFormat check_model_archive(const std::string& path) {
  unsigned char head[4] = {0, 0, 0, 0};
  size_t got = 0;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(Status::NotFound, "cannot open model file '" + path + "'");
    in.read(reinterpret_cast<char*>(head), sizeof head);
    got = static_cast<size_t>(in.gcount());
  }
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source = zip_source_file_create(path.c_str(), 0, -1, &error);
  zip_error_fini(&error);
  if (!source) throw Error(Status::NotFound, "cannot open model file '" + path + "'");
  return check(source, path, head, got);
}

}  // namespace libpipe::io
