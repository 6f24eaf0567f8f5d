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

// c10's log level (FLAGS_caffe2_log_level) is one process-wide number that libpipe changes in two places: c10d's
// rendezvous raises it (c10d logs its retries and failures itself, with backtraces) and nativert needs it lowered
// while it loads a program (above 2 it prints the program's signature on stdout). Both go through one lock here, so
// neither undoes the other.

// Raises the level to at least `level` (only fatal messages pass from 3 on).
void raise_libtorch_log_level(int level);

// Holds the level at most `level` while it lives and puts the previous one back, whatever ends the scope. Such scopes
// take turns (and a raise waits for them).
class LibTorchLogLevelAtMost {
 public:
  explicit LibTorchLogLevelAtMost(int level);
  ~LibTorchLogLevelAtMost();
  LibTorchLogLevelAtMost(const LibTorchLogLevelAtMost&) = delete;
  LibTorchLogLevelAtMost& operator=(const LibTorchLogLevelAtMost&) = delete;

 private:
  int previous_;
};

}  // namespace libpipe::log
