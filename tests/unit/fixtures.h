// Paths of the TorchScript fixtures that tests/models/seed_models.py generates.
#pragma once

#include <cstdlib>
#include <string>

namespace libpipe::test {

inline std::string fixture(const std::string& name) {
  const char* dir = std::getenv("PIPE_TEST_MODELS");
  return std::string(dir ? dir : ".") + "/" + name;
}

}  // namespace libpipe::test
