#include "runtime/log.h"

#include <cstdio>
#include <mutex>
#include <shared_mutex>

namespace libpipe::log {
namespace {

void stderr_sink(void*, int32_t level, const char* message) {
  static const char* const names[] = {"debug", "info", "warning", "error"};
  const char* name = (level >= 0 && level <= 3) ? names[level] : "log";
  std::fprintf(stderr, "libpipe %s: %s\n", name, message);
}

struct State {
  std::shared_mutex mutex;
  Sink sink = &stderr_sink;
  void* user_data = nullptr;
  int32_t min_level = Warning;
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
  s.min_level = min_level;
}

void write(Level level, const std::string& message) {
  State& s = state();
  // Held shared while the sink runs, so set_sink never swaps a sink out from under a caller.
  std::shared_lock lock(s.mutex);
  if (level < s.min_level) return;
  s.sink(s.user_data, level, message.c_str());
}

}  // namespace libpipe::log
