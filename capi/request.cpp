// The C ABI of a submitted call (pipe_request): waiting for it, cancelling it, and being told that
// it finished without a waiting thread (a callback or a pollable descriptor).
#include <chrono>
#include <string>

#include "capi/boundary.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

extern "C" {

pipe_status pipe_request_wait(pipe_request* request, int64_t timeout_ms, pipe_tensor_list** outputs) {
  return guarded(__func__, [&](const char* fn) {
    require(request, fn, "request");
    require(outputs, fn, "outputs");
    using libpipe::schedule::Clock;
    const auto now = Clock::now();
    // A timeout past what the clock can count waits as long as it takes (adding it would overflow
    // into the past and report PIPE_ERR_TIMEOUT at once).
    const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now).count();
    const auto until =
        timeout_ms < 0 || timeout_ms >= room ? Clock::time_point::max() : now + std::chrono::milliseconds(timeout_ms);
    if (!get(request)->impl->wait_until(until))
      throw Error(Status::Timeout, std::string(fn) + ": the call is still running after " + std::to_string(timeout_ms) +
                                       " ms; wait again, or cancel it");
    *outputs = make_list(get(request)->impl->result(get(request)->output_specs));
  });
}

pipe_status pipe_request_cancel(pipe_request* request) {
  return guarded(__func__, [&](const char* fn) {
    require(request, fn, "request");
    get(request)->impl->cancel();
  });
}

pipe_status pipe_request_on_done(pipe_request* request, pipe_request_done_fn fn, void* user_data) {
  return guarded(__func__, [&](const char* function) {
    require(request, function, "request");
    require(reinterpret_cast<const void*>(fn), function, "fn");
    // The C callback cannot throw; the status it gets is the call's, as pipe_request_wait reports it.
    auto done = [fn, user_data, request](Status status) { fn(user_data, request, static_cast<pipe_status>(status)); };
    if (!get(request)->impl->on_done(done))
      throw Error(Status::InvalidArgument, std::string(function) +
                                               ": the request already has a callback (one per request); "
                                               "tell every listener from that one");
  });
}

pipe_status pipe_request_fd(pipe_request* request, int* fd) {
  return guarded(__func__, [&](const char* fn) {
    require(request, fn, "request");
    require(fd, fn, "fd");
    const int descriptor = get(request)->impl->event_fd();  // Error(Io) leaves *fd untouched
    *fd = descriptor;
  });
}

void pipe_request_destroy(pipe_request* request) {
  if (!request) return;
  // Cancels a running call (its callback runs here), waits for a callback on another thread and
  // closes the descriptor; the workers drop what is left of the call.
  get(request)->impl->abandon();
  delete get(request);
}

}  // extern "C"
