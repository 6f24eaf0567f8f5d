// Process-wide log sink. The C ABI lets users replace it (pipe_set_log_callback); the default
// writes warnings and errors to stderr.
#pragma once

#include <cstdint>
#include <string>

namespace libpipe::log {

enum Level : int32_t { Debug = 0, Info = 1, Warning = 2, Error = 3 };

using Sink = void (*)(void* user_data, int32_t level, const char* message);

// Installs `sink` (nullptr: the default stderr sink). Thread-safe.
void set_sink(Sink sink, void* user_data, int32_t min_level);

// Sends `message` to the current sink if `level` passes its threshold. Thread-safe.
void write(Level level, const std::string& message);

inline void warning(const std::string& message) { write(Warning, message); }
inline void debug(const std::string& message) { write(Debug, message); }
inline void info(const std::string& message) { write(Info, message); }

}  // namespace libpipe::log
