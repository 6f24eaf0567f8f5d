// The C ABI: pipe_*_init, the *_INIT macros of the versioned structs callable at run time, so that
// bindings in other languages take libpipe's defaults instead of copying them.
#include <cstring>

#include "capi/boundary.h"
#include "capi/struct_sizes.h"

using namespace libpipe::capi;

namespace {

// Sets `*out` to `defaults` over the first `struct_size` bytes (a caller built against an older
// pipe.h has only those), with struct_size saying so; nothing past them is written.
template <typename T>
pipe_status init(const char* function, const char* param, T* out, size_t struct_size, const VersionedStruct& s,
                 const T& defaults) {
  return guarded(function, [&](const char* fn) {
    require(out, fn, param);
    require_struct_size(struct_size, s, fn, "struct_size");
    T value = defaults;
    value.struct_size = static_cast<uint32_t>(struct_size);
    std::memcpy(out, &value, struct_size);
  });
}

}  // namespace

extern "C" {

pipe_status pipe_stage_options_init(pipe_stage_options* options, size_t struct_size) {
  static const pipe_stage_options defaults = PIPE_STAGE_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kStageOptions, defaults);
}

pipe_status pipe_session_options_init(pipe_session_options* options, size_t struct_size) {
  static const pipe_session_options defaults = PIPE_SESSION_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kSessionOptions, defaults);
}

pipe_status pipe_run_options_init(pipe_run_options* options, size_t struct_size) {
  static const pipe_run_options defaults = PIPE_RUN_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kRunOptions, defaults);
}

pipe_status pipe_stage_stats_init(pipe_stage_stats* stats, size_t struct_size) {
  static const pipe_stage_stats defaults = PIPE_STAGE_STATS_INIT;
  return init(__func__, "stats", stats, struct_size, kStageStats, defaults);
}

pipe_status pipe_worker_options_init(pipe_worker_options* options, size_t struct_size) {
  static const pipe_worker_options defaults = PIPE_WORKER_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kWorkerOptions, defaults);
}

pipe_status pipe_generator_options_init(pipe_generator_options* options, size_t struct_size) {
  static const pipe_generator_options defaults = PIPE_GENERATOR_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kGeneratorOptions, defaults);
}

pipe_status pipe_generator_info_init(pipe_generator_info* info, size_t struct_size) {
  static const pipe_generator_info defaults = PIPE_GENERATOR_INFO_INIT;
  return init(__func__, "info", info, struct_size, kGeneratorInfo, defaults);
}

pipe_status pipe_generation_options_init(pipe_generation_options* options, size_t struct_size) {
  static const pipe_generation_options defaults = PIPE_GENERATION_OPTIONS_INIT;
  return init(__func__, "options", options, struct_size, kGenerationOptions, defaults);
}

pipe_status pipe_generation_info_init(pipe_generation_info* info, size_t struct_size) {
  static const pipe_generation_info defaults = PIPE_GENERATION_INFO_INIT;
  return init(__func__, "info", info, struct_size, kGenerationInfo, defaults);
}

pipe_status pipe_generator_stats_init(pipe_generator_stats* stats, size_t struct_size) {
  static const pipe_generator_stats defaults = PIPE_GENERATOR_STATS_INIT;
  return init(__func__, "stats", stats, struct_size, kGeneratorStats, defaults);
}

pipe_status pipe_launch_info_init(pipe_launch_info* info, size_t struct_size) {
  static const pipe_launch_info defaults = PIPE_LAUNCH_INFO_INIT;
  return init(__func__, "info", info, struct_size, kLaunchInfo, defaults);
}

}  // extern "C"
