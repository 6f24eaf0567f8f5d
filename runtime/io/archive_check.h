// The model file's front door: TorchScript files and torch.export programs are zip archives, and
// LibTorch's readers trust their structure. These checks run first, with libzip's consistency
// checks, so that a truncated, corrupt or hostile file (or a file of the wrong kind) is refused with
// a message that says what it is, before LibTorch parses a byte of it. They also tell the two
// formats apart by what the archive holds, so that loading a model never depends on its file name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace libpipe::io {

// The values are the C ABI's PIPE_MODEL_* codes (capi/model.cpp checks it), so a format is named in one place.
enum class ModelFormat : int32_t {
  TorchScript = 0,  // torch.jit.save: <root>/data.pkl and <root>/code/
  Exported = 1,     // torch.export.save: <root>/archive_format and <root>/models/<name>.json
};

// Returns the archive's format. Throws Error(InvalidFormat) naming `name` and what is wrong: not a
// zip archive, a damaged one (truncated, central directory disagreeing with the entries), entries
// LibTorch cannot read (encrypted, unknown compression), an entry that would inflate absurdly, or
// a zip of neither format (no data.pkl or no code/, as in a torch.save() checkpoint; an AOTInductor
// package, which holds compiled code and no program). Error(NotFound) if `path` cannot be opened.
ModelFormat check_model_archive(const std::string& path);
ModelFormat check_model_archive(const void* data, size_t size, const std::string& name);

}  // namespace libpipe::io
