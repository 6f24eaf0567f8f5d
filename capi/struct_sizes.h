// The sizes pipe.h's versioned structs (those that begin with `uint32_t struct_size`) have had, one
// per layout a libpipe version shipped: a caller's struct_size must be one of them. Fields are only
// ever appended, so each older layout is a prefix of today's struct, and its size is today's end of
// its last field rounded up to that layout's alignment. Written that way the table holds on any
// ABI; the numbers in the comments are the x86-64/AArch64 sizes each version's pipe.h gave (from
// `git log -p --follow capi/include/pipe/pipe.h.in`), checked by the static_asserts below.
// Internal: never installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>

#include "pipe/pipe.h"

namespace libpipe::capi {

// The size of a layout ending with `end` bytes of fields, padded as the compiler pads a struct
// whose strictest member needs `align`.
constexpr uint32_t layout_size(size_t end, size_t align) {
  return static_cast<uint32_t>((end + align - 1) / align * align);
}

// Where field `field` of `type` ends.
#define PIPE_FIELD_END(type, field) (offsetof(type, field) + sizeof(static_cast<type*>(nullptr)->field))

// Every layout below but the first of pipe_session_options holds a pointer, size_t, int64_t or
// double, the strictest members today's structs have, so it is aligned as today's struct is.
inline constexpr uint32_t kStageOptionsSizes[] = {
    // 0.2.0 (32): struct_size, dtype, weights, progress, progress_user_data.
    layout_size(PIPE_FIELD_END(pipe_stage_options, progress_user_data), alignof(pipe_stage_options)),
    // 0.13.0 (40): + quantize.
    layout_size(PIPE_FIELD_END(pipe_stage_options, quantize), alignof(pipe_stage_options)),
    // 0.14.0 (48): + quantize_group.
    layout_size(PIPE_FIELD_END(pipe_stage_options, quantize_group), alignof(pipe_stage_options)),
    // 0.16.0 (56): + quantize_head.
    layout_size(PIPE_FIELD_END(pipe_stage_options, quantize_head), alignof(pipe_stage_options)),
    // 0.17.0 (64): + quantize_embedding.
    layout_size(PIPE_FIELD_END(pipe_stage_options, quantize_embedding), alignof(pipe_stage_options)),
};

inline constexpr uint32_t kSessionOptionsSizes[] = {
    // 0.1.0, first header (12): struct_size, num_microbatches, threads_per_stage. The 0.1.0 header
    // then grew without a version bump, so programs built against 0.1.0 have either size.
    layout_size(PIPE_FIELD_END(pipe_session_options, threads_per_stage), alignof(int32_t)),
    // 0.1.0 (48): + max_inflight, input_specs, num_input_specs, output_specs, num_output_specs.
    layout_size(PIPE_FIELD_END(pipe_session_options, num_output_specs), alignof(pipe_session_options)),
    // 0.2.0 (56): + stage_options.
    layout_size(PIPE_FIELD_END(pipe_session_options, stage_options), alignof(pipe_session_options)),
    // 0.3.0 (64): + microbatching.
    layout_size(PIPE_FIELD_END(pipe_session_options, microbatching), alignof(pipe_session_options)),
    // 0.4.0 (88): + transport, world_size, store, comm_timeout_ms.
    layout_size(PIPE_FIELD_END(pipe_session_options, comm_timeout_ms), alignof(pipe_session_options)),
    // 0.5.0 (104): + devices, outputs.
    layout_size(PIPE_FIELD_END(pipe_session_options, outputs), alignof(pipe_session_options)),
    // 0.12.0 (112): + token.
    layout_size(PIPE_FIELD_END(pipe_session_options, token), alignof(pipe_session_options)),
};

inline constexpr uint32_t kRunOptionsSizes[] = {
    // 0.1.0 (16): struct_size, timeout_ms. Unchanged since.
    layout_size(PIPE_FIELD_END(pipe_run_options, timeout_ms), alignof(pipe_run_options)),
};

inline constexpr uint32_t kStageStatsSizes[] = {
    // 0.1.0 (48): struct_size, microbatches, failures, busy_ms, idle_ms, queue_depth. Unchanged since.
    layout_size(PIPE_FIELD_END(pipe_stage_stats, queue_depth), alignof(pipe_stage_stats)),
};

inline constexpr uint32_t kWorkerOptionsSizes[] = {
    // 0.4.0 (32): struct_size, rank, world_size, store, comm_timeout_ms, threads_per_stage.
    layout_size(PIPE_FIELD_END(pipe_worker_options, threads_per_stage), alignof(pipe_worker_options)),
    // 0.12.0 (40): + token.
    layout_size(PIPE_FIELD_END(pipe_worker_options, token), alignof(pipe_worker_options)),
};

inline constexpr uint32_t kGeneratorOptionsSizes[] = {
    // 0.8.0 (40): struct_size, max_queued, prefill_chunk, steps_in_flight, max_rows_per_step.
    layout_size(PIPE_FIELD_END(pipe_generator_options, max_rows_per_step), alignof(pipe_generator_options)),
};

inline constexpr uint32_t kGeneratorInfoSizes[] = {
    // 0.8.0 (40): struct_size, slots, max_len, vocab, cache_bytes_per_slot.
    layout_size(PIPE_FIELD_END(pipe_generator_info, cache_bytes_per_slot), alignof(pipe_generator_info)),
};

inline constexpr uint32_t kGenerationOptionsSizes[] = {
    // 0.8.0 (72): struct_size, max_new_tokens, temperature, top_k, top_p, seed, stop_ids, num_stop_ids,
    // timeout_ms.
    layout_size(PIPE_FIELD_END(pipe_generation_options, timeout_ms), alignof(pipe_generation_options)),
    // 0.14.0 (80): + logprobs, top_logprobs.
    layout_size(PIPE_FIELD_END(pipe_generation_options, top_logprobs), alignof(pipe_generation_options)),
    // 0.15.0 (88): + prompt_logprobs.
    layout_size(PIPE_FIELD_END(pipe_generation_options, prompt_logprobs), alignof(pipe_generation_options)),
};

inline constexpr uint32_t kGenerationInfoSizes[] = {
    // 0.8.0 (48): struct_size, finish_reason, prompt_tokens, generated_tokens, queued_ms,
    // time_to_first_token_ms, mean_inter_token_ms.
    layout_size(PIPE_FIELD_END(pipe_generation_info, mean_inter_token_ms), alignof(pipe_generation_info)),
    // 0.14.0 (56): + cached_tokens.
    layout_size(PIPE_FIELD_END(pipe_generation_info, cached_tokens), alignof(pipe_generation_info)),
};

inline constexpr uint32_t kGeneratorStatsSizes[] = {
    // 0.8.0 (96): struct_size, slots_in_use, queued, sequences_finished, prompt_tokens, generated_tokens,
    // steps, tokens_per_s, mean_time_to_first_token_ms, mean_inter_token_ms, mean_rows_per_step, sampling_ms.
    layout_size(PIPE_FIELD_END(pipe_generator_stats, sampling_ms), alignof(pipe_generator_stats)),
    // 0.11.0 (120): steps_in_flight, steps_one_at_a_time, steps_pipelined.
    layout_size(PIPE_FIELD_END(pipe_generator_stats, steps_pipelined), alignof(pipe_generator_stats)),
    // 0.14.0 (128): + cached_prompt_tokens.
    layout_size(PIPE_FIELD_END(pipe_generator_stats, cached_prompt_tokens), alignof(pipe_generator_stats)),
};

inline constexpr uint32_t kLaunchInfoSizes[] = {
    // 0.12.0 (324): struct_size, rank, world_size, local_rank, local_world_size, launcher, store.
    layout_size(PIPE_FIELD_END(pipe_launch_info, store), alignof(pipe_launch_info)),
};

#undef PIPE_FIELD_END

// A struct grown without its new layout listed here would refuse its own INIT macro: the last size
// must be today's.
template <size_t N>
constexpr uint32_t last(const uint32_t (&sizes)[N]) {
  return sizes[N - 1];
}
static_assert(last(kStageOptionsSizes) == sizeof(pipe_stage_options), "list pipe_stage_options' new layout");
static_assert(last(kSessionOptionsSizes) == sizeof(pipe_session_options), "list pipe_session_options' new layout");
static_assert(last(kRunOptionsSizes) == sizeof(pipe_run_options), "list pipe_run_options' new layout");
static_assert(last(kStageStatsSizes) == sizeof(pipe_stage_stats), "list pipe_stage_stats' new layout");
static_assert(last(kWorkerOptionsSizes) == sizeof(pipe_worker_options), "list pipe_worker_options' new layout");
static_assert(last(kGeneratorOptionsSizes) == sizeof(pipe_generator_options),
              "list pipe_generator_options' new layout");
static_assert(last(kGeneratorInfoSizes) == sizeof(pipe_generator_info), "list pipe_generator_info's new layout");
static_assert(last(kGenerationOptionsSizes) == sizeof(pipe_generation_options),
              "list pipe_generation_options' new layout");
static_assert(last(kGenerationInfoSizes) == sizeof(pipe_generation_info), "list pipe_generation_info's new layout");
static_assert(last(kGeneratorStatsSizes) == sizeof(pipe_generator_stats), "list pipe_generator_stats' new layout");
static_assert(last(kLaunchInfoSizes) == sizeof(pipe_launch_info), "list pipe_launch_info's new layout");

#if UINTPTR_MAX == UINT64_MAX && defined(__LP64__)
// The sizes each version's header gave on LP64, as recorded above.
static_assert(kStageOptionsSizes[0] == 32 && kStageOptionsSizes[1] == 40 && kStageOptionsSizes[2] == 48 &&
              kStageOptionsSizes[3] == 56 && kStageOptionsSizes[4] == 64);
static_assert(kSessionOptionsSizes[0] == 12 && kSessionOptionsSizes[1] == 48 && kSessionOptionsSizes[2] == 56 &&
              kSessionOptionsSizes[3] == 64 && kSessionOptionsSizes[4] == 88 && kSessionOptionsSizes[5] == 104 &&
              kSessionOptionsSizes[6] == 112);
static_assert(kRunOptionsSizes[0] == 16);
static_assert(kStageStatsSizes[0] == 48);
static_assert(kWorkerOptionsSizes[0] == 32 && kWorkerOptionsSizes[1] == 40);
static_assert(kGeneratorOptionsSizes[0] == 40 && kGeneratorInfoSizes[0] == 40 && kGenerationOptionsSizes[0] == 72 &&
              kGenerationOptionsSizes[1] == 80 && kGenerationOptionsSizes[2] == 88 && kGenerationInfoSizes[0] == 48 &&
              kGenerationInfoSizes[1] == 56 && kGeneratorStatsSizes[0] == 96 && kGeneratorStatsSizes[1] == 120 &&
              kGeneratorStatsSizes[2] == 128);
#endif

// One versioned struct: its name, how callers initialise it, and the sizes it has had.
struct VersionedStruct {
  const char* name;           // "pipe_session_options"
  const char* init_macro;     // "PIPE_SESSION_OPTIONS_INIT"
  const char* init_function;  // "pipe_session_options_init"
  const uint32_t* sizes;      // ascending
  size_t num_sizes;
};

inline constexpr VersionedStruct kStageOptions{"pipe_stage_options", "PIPE_STAGE_OPTIONS_INIT",
                                               "pipe_stage_options_init", kStageOptionsSizes,
                                               std::size(kStageOptionsSizes)};
inline constexpr VersionedStruct kSessionOptions{"pipe_session_options", "PIPE_SESSION_OPTIONS_INIT",
                                                 "pipe_session_options_init", kSessionOptionsSizes,
                                                 std::size(kSessionOptionsSizes)};
inline constexpr VersionedStruct kRunOptions{"pipe_run_options", "PIPE_RUN_OPTIONS_INIT", "pipe_run_options_init",
                                             kRunOptionsSizes, std::size(kRunOptionsSizes)};
inline constexpr VersionedStruct kStageStats{"pipe_stage_stats", "PIPE_STAGE_STATS_INIT", "pipe_stage_stats_init",
                                             kStageStatsSizes, std::size(kStageStatsSizes)};
inline constexpr VersionedStruct kWorkerOptions{"pipe_worker_options", "PIPE_WORKER_OPTIONS_INIT",
                                                "pipe_worker_options_init", kWorkerOptionsSizes,
                                                std::size(kWorkerOptionsSizes)};
inline constexpr VersionedStruct kGeneratorOptions{"pipe_generator_options", "PIPE_GENERATOR_OPTIONS_INIT",
                                                   "pipe_generator_options_init", kGeneratorOptionsSizes,
                                                   std::size(kGeneratorOptionsSizes)};
inline constexpr VersionedStruct kGeneratorInfo{"pipe_generator_info", "PIPE_GENERATOR_INFO_INIT",
                                                "pipe_generator_info_init", kGeneratorInfoSizes,
                                                std::size(kGeneratorInfoSizes)};
inline constexpr VersionedStruct kGenerationOptions{"pipe_generation_options", "PIPE_GENERATION_OPTIONS_INIT",
                                                    "pipe_generation_options_init", kGenerationOptionsSizes,
                                                    std::size(kGenerationOptionsSizes)};
inline constexpr VersionedStruct kGenerationInfo{"pipe_generation_info", "PIPE_GENERATION_INFO_INIT",
                                                 "pipe_generation_info_init", kGenerationInfoSizes,
                                                 std::size(kGenerationInfoSizes)};
inline constexpr VersionedStruct kGeneratorStats{"pipe_generator_stats", "PIPE_GENERATOR_STATS_INIT",
                                                 "pipe_generator_stats_init", kGeneratorStatsSizes,
                                                 std::size(kGeneratorStatsSizes)};
inline constexpr VersionedStruct kLaunchInfo{"pipe_launch_info", "PIPE_LAUNCH_INFO_INIT", "pipe_launch_info_init",
                                             kLaunchInfoSizes, std::size(kLaunchInfoSizes)};

// Error(InvalidArgument) unless `size` is one of `s`'s sizes. `function` is the exported function
// and `what` the argument as the caller knows it ("options->struct_size"), both named in the
// message with the sizes accepted and how to initialise the struct.
void require_struct_size(size_t size, const VersionedStruct& s, const char* function, const char* what);

}  // namespace libpipe::capi
