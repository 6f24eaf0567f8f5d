#include "runtime/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>

namespace libpipe::log {
namespace {

void stderr_sink(void*, int32_t level, const char* message) {
  static const char* const names[] = {"debug", "info", "warning", "error"};
  const char* name = (level >= 0 && level <= 3) ? names[level] : "log";
  std::fprintf(stderr, "libpipe %s: %s\n", name, message);
}

// LIBPIPE_LOG_LEVEL=debug|info|warning|error: the default sink's threshold, whatever the program asked for
// (to see what a program that never installed a sink does not show, e.g. the kernels each CPU stage chose).
int32_t environment_level(int32_t otherwise) {
  static const int32_t level = [] {
    const char* v = std::getenv("LIBPIPE_LOG_LEVEL");
    static const char* const names[] = {"debug", "info", "warning", "error"};
    for (int32_t l = 0; v && l < 4; ++l)
      if (std::strcmp(v, names[l]) == 0) return l;
    return int32_t{-1};
  }();
  return level >= 0 ? level : otherwise;
}

struct State {
  std::shared_mutex mutex;
  Sink sink = &stderr_sink;
  void* user_data = nullptr;
  int32_t min_level = environment_level(Warning);
};

State& state() {
  static State s;
  return s;
}

}  // namespace

void set_sink(Sink sink, void* user_data, int32_t min_level) {
  State& s = state();
  std::unique_lock lock(s.mutex);
  s.sink = sink ? sink : &stderr_sink;
  s.user_data = sink ? user_data : nullptr;
  s.min_level = sink ? min_level : environment_level(min_level);
}

void write(Level level, const std::string& message) {
  State& s = state();
  // Held shared while the sink runs, so set_sink never swaps a sink out from under a caller.
  std::shared_lock lock(s.mutex);
  if (level < s.min_level) return;
  s.sink(s.user_data, level, message.c_str());
}

}  // namespace libpipe::log
