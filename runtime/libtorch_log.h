// LibTorch's own log records go to libpipe's log. c10's logger writes each record (LOG(WARNING),
// LOG(ERROR), TORCH_WARN) to the process's stderr, and LibTorch's runtime for exported programs logs
// every failed run that way, with a C++ backtrace, before throwing the error libpipe reports anyway.
// A library must not scribble on its host's stderr, and a service that set a log callback
// (pipe_set_log_callback) expects to see everything there.
//
// How: std::cerr gets a filtering stream buffer. A write that starts a c10 record ("[W1128
// 09:12:34.567 ..."; the record, backtrace included, arrives as one write) is passed to libpipe's log
// (TORCH_WARN's warnings as warnings; the rest, nativert's notes and the errors whose failure reaches
// the caller as a status and a message anyway, at debug level); anything else goes to the original buffer unchanged, so
// the host's own std::cerr output is untouched.
#pragma once

namespace libpipe::log {

// Installs the filter once per process (later calls do nothing). Thread-safe.
void capture_libtorch_log();

}  // namespace libpipe::log
