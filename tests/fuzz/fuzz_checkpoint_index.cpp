// libFuzzer target: the *.index.json of a sharded checkpoint (tensor name -> shard file).
// Refusals must be libpipe's Error; accepted shard paths must stay inside the index's folder.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "runtime/error.h"
#include "runtime/stage/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& [name, file] : libpipe::stage::parse_checkpoint_index(text, "fuzz.index.json"))
      if (file.empty() || file[0] == '/' || file.find("..") != std::string::npos) std::abort();
  } catch (const libpipe::Error&) {}
  return 0;
}
