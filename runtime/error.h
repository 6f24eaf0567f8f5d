// The one exception type the runtime throws. It carries the C ABI status code that describes the
// failure, so the capi layer can translate any failure into a status and a message without
// guessing from exception text.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace libpipe {

// Mirrors the PIPE_* status codes of pipe.h (capi/include/pipe/pipe.h.in; checked by static_assert in capi/status.cpp).
enum class Status : int32_t {
  Ok = 0,
  InvalidArgument = 1,
  NotFound = 2,
  InvalidFormat = 3,
  Split = 4,
  Input = 5,
  Execution = 6,
  Io = 7,
  OutOfMemory = 8,
  Unsupported = 9,
  Internal = 10,
  Timeout = 11,
  Cancelled = 12,
  DeadlineExceeded = 13,
  Communication = 14,
  Busy = 15,
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

}  // namespace libpipe
