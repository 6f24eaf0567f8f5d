// libFuzzer target: the model file's front door, the zip checks that run before LibTorch's
// reader sees a file. Every input must pass or be refused with libpipe's Error.
#include <cstddef>
#include <cstdint>

#include "runtime/error.h"
#include "runtime/io/archive_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    libpipe::io::check_model_archive(data, size, "fuzz.pt");
  } catch (const libpipe::Error&) {}
  return 0;
}
