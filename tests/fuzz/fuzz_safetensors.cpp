// libFuzzer target: a whole safetensors file (header length, JSON header, data) through the
// reader the CLI and the C ABI use. Every input must either load or be refused with libpipe's
// Error; anything else escaping (a c10::Error, a JSON exception, a crash) is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/error.h"
#include "runtime/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An in-memory file, read through its /proc path as the reader reads any path.
  static const int fd = memfd_create("fuzz.safetensors", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  try {
    libpipe::io::read_safetensors(path);
  } catch (const libpipe::Error&) {}
  return 0;
}
