// The model file's front door: a TorchScript file is a zip archive, and LibTorch's reader trusts
// its structure. These checks run first, with libzip's consistency checks, so that a truncated,
// corrupt or hostile file (or a file of the wrong kind) is refused with a message that says what
// it is, before LibTorch parses a byte of it.
#pragma once

#include <cstddef>
#include <string>

namespace libpipe::io {

// Throws Error(InvalidFormat) naming `name` and what is wrong: not a zip archive, a damaged
// one (truncated, central directory disagreeing with the entries), entries LibTorch cannot read
// (encrypted, unknown compression), an entry that would inflate absurdly, or a zip that is not a
// TorchScript archive (no data.pkl, or no code/, as in a torch.save() checkpoint).
// Error(NotFound) if `path` cannot be opened.
void check_torchscript_archive(const std::string& path);
void check_torchscript_archive(const void* data, size_t size, const std::string& name);

}  // namespace libpipe::io
