// Helpers shared by the unit tests: fixture paths (the TorchScript files tests/models generates)
// and the status a call fails with.
#pragma once

#include <cstdlib>
#include <functional>
#include <string>

#include "runtime/error.h"

namespace libpipe::test {

inline std::string fixture(const std::string& name) {
  const char* dir = std::getenv("PIPE_TEST_MODELS");
  return std::string(dir ? dir : ".") + "/" + name;
}

// Runs `f` and returns the status of the Error it throws (Ok if none), keeping the message.
inline Status status_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.status();
  }
  return Status::Ok;
}

}  // namespace libpipe::test
