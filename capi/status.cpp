// The C ABI: version, status names, this thread's last error, and the log callback.
#include "capi/boundary.h"
#include "runtime/log.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

namespace {

#define PIPE_CHECK_STATUS(code, name) \
  static_assert(code == static_cast<int32_t>(libpipe::Status::name), #code " mismatch")
PIPE_CHECK_STATUS(PIPE_OK, Ok);
PIPE_CHECK_STATUS(PIPE_ERR_INVALID_ARGUMENT, InvalidArgument);
PIPE_CHECK_STATUS(PIPE_ERR_NOT_FOUND, NotFound);
PIPE_CHECK_STATUS(PIPE_ERR_INVALID_FORMAT, InvalidFormat);
PIPE_CHECK_STATUS(PIPE_ERR_SPLIT, Split);
PIPE_CHECK_STATUS(PIPE_ERR_INPUT, Input);
PIPE_CHECK_STATUS(PIPE_ERR_EXECUTION, Execution);
PIPE_CHECK_STATUS(PIPE_ERR_IO, Io);
PIPE_CHECK_STATUS(PIPE_ERR_OUT_OF_MEMORY, OutOfMemory);
PIPE_CHECK_STATUS(PIPE_ERR_UNSUPPORTED, Unsupported);
PIPE_CHECK_STATUS(PIPE_ERR_INTERNAL, Internal);
PIPE_CHECK_STATUS(PIPE_ERR_TIMEOUT, Timeout);
PIPE_CHECK_STATUS(PIPE_ERR_CANCELLED, Cancelled);
PIPE_CHECK_STATUS(PIPE_ERR_DEADLINE_EXCEEDED, DeadlineExceeded);
PIPE_CHECK_STATUS(PIPE_ERR_COMMUNICATION, Communication);
PIPE_CHECK_STATUS(PIPE_ERR_BUSY, Busy);
static_assert(PIPE_LOG_DEBUG == libpipe::log::Debug && PIPE_LOG_ERROR == libpipe::log::Error, "log level mismatch");

}  // namespace

extern "C" {

const char* pipe_version(void) {
#define PIPE_STR2(x) #x
#define PIPE_STR(x) PIPE_STR2(x)
  return PIPE_STR(PIPE_VERSION_MAJOR) "." PIPE_STR(PIPE_VERSION_MINOR) "." PIPE_STR(PIPE_VERSION_PATCH);
}

const char* pipe_status_string(pipe_status status) {
  switch (status) {
    case PIPE_OK: return "PIPE_OK";
    case PIPE_ERR_INVALID_ARGUMENT: return "PIPE_ERR_INVALID_ARGUMENT";
    case PIPE_ERR_NOT_FOUND: return "PIPE_ERR_NOT_FOUND";
    case PIPE_ERR_INVALID_FORMAT: return "PIPE_ERR_INVALID_FORMAT";
    case PIPE_ERR_SPLIT: return "PIPE_ERR_SPLIT";
    case PIPE_ERR_INPUT: return "PIPE_ERR_INPUT";
    case PIPE_ERR_EXECUTION: return "PIPE_ERR_EXECUTION";
    case PIPE_ERR_IO: return "PIPE_ERR_IO";
    case PIPE_ERR_OUT_OF_MEMORY: return "PIPE_ERR_OUT_OF_MEMORY";
    case PIPE_ERR_UNSUPPORTED: return "PIPE_ERR_UNSUPPORTED";
    case PIPE_ERR_INTERNAL: return "PIPE_ERR_INTERNAL";
    case PIPE_ERR_TIMEOUT: return "PIPE_ERR_TIMEOUT";
    case PIPE_ERR_CANCELLED: return "PIPE_ERR_CANCELLED";
    case PIPE_ERR_DEADLINE_EXCEEDED: return "PIPE_ERR_DEADLINE_EXCEEDED";
    case PIPE_ERR_COMMUNICATION: return "PIPE_ERR_COMMUNICATION";
    case PIPE_ERR_BUSY: return "PIPE_ERR_BUSY";
    default: return "PIPE_ERR_UNKNOWN";
  }
}

const char* pipe_last_error(void) { return last_error().c_str(); }

pipe_status pipe_set_log_callback(pipe_log_fn callback, void* user_data, int32_t min_level) {
  return guarded(__func__, [&](const char* fn) {
    if (min_level < PIPE_LOG_DEBUG || min_level > PIPE_LOG_ERROR)
      throw Error(Status::InvalidArgument,
                  std::string(fn) + ": min_level " + std::to_string(min_level) + " is not a PIPE_LOG_* value");
    libpipe::log::set_sink(callback, user_data, min_level);
  });
}

}  // extern "C"
