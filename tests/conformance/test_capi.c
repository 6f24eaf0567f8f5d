/* Conformance tests of the C ABI (pipe/pipe.h), in C, against libpipe.so: the seed models split
 * and run correctly, and every failure path returns its status and a message without touching
 * outputs. Fixtures come from tests/models/seed_models.py; PIPE_TEST_MODELS names their folder. */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <pipe/pipe.h>

#include "../gate/gate.h"
#include "worker_threads.h"

/* ---- the ABI's layout, frozen: a change here is an ABI break (see README) ------------------- */

_Static_assert(PIPE_OK == 0 && PIPE_ERR_INVALID_ARGUMENT == 1 && PIPE_ERR_NOT_FOUND == 2 &&
                   PIPE_ERR_INVALID_FORMAT == 3 && PIPE_ERR_SPLIT == 4 && PIPE_ERR_INPUT == 5 &&
                   PIPE_ERR_EXECUTION == 6 && PIPE_ERR_IO == 7 && PIPE_ERR_OUT_OF_MEMORY == 8 &&
                   PIPE_ERR_UNSUPPORTED == 9 && PIPE_ERR_INTERNAL == 10 && PIPE_ERR_TIMEOUT == 11 &&
                   PIPE_ERR_CANCELLED == 12 && PIPE_ERR_DEADLINE_EXCEEDED == 13,
               "status codes");
_Static_assert(sizeof(pipe_status) == 4, "pipe_status is int32_t");
_Static_assert(PIPE_LOG_DEBUG == 0 && PIPE_LOG_INFO == 1 && PIPE_LOG_WARNING == 2 && PIPE_LOG_ERROR == 3, "log");
_Static_assert(PIPE_NAMES_PARAMETERS == 0 && PIPE_NAMES_BUFFERS == 1, "names");
_Static_assert(PIPE_CHUNK_DEFAULT == 0 && PIPE_CHUNK_SPLIT == 1 && PIPE_CHUNK_REPLICATE == 2 &&
                   PIPE_CHUNK_CONCAT == 3 && PIPE_CHUNK_SUM == 4 && PIPE_CHUNK_EQUAL == 5,
               "chunk kinds");
_Static_assert(sizeof(pipe_chunk_spec) == 8 && offsetof(pipe_chunk_spec, kind) == 0 &&
                   offsetof(pipe_chunk_spec, dim) == 4,
               "pipe_chunk_spec");
_Static_assert(sizeof(pipe_stage_options) == 64 && offsetof(pipe_stage_options, struct_size) == 0 &&
                   offsetof(pipe_stage_options, dtype) == 4 && offsetof(pipe_stage_options, weights) == 8 &&
                   offsetof(pipe_stage_options, progress) == 16 &&
                   offsetof(pipe_stage_options, progress_user_data) == 24 &&
                   offsetof(pipe_stage_options, quantize) == 32 && offsetof(pipe_stage_options, quantize_group) == 40 &&
                   offsetof(pipe_stage_options, quantize_head) == 48 &&
                   offsetof(pipe_stage_options, quantize_embedding) == 56,
               "pipe_stage_options");
_Static_assert(PIPE_QUANTIZE_NONE == 0 && PIPE_QUANTIZE_INT8 == 1 && PIPE_QUANTIZE_INT4 == 2, "quantization kinds");
_Static_assert(PIPE_QUANTIZE_HEAD_DEFAULT == 0 && PIPE_QUANTIZE_HEAD_INT8 == PIPE_QUANTIZE_INT8 &&
                   PIPE_QUANTIZE_HEAD_INT4 == PIPE_QUANTIZE_INT4 && PIPE_QUANTIZE_HEAD_NONE == 3,
               "head quantization kinds");
_Static_assert(PIPE_QUANTIZE_EMBEDDING_NONE == 0 && PIPE_QUANTIZE_EMBEDDING_INT8 == 1, "embedding quantization kinds");
_Static_assert(PIPE_DTYPE_KEEP == 0 && PIPE_DTYPE_FLOAT32 == 1 && PIPE_DTYPE_FLOAT16 == 2 && PIPE_DTYPE_BFLOAT16 == 3,
               "dtypes");
_Static_assert(
    sizeof(pipe_session_options) == 112 && offsetof(pipe_session_options, struct_size) == 0 &&
        offsetof(pipe_session_options, num_microbatches) == 4 &&
        offsetof(pipe_session_options, threads_per_stage) == 8 && offsetof(pipe_session_options, max_inflight) == 12 &&
        offsetof(pipe_session_options, input_specs) == 16 && offsetof(pipe_session_options, num_input_specs) == 24 &&
        offsetof(pipe_session_options, output_specs) == 32 && offsetof(pipe_session_options, num_output_specs) == 40 &&
        offsetof(pipe_session_options, stage_options) == 48 && offsetof(pipe_session_options, microbatching) == 56 &&
        offsetof(pipe_session_options, transport) == 60 && offsetof(pipe_session_options, world_size) == 64 &&
        offsetof(pipe_session_options, store) == 72 && offsetof(pipe_session_options, comm_timeout_ms) == 80 &&
        offsetof(pipe_session_options, devices) == 88 && offsetof(pipe_session_options, outputs) == 96 &&
        offsetof(pipe_session_options, token) == 104,
    "pipe_session_options");
_Static_assert(PIPE_OUTPUTS_ON_CPU == 0 && PIPE_OUTPUTS_ON_DEVICE == 1, "output placements");
_Static_assert(sizeof(pipe_worker_options) == 40 && offsetof(pipe_worker_options, rank) == 4 &&
                   offsetof(pipe_worker_options, world_size) == 8 && offsetof(pipe_worker_options, store) == 16 &&
                   offsetof(pipe_worker_options, comm_timeout_ms) == 24 &&
                   offsetof(pipe_worker_options, threads_per_stage) == 28 && offsetof(pipe_worker_options, token) == 32,
               "pipe_worker_options");
_Static_assert(sizeof(pipe_launch_info) == 324 && offsetof(pipe_launch_info, rank) == 4 &&
                   offsetof(pipe_launch_info, world_size) == 8 && offsetof(pipe_launch_info, local_rank) == 12 &&
                   offsetof(pipe_launch_info, local_world_size) == 16 && offsetof(pipe_launch_info, launcher) == 20 &&
                   offsetof(pipe_launch_info, store) == 36,
               "pipe_launch_info");
_Static_assert(PIPE_ERR_COMMUNICATION == 14 && PIPE_TRANSPORT_LOCAL == 0 && PIPE_TRANSPORT_TCP == 1 &&
                   PIPE_TRANSPORT_GLOO == PIPE_TRANSPORT_TCP && PIPE_TRANSPORT_NCCL == 2,
               "transports");
_Static_assert(PIPE_MICROBATCHING_ADAPTIVE == 0 && PIPE_MICROBATCHING_FIXED == 1, "microbatching");
_Static_assert(sizeof(pipe_run_options) == 16 && offsetof(pipe_run_options, struct_size) == 0 &&
                   offsetof(pipe_run_options, timeout_ms) == 8,
               "pipe_run_options");
_Static_assert(sizeof(pipe_stage_stats) == 48 && offsetof(pipe_stage_stats, struct_size) == 0 &&
                   offsetof(pipe_stage_stats, microbatches) == 8 && offsetof(pipe_stage_stats, failures) == 16 &&
                   offsetof(pipe_stage_stats, busy_ms) == 24 && offsetof(pipe_stage_stats, idle_ms) == 32 &&
                   offsetof(pipe_stage_stats, queue_depth) == 40,
               "pipe_stage_stats");

static const char *models_dir(void) {
  const char *dir = getenv("PIPE_TEST_MODELS");
  return dir ? dir : ".";
}

static const char *fixture(const char *name) {
  static _Thread_local char path[4096];
  snprintf(path, sizeof path, "%s/%s", models_dir(), name);
  return path;
}

#define ASSERT_OK(call)                                                                              \
  do {                                                                                               \
    pipe_status st_ = (call);                                                                        \
    if (st_ != PIPE_OK) fail_msg("%s -> %s: %s", #call, pipe_status_string(st_), pipe_last_error()); \
  } while (0)

/* Asserts a call fails with `status` and leaves a non-empty message containing `needle`. */
#define ASSERT_FAILS(call, status, needle)                                                           \
  do {                                                                                               \
    pipe_status st_ = (call);                                                                        \
    if (st_ != (status))                                                                             \
      fail_msg("%s -> %s (want %s): %s", #call, pipe_status_string(st_), pipe_status_string(status), \
               pipe_last_error());                                                                   \
    if (strstr(pipe_last_error(), (needle)) == NULL)                                                 \
      fail_msg("%s: message '%s' does not mention '%s'", #call, pipe_last_error(), (needle));        \
  } while (0)

/* ---- helpers ---------------------------------------------------------------------------- */

typedef struct {
  pipe_model *model;
  pipe_plan *plan;
  pipe_tensor_list *inputs;
  pipe_tensor_list *expected;
  const DLManagedTensor *args[8];
  size_t num_args;
} loaded;

static void load_fixture(loaded *l, const char *model_file, const char *stem) {
  char name[256];
  memset(l, 0, sizeof *l);
  ASSERT_OK(pipe_model_load(fixture(model_file), &l->model));
  ASSERT_OK(pipe_plan_create(l->model, NULL, &l->plan));
  snprintf(name, sizeof name, "%s.inputs.safetensors", stem);
  ASSERT_OK(pipe_safetensors_read(fixture(name), &l->inputs));
  snprintf(name, sizeof name, "%s.expected.safetensors", stem);
  ASSERT_OK(pipe_safetensors_read(fixture(name), &l->expected));
  ASSERT_OK(pipe_model_num_inputs(l->model, &l->num_args));
  assert_true(l->num_args <= 8);
  for (size_t i = 0; i < l->num_args; ++i) {
    const char *input = NULL;
    size_t index = 0;
    ASSERT_OK(pipe_model_input_name(l->model, i, &input));
    ASSERT_OK(pipe_tensor_list_find(l->inputs, input, &index));
    ASSERT_OK(pipe_tensor_list_get(l->inputs, index, &l->args[i]));
  }
}

static void unload(loaded *l) {
  pipe_tensor_list_destroy(l->expected);
  pipe_tensor_list_destroy(l->inputs);
  pipe_plan_destroy(l->plan);
  pipe_model_destroy(l->model);
}

static int64_t numel(const DLTensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

static const float *floats(const DLTensor *t) { return (const float *)((const char *)t->data + t->byte_offset); }

/* Asserts `got` equals `want` (float32, same shape) within rtol = atol = 1e-5. */
static void assert_close(const DLManagedTensor *got, const DLManagedTensor *want) {
  const DLTensor *a = &got->dl_tensor, *b = &want->dl_tensor;
  assert_int_equal(a->dtype.code, kDLFloat);
  assert_int_equal(a->dtype.bits, 32);
  assert_int_equal(a->ndim, b->ndim);
  for (int d = 0; d < a->ndim; ++d) assert_int_equal(a->shape[d], b->shape[d]);
  if (a->strides) { /* NULL strides mean compact row-major; otherwise they must say the same */
    int64_t expect = 1;
    for (int d = a->ndim - 1; d >= 0; --d) {
      if (a->shape[d] != 1) assert_int_equal(a->strides[d], expect);
      expect *= a->shape[d];
    }
  }
  const float *x = floats(a), *y = floats(b);
  for (int64_t i = 0; i < numel(a); ++i)
    if (fabsf(x[i] - y[i]) > 1e-5f + 1e-5f * fabsf(y[i]))
      fail_msg("element %lld: got %g, want %g", (long long)i, x[i], y[i]);
}

static void run_and_compare(loaded *l, int32_t microbatches) {
  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.num_microbatches = microbatches;
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_create(l->plan, &options, &session));
  ASSERT_OK(pipe_session_run(session, l->args, l->num_args, NULL, &out));

  size_t count = 0, got_index = 0, want_index = 0;
  const char *name = NULL;
  ASSERT_OK(pipe_tensor_list_size(out, &count));
  assert_int_equal(count, 1);
  ASSERT_OK(pipe_tensor_list_name(out, 0, &name));
  assert_string_equal(name, "output");
  ASSERT_OK(pipe_tensor_list_find(out, "output", &got_index));
  ASSERT_OK(pipe_tensor_list_find(l->expected, "output", &want_index));
  const DLManagedTensor *got = NULL, *want = NULL;
  ASSERT_OK(pipe_tensor_list_get(out, got_index, &got));
  ASSERT_OK(pipe_tensor_list_get(l->expected, want_index, &want));
  assert_close(got, want);
  pipe_tensor_list_destroy(out);
  pipe_session_destroy(session);
}

/* Asserts every parameter and buffer name of every stage is a key of the eager state_dict. */
static void assert_names_in_state_dict(const pipe_plan *plan, const char *stem) {
  char file[256], keys[16384];
  snprintf(file, sizeof file, "%s.state_dict.txt", stem);
  FILE *f = fopen(fixture(file), "r");
  assert_non_null(f);
  size_t n = fread(keys + 1, 1, sizeof keys - 2, f);
  fclose(f);
  keys[0] = '\n';
  keys[n + 1] = '\0';
  size_t stages = 0;
  ASSERT_OK(pipe_plan_num_stages(plan, &stages));
  for (size_t s = 0; s < stages; ++s) {
    for (int32_t kind = PIPE_NAMES_PARAMETERS; kind <= PIPE_NAMES_BUFFERS; ++kind) {
      size_t count = 0;
      ASSERT_OK(pipe_plan_stage_count_names(plan, s, kind, &count));
      for (size_t i = 0; i < count; ++i) {
        const char *name = NULL;
        char line[512];
        ASSERT_OK(pipe_plan_stage_name(plan, s, kind, i, &name));
        snprintf(line, sizeof line, "\n%s\n", name);
        if (!strstr(keys, line)) fail_msg("stage %zu holds '%s', not a state_dict key", s, name);
      }
    }
  }
}

static int stage_has_parameter(const pipe_plan *plan, size_t stage, const char *name) {
  size_t count = 0;
  ASSERT_OK(pipe_plan_stage_count_names(plan, stage, PIPE_NAMES_PARAMETERS, &count));
  for (size_t i = 0; i < count; ++i) {
    const char *n = NULL;
    ASSERT_OK(pipe_plan_stage_name(plan, stage, PIPE_NAMES_PARAMETERS, i, &n));
    if (strcmp(n, name) == 0) return 1;
  }
  return 0;
}

/* ---- seed models ------------------------------------------------------------------------ */

static void check_seed_model(const char *model_file, const char *stem, size_t want_stages) {
  loaded l;
  load_fixture(&l, model_file, stem);
  size_t stages = 0;
  ASSERT_OK(pipe_plan_num_stages(l.plan, &stages));
  assert_int_equal(stages, want_stages);
  assert_names_in_state_dict(l.plan, stem);
  run_and_compare(&l, 1);
  run_and_compare(&l, 2);
  run_and_compare(&l, 4);
  unload(&l);
}

static void example_code_traced(void **state) {
  (void)state;
  check_seed_model("example_code.traced.pt", "example_code", 4);
  /* mm_param1 is read by stages 0 and 1, so both hold it. */
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  assert_true(stage_has_parameter(l.plan, 0, "mm_param1"));
  assert_true(stage_has_parameter(l.plan, 1, "mm_param1"));
  assert_false(stage_has_parameter(l.plan, 2, "mm_param1"));
  assert_true(stage_has_parameter(l.plan, 2, "mm_param2"));
  assert_true(stage_has_parameter(l.plan, 3, "lin2.weight"));
  unload(&l);
}

static void example_code_scripted(void **state) {
  (void)state;
  check_seed_model("example_code.scripted.pt", "example_code", 4);
}

static void multi_mlp_traced(void **state) {
  (void)state;
  check_seed_model("multi_mlp.traced.pt", "multi_mlp", 4);
}

static void param_alias_scripted(void **state) {
  (void)state;
  check_seed_model("param_alias.scripted.pt", "param_alias", 2);
}

/* The same seed models exported with torch.export (tests/models/exported_models.py): the same
 * stages at their pipe.split markers, the same results, through the same calls. */
static void exported_seed_models(void **state) {
  (void)state;
  check_seed_model("exported/example_code.pt2", "exported/example_code", 4);
  check_seed_model("exported/multi_mlp.pt2", "exported/multi_mlp", 4);
  check_seed_model("exported/param_alias.pt2", "exported/param_alias", 2);
}

static void model_format_says_what_was_loaded(void **state) {
  (void)state;
  pipe_model *scripted = NULL, *exported = NULL;
  ASSERT_OK(pipe_model_load(fixture("example_code.traced.pt"), &scripted));
  ASSERT_OK(pipe_model_load(fixture("exported/example_code.pt2"), &exported));
  int32_t format = -1;
  ASSERT_OK(pipe_model_format(scripted, &format));
  assert_int_equal(format, PIPE_MODEL_TORCHSCRIPT);
  ASSERT_OK(pipe_model_format(exported, &format));
  assert_int_equal(format, PIPE_MODEL_EXPORTED);
  format = -1;
  ASSERT_FAILS(pipe_model_format(NULL, &format), PIPE_ERR_INVALID_ARGUMENT, "model");
  ASSERT_FAILS(pipe_model_format(exported, NULL), PIPE_ERR_INVALID_ARGUMENT, "format");
  assert_int_equal(format, -1); /* outputs are written only on success */
  pipe_model_destroy(exported);
  pipe_model_destroy(scripted);
}

/* ---- version and status ----------------------------------------------------------------- */

static void version_matches_macros(void **state) {
  (void)state;
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", PIPE_VERSION_MAJOR, PIPE_VERSION_MINOR, PIPE_VERSION_PATCH);
  assert_string_equal(pipe_version(), want);
}

static void status_strings_name_codes(void **state) {
  (void)state;
  assert_string_equal(pipe_status_string(PIPE_OK), "PIPE_OK");
  assert_string_equal(pipe_status_string(PIPE_ERR_INVALID_ARGUMENT), "PIPE_ERR_INVALID_ARGUMENT");
  assert_string_equal(pipe_status_string(PIPE_ERR_NOT_FOUND), "PIPE_ERR_NOT_FOUND");
  assert_string_equal(pipe_status_string(PIPE_ERR_INPUT), "PIPE_ERR_INPUT");
  assert_string_equal(pipe_status_string(PIPE_ERR_INTERNAL), "PIPE_ERR_INTERNAL");
  assert_string_equal(pipe_status_string(12345), "PIPE_ERR_UNKNOWN");
  assert_string_equal(pipe_status_string(-1), "PIPE_ERR_UNKNOWN");
}

/* ---- failure paths ---------------------------------------------------------------------- */

static void missing_model_file(void **state) {
  (void)state;
  pipe_model *model = (pipe_model *)0x1; /* sentinel: must stay untouched */
  ASSERT_FAILS(pipe_model_load("/nonexistent/model.pt", &model), PIPE_ERR_NOT_FOUND, "/nonexistent/model.pt");
  assert_ptr_equal(model, (pipe_model *)0x1);
}

static void junk_model_file(void **state) {
  (void)state;
  /* A safetensors file is a real file that is not TorchScript. */
  pipe_model *model = NULL;
  ASSERT_FAILS(pipe_model_load(fixture("example_code.inputs.safetensors"), &model), PIPE_ERR_INVALID_FORMAT,
               "TorchScript");
  assert_null(model);

  /* A model file cut short (an interrupted copy) is refused before LibTorch reads it. */
  FILE *in = fopen(fixture("example_code.traced.pt"), "rb");
  assert_non_null(in);
  fseek(in, 0, SEEK_END);
  const size_t size = (size_t)ftell(in);
  rewind(in);
  char *bytes = malloc(size);
  assert_non_null(bytes);
  assert_int_equal(fread(bytes, 1, size, in), size);
  fclose(in);
  char path[] = "/tmp/libpipe-truncated-XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, bytes, size / 2), (ssize_t)(size / 2));
  close(fd);
  free(bytes);
  ASSERT_FAILS(pipe_model_load(path, &model), PIPE_ERR_INVALID_FORMAT, "damaged");
  assert_null(model);
  unlink(path);
}

/* A tensor on a CUDA device, on a machine (or build) that cannot run one: refused up front. */
static void input_on_a_cuda_device(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session *session = NULL;
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  DLManagedTensor on_gpu = *l.args[0];
  on_gpu.dl_tensor.device.device_type = kDLCUDA;
  on_gpu.deleter = NULL;
  const DLManagedTensor *args[2] = {&on_gpu, l.args[1]};
  pipe_tensor_list *out = NULL;
  ASSERT_FAILS(pipe_session_run(session, args, 2, NULL, &out), PIPE_ERR_INPUT, "cuda");
  assert_null(out);
  pipe_session_destroy(session);
  unload(&l);
}

static void null_arguments(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  size_t count = 0;
  const char *name = NULL;

  ASSERT_FAILS(pipe_model_load(NULL, &model), PIPE_ERR_INVALID_ARGUMENT, "path is NULL");
  ASSERT_FAILS(pipe_model_load(fixture("example_code.traced.pt"), NULL), PIPE_ERR_INVALID_ARGUMENT, "model is NULL");
  ASSERT_FAILS(pipe_model_num_inputs(NULL, &count), PIPE_ERR_INVALID_ARGUMENT, "model is NULL");
  ASSERT_FAILS(pipe_model_input_name(l.model, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "name is NULL");
  ASSERT_FAILS(pipe_model_input_name(l.model, 2, &name), PIPE_ERR_INVALID_ARGUMENT, "out of range");
  ASSERT_FAILS(pipe_plan_create(NULL, NULL, &plan), PIPE_ERR_INVALID_ARGUMENT, "model is NULL");
  ASSERT_FAILS(pipe_plan_create(l.model, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_num_stages(NULL, &count), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_stage_count_names(l.plan, 9, PIPE_NAMES_PARAMETERS, &count), PIPE_ERR_INVALID_ARGUMENT,
               "stage 9 is out of range");
  ASSERT_FAILS(pipe_plan_stage_count_names(l.plan, 0, 42, &count), PIPE_ERR_INVALID_ARGUMENT, "PIPE_NAMES_");
  ASSERT_FAILS(pipe_plan_describe(l.plan, NULL), PIPE_ERR_INVALID_ARGUMENT, "json is NULL");
  ASSERT_FAILS(pipe_session_create(NULL, NULL, &session), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_session_create(l.plan, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_run(NULL, l.args, 2, NULL, &out), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  ASSERT_FAILS(pipe_session_run(session, NULL, 2, NULL, &out), PIPE_ERR_INVALID_ARGUMENT, "inputs is NULL");
  ASSERT_FAILS(pipe_session_run(session, l.args, 2, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "outputs is NULL");
  const DLManagedTensor *with_null[2] = {l.args[0], NULL};
  ASSERT_FAILS(pipe_session_run(session, with_null, 2, NULL, &out), PIPE_ERR_INVALID_ARGUMENT, "inputs[1] is NULL");
  ASSERT_FAILS(pipe_safetensors_read(NULL, &out), PIPE_ERR_INVALID_ARGUMENT, "path is NULL");
  ASSERT_FAILS(pipe_tensor_list_size(NULL, &count), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_set_log_callback(NULL, NULL, 7), PIPE_ERR_INVALID_ARGUMENT, "min_level");
  assert_null(model);
  assert_null(plan);
  assert_null(out);

  /* destroy(NULL) is harmless. */
  pipe_model_destroy(NULL);
  pipe_plan_destroy(NULL);
  pipe_session_destroy(NULL);
  pipe_tensor_list_destroy(NULL);
  pipe_session_destroy(session);
  unload(&l);
}

static void wrong_number_of_inputs(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session *session = NULL;
  pipe_tensor_list *out = (pipe_tensor_list *)0x1;
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  ASSERT_FAILS(pipe_session_run(session, l.args, 1, NULL, &out), PIPE_ERR_INPUT,
               "takes 2 inputs (x, y) but 1 were given");
  const DLManagedTensor *three[3] = {l.args[0], l.args[1], l.args[0]};
  ASSERT_FAILS(pipe_session_run(session, three, 3, NULL, &out), PIPE_ERR_INPUT, "but 3 were given");
  ASSERT_FAILS(pipe_session_run(session, NULL, 0, NULL, &out), PIPE_ERR_INPUT, "but 0 were given");
  assert_ptr_equal(out, (pipe_tensor_list *)0x1);
  pipe_session_destroy(session);
  unload(&l);
}

static void bad_options(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session *session = NULL;
  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.struct_size = 0;
  ASSERT_FAILS(pipe_session_create(l.plan, &options, &session), PIPE_ERR_INVALID_ARGUMENT, "PIPE_SESSION_OPTIONS_INIT");
  pipe_session_options zero = PIPE_SESSION_OPTIONS_INIT;
  zero.num_microbatches = 0;
  ASSERT_FAILS(pipe_session_create(l.plan, &zero, &session), PIPE_ERR_INVALID_ARGUMENT,
               "num_microbatches must be at least 1");
  pipe_session_options mode = PIPE_SESSION_OPTIONS_INIT;
  mode.microbatching = 7;
  ASSERT_FAILS(pipe_session_create(l.plan, &mode, &session), PIPE_ERR_INVALID_ARGUMENT,
               "use PIPE_MICROBATCHING_ADAPTIVE or PIPE_MICROBATCHING_FIXED");
  pipe_session_options negative = PIPE_SESSION_OPTIONS_INIT;
  negative.threads_per_stage = -2;
  ASSERT_FAILS(pipe_session_create(l.plan, &negative, &session), PIPE_ERR_INVALID_ARGUMENT, "threads_per_stage");
  /* An older caller (the first 0.1 layout, 12 bytes) whose struct ends before max_inflight gets
   * that field's default. */
  pipe_session_options old = PIPE_SESSION_OPTIONS_INIT;
  old.struct_size = 12;
  old.num_microbatches = 2;
  old.max_inflight = -99; /* beyond struct_size: must be ignored */
  ASSERT_OK(pipe_session_create(l.plan, &old, &session));
  pipe_session_destroy(session);
  /* A size no version of libpipe ever had is refused, naming the sizes it takes. */
  old.struct_size = 8;
  ASSERT_FAILS(pipe_session_create(l.plan, &old, &session), PIPE_ERR_INVALID_ARGUMENT, "struct_size");
  unload(&l);
}

/* Stages placed on devices: an explicit all-CPU placement computes what the default one does;
 * a GPU that is not there, a malformed list and one of the wrong length are refused before any
 * stage is built, each naming what was wrong. */
static void device_placement(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code"); /* 4 stages */
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  const DLManagedTensor *got = NULL, *want = NULL;
  size_t index = 0;
  ASSERT_OK(pipe_tensor_list_find(l.expected, "output", &index));
  ASSERT_OK(pipe_tensor_list_get(l.expected, index, &want));
  const char *cpu_lists[] = {"cpu,cpu,cpu,cpu", " cpu , cpu,cpu,cpu ", "cpu"};
  for (size_t i = 0; i < sizeof cpu_lists / sizeof *cpu_lists; ++i) {
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    o.num_microbatches = 2;
    o.devices = cpu_lists[i];
    o.outputs = i == 2 ? PIPE_OUTPUTS_ON_DEVICE : PIPE_OUTPUTS_ON_CPU; /* the CPU is the last device */
    ASSERT_OK(pipe_session_create(l.plan, &o, &session));
    ASSERT_OK(pipe_session_run(session, l.args, l.num_args, NULL, &out));
    ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
    assert_int_equal(got->dl_tensor.device.device_type, kDLCPU);
    assert_close(got, want);
    pipe_tensor_list_destroy(out);
    pipe_session_destroy(session);
  }
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.devices = "cpu,cuda:64,cpu,cpu";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_UNSUPPORTED, "stage 1 is on cuda:64");
  o.devices = "cpu,gpu0,cpu,cpu";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "'gpu0'");
  o.devices = "cpu,,cpu,cpu";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "empty entry");
  o.devices = "cpu,cpu";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT,
               "names 2 devices but the plan has 4 stages");
  o.devices = NULL;
  o.outputs = 5;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT,
               "PIPE_OUTPUTS_ON_CPU or PIPE_OUTPUTS_ON_DEVICE");
  /* A 0.4 caller's struct ends before `devices`: whatever lies beyond it is not read. */
  pipe_session_options old = PIPE_SESSION_OPTIONS_INIT;
  old.struct_size = (uint32_t)offsetof(pipe_session_options, devices);
  old.devices = "not a device list";
  old.outputs = 5;
  ASSERT_OK(pipe_session_create(l.plan, &old, &session));
  pipe_session_destroy(session);
  unload(&l);
}

/* Sessions over processes: every option is checked before anything listens or waits, and each
 * unusable address or missing worker is a PIPE_ERR_COMMUNICATION that says what to do. */
static void distributed_options(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "multi_mlp.traced.pt", "multi_mlp"); /* 4 stages */
  pipe_session *session = NULL;
  assert_string_equal(pipe_status_string(PIPE_ERR_COMMUNICATION), "PIPE_ERR_COMMUNICATION");

  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.transport = 7;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "PIPE_TRANSPORT_TCP");
  assert_int_equal(PIPE_TRANSPORT_GLOO, PIPE_TRANSPORT_TCP); /* the name before 0.12 */
  o.transport = PIPE_TRANSPORT_TCP;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "world_size >= 2");
  o.transport = PIPE_TRANSPORT_LOCAL;
  o.store = "127.0.0.1:29999";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT,
               "store is set but the transport is local");
  o.store = NULL;
  o.transport = PIPE_TRANSPORT_LOCAL;
  o.world_size = 2;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "choose the TCP or NCCL");
  o.transport = PIPE_TRANSPORT_TCP;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "store address");
  o.store = "no-port-here";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "HOST:PORT");
  o.store = "127.0.0.1:29999";
  o.world_size = 5;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "at most 4 processes");
  o.world_size = 2;
  o.comm_timeout_ms = -1;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "comm_timeout_ms");
  o.comm_timeout_ms = 99; /* shorter than a few heartbeats */
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "at least 100 ms");
  o.comm_timeout_ms = 300;
  /* A session over processes needs the token its processes share (this suite runs without
   * LIBPIPE_TOKEN), long enough to guess at no better than chance. */
  o.store = "127.0.0.1:0";
  if (!getenv("LIBPIPE_TOKEN")) {
    ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "LIBPIPE_TOKEN");
  }
  o.token = "too short";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "at least 16");
  o.token = "conformance-token-5b1e9c27d04a83f6";
  o.store = "192.0.2.1:29999"; /* TEST-NET-1: never this machine's */
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_COMMUNICATION, "not an address of this machine");
  o.store = "nosuchhost.invalid:29999";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_COMMUNICATION, "does not resolve");
  o.store = "127.0.0.1:65536";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "not in 0..65535");
  /* Nobody comes (port 0: the store picks a free port): the session names the missing rank and how
   * to start it, after the timeout. */
  o.store = "127.0.0.1:0";
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_COMMUNICATION, "pipe worker --rank R");
  assert_non_null(strstr(pipe_last_error(), "missing rank 1"));
  o.transport = PIPE_TRANSPORT_NCCL;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_UNSUPPORTED, "");

  /* A working local session says so; NULL is refused. */
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  ASSERT_OK(pipe_session_check(session));
  pipe_session_destroy(session);
  ASSERT_FAILS(pipe_session_check(NULL), PIPE_ERR_INVALID_ARGUMENT, "session");

  /* Workers: arguments first, then a store nobody hosts, within the timeout. A socket bound to a
   * port but not listening holds that port for this test and refuses every connection to it. */
  int refuser = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in bound = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t bound_len = sizeof bound;
  assert_int_equal(bind(refuser, (struct sockaddr *)&bound, sizeof bound), 0);
  assert_int_equal(getsockname(refuser, (struct sockaddr *)&bound, &bound_len), 0);
  char address[64];
  snprintf(address, sizeof address, "127.0.0.1:%d", ntohs(bound.sin_port));
  ASSERT_FAILS(pipe_worker_run(NULL), PIPE_ERR_INVALID_ARGUMENT, "options");
  pipe_worker_options w = PIPE_WORKER_OPTIONS_INIT;
  /* Rank and world size 0 ask for a launcher's; none started this test. */
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT, "no launcher (torchrun, srun)");
  w.rank = 1;
  w.world_size = 2;
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT, "options->store");
  w.rank = 0;
  w.token = "conformance-token-5b1e9c27d04a83f6";
  w.store = address;
  w.world_size = 2;
  w.rank = 0;
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT, "rank 0 is the driver");
  w.rank = 1;
  w.world_size = 1;
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT, "at least 2");
  w.world_size = 2;
  w.comm_timeout_ms = 300;
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_COMMUNICATION, "nothing answered for the rendezvous store at 127.0.0.1:");
  w.struct_size = 4;
  ASSERT_FAILS(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT, "PIPE_WORKER_OPTIONS_INIT");
  close(refuser);
  unload(&l);
}

/* A stage that raises (a wrong feature size reaches the first matmul) fails that call with a
 * message naming the stage; the session keeps serving. */
static void stage_failure_keeps_session_usable(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.num_microbatches = 2;
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_create(l.plan, &options, &session));

  /* x with 511 columns instead of 512: a view of the real input with a shorter row. */
  DLManagedTensor narrow = *l.args[0];
  int64_t shape[2] = {16, 511};
  int64_t strides[2] = {512, 1};
  narrow.dl_tensor.shape = shape;
  narrow.dl_tensor.strides = strides;
  narrow.deleter = NULL;
  const DLManagedTensor *bad[2] = {&narrow, l.args[1]};
  ASSERT_FAILS(pipe_session_run(session, bad, 2, NULL, &out), PIPE_ERR_EXECUTION, "stage 0 failed");
  assert_null(out);

  ASSERT_OK(pipe_session_run(session, l.args, l.num_args, NULL, &out));
  size_t index = 0;
  const DLManagedTensor *got = NULL, *want = NULL;
  ASSERT_OK(pipe_tensor_list_find(l.expected, "output", &index));
  ASSERT_OK(pipe_tensor_list_get(l.expected, index, &want));
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  assert_close(got, want);
  pipe_tensor_list_destroy(out);
  pipe_session_destroy(session);
  unload(&l);
}

/* Inputs whose batch sizes disagree cannot be cut into the same micro-batches. */
static void mismatched_batch_sizes(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  DLManagedTensor shorter = *l.args[1];
  int64_t shape[2] = {8, 512};
  shorter.dl_tensor.shape = shape;
  shorter.deleter = NULL;
  const DLManagedTensor *bad[2] = {l.args[0], &shorter};
  ASSERT_FAILS(pipe_session_run(session, bad, 2, NULL, &out), PIPE_ERR_INPUT, "input 'y' has 8 rows");
  pipe_session_destroy(session);
  unload(&l);
}

typedef struct {
  int warnings;
  char last[512];
} log_capture;

static void capture_log(void *user_data, int32_t level, const char *message) {
  log_capture *c = user_data;
  if (level == PIPE_LOG_WARNING) {
    c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", message);
  }
}

/* A batch of 3 with 4 micro-batches runs as 3 micro-batches, warns, and is still right. */
static void batch_smaller_than_microbatches(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  log_capture capture = {0, ""};
  ASSERT_OK(pipe_set_log_callback(capture_log, &capture, PIPE_LOG_WARNING));

  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.num_microbatches = 4;
  pipe_session *session = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_create(l.plan, &options, &session));
  DLManagedTensor x3 = *l.args[0], y3 = *l.args[1];
  int64_t shape[2] = {3, 512};
  x3.dl_tensor.shape = shape;
  y3.dl_tensor.shape = shape;
  x3.deleter = y3.deleter = NULL;
  const DLManagedTensor *small[2] = {&x3, &y3};
  ASSERT_OK(pipe_session_run(session, small, 2, NULL, &out));
  ASSERT_OK(pipe_set_log_callback(NULL, NULL, PIPE_LOG_WARNING));
  assert_int_equal(capture.warnings, 1);
  assert_non_null(strstr(capture.last, "running 3 micro-batches"));

  const DLManagedTensor *got = NULL, *want = NULL;
  size_t index = 0;
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  ASSERT_OK(pipe_tensor_list_find(l.expected, "output", &index));
  ASSERT_OK(pipe_tensor_list_get(l.expected, index, &want));
  assert_int_equal(got->dl_tensor.shape[0], 3);
  const float *a = floats(&got->dl_tensor), *b = floats(&want->dl_tensor);
  for (int64_t i = 0; i < 3 * 512; ++i) assert_true(fabsf(a[i] - b[i]) <= 1e-5f + 1e-5f * fabsf(b[i]));
  pipe_tensor_list_destroy(out);
  pipe_session_destroy(session);
  unload(&l);
}

static void tensor_list_take_transfers_ownership(void **state) {
  (void)state;
  pipe_tensor_list *list = NULL;
  ASSERT_OK(pipe_safetensors_read(fixture("example_code.inputs.safetensors"), &list));
  size_t count = 0, index = 0;
  ASSERT_OK(pipe_tensor_list_size(list, &count));
  assert_int_equal(count, 2);
  ASSERT_FAILS(pipe_tensor_list_find(list, "z", &index), PIPE_ERR_NOT_FOUND, "no entry named 'z'");
  ASSERT_OK(pipe_tensor_list_find(list, "y", &index));
  DLManagedTensor *owned = NULL;
  ASSERT_OK(pipe_tensor_list_take(list, index, &owned));
  assert_non_null(owned);
  const DLManagedTensor *borrowed = NULL;
  ASSERT_FAILS(pipe_tensor_list_get(list, index, &borrowed), PIPE_ERR_INVALID_ARGUMENT, "already taken");
  ASSERT_FAILS(pipe_safetensors_write(list, "/tmp/never-written.safetensors"), PIPE_ERR_INVALID_ARGUMENT, "taken");
  pipe_tensor_list_destroy(list);
  /* The taken tensor outlives the list. */
  assert_int_equal(owned->dl_tensor.shape[0], 16);
  assert_int_equal(owned->dl_tensor.shape[1], 512);
  owned->deleter(owned);
}

/* A DLPack tensor the caller hands libpipe is checked before LibTorch reads it (SECURITY.md): each malformed
 * field is PIPE_ERR_INVALID_ARGUMENT naming it, through every entry point that takes tensors. */
static void dlpack_tensors_are_checked(void **state) {
  (void)state;
  float values[6] = {1, 2, 3, 4, 5, 6};
  int64_t shape[2] = {2, 3}, negative[2] = {2, -3}, empty[2] = {0, 3}, huge[2] = {2, 3};
  int64_t overflowing[2] = {INT64_MAX / 2, 4}, backwards[2] = {-1, 1};
  DLManagedTensor good;
  memset(&good, 0, sizeof good);
  good.dl_tensor = (DLTensor){values, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, NULL, 0};
  struct {
    const char *what, *words;
    DLManagedTensor t;
  } cases[12];
  size_t n = 0;
#define BAD(field_words, ...)     \
  do {                            \
    cases[n].t = good;            \
    __VA_ARGS__;                  \
    cases[n].words = field_words; \
    cases[n].what = #__VA_ARGS__; \
    ++n;                          \
  } while (0)
  BAD("ndim is -1", cases[n].t.dl_tensor.ndim = -1);
  BAD("ndim is 65", cases[n].t.dl_tensor.ndim = 65);
  BAD("shape is NULL but ndim is 2", cases[n].t.dl_tensor.shape = NULL);
  BAD("data is NULL but it has 6 elements", cases[n].t.dl_tensor.data = NULL);
  BAD("shape[1] is -3", cases[n].t.dl_tensor.shape = negative);
  BAD("lanes", cases[n].t.dl_tensor.dtype.lanes = 4);
  BAD("12 bits", cases[n].t.dl_tensor.dtype.bits = 12);
  BAD("strides reach past", cases[n].t.dl_tensor.shape = huge, cases[n].t.dl_tensor.strides = overflowing);
  BAD("negative strides", cases[n].t.dl_tensor.strides = backwards);
  BAD("size in bytes overflows", cases[n].t.dl_tensor.shape = overflowing);
  BAD("byte_offset", cases[n].t.dl_tensor.byte_offset = UINT64_MAX - 8);
#undef BAD
  pipe_tensor_list *list = NULL;
  ASSERT_OK(pipe_tensor_list_create(&list));
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_session *session = NULL;
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  pipe_plan_options *options = NULL;
  ASSERT_OK(pipe_plan_options_create(&options));
  for (size_t i = 0; i < n; ++i) {
    const DLManagedTensor *inputs[1] = {&cases[i].t};
    pipe_tensor_list *out = NULL;
    if (pipe_tensor_list_append(list, "x", &cases[i].t) != PIPE_ERR_INVALID_ARGUMENT ||
        !strstr(pipe_last_error(), cases[i].words))
      fail_msg("pipe_tensor_list_append with %s: '%s' does not say '%s'", cases[i].what, pipe_last_error(),
               cases[i].words);
    if (pipe_session_run(session, inputs, 1, NULL, &out) != PIPE_ERR_INVALID_ARGUMENT ||
        !strstr(pipe_last_error(), cases[i].words) || !strstr(pipe_last_error(), "inputs[0]"))
      fail_msg("pipe_session_run with %s: '%s'", cases[i].what, pipe_last_error());
    if (pipe_plan_options_set_example_inputs(options, inputs, 1) != PIPE_ERR_INVALID_ARGUMENT ||
        !strstr(pipe_last_error(), cases[i].words))
      fail_msg("pipe_plan_options_set_example_inputs with %s: '%s'", cases[i].what, pipe_last_error());
  }
  /* An empty tensor may point nowhere: nothing is read. */
  DLManagedTensor nothing = good;
  nothing.dl_tensor.shape = empty;
  nothing.dl_tensor.data = NULL;
  ASSERT_OK(pipe_tensor_list_append(list, "nothing", &nothing));
  pipe_plan_options_destroy(options);
  pipe_session_destroy(session);
  pipe_tensor_list_destroy(list);
  unload(&l);
}

/* A list built from the caller's own tensors: copies (the caller's memory may change after the
 * append), written to a safetensors file and read back equal. */
static void tensor_list_from_caller_tensors(void **state) {
  (void)state;
  float values[6] = {1, 2, 3, 4, 5, 6};
  int64_t shape[2] = {2, 3};
  int64_t ids[3] = {7, -8, 9};
  int64_t ids_shape[1] = {3};
  DLManagedTensor a, b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  a.dl_tensor = (DLTensor){values, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, NULL, 0};
  b.dl_tensor = (DLTensor){ids, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, ids_shape, NULL, 0};

  pipe_tensor_list *list = NULL;
  ASSERT_OK(pipe_tensor_list_create(&list));
  ASSERT_OK(pipe_tensor_list_append(list, "weights", &a));
  ASSERT_OK(pipe_tensor_list_append(list, "ids", &b));
  values[0] = 100; /* after the append: the list holds a copy */
  ASSERT_FAILS(pipe_tensor_list_append(list, "ids", &b), PIPE_ERR_INVALID_ARGUMENT, "already has an entry 'ids'");
  ASSERT_FAILS(pipe_tensor_list_append(list, "", &b), PIPE_ERR_INVALID_ARGUMENT, "name is empty");
  ASSERT_FAILS(pipe_tensor_list_append(list, "x", NULL), PIPE_ERR_INVALID_ARGUMENT, "tensor is NULL");
  ASSERT_FAILS(pipe_tensor_list_append(NULL, "x", &a), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_tensor_list_create(NULL), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  DLManagedTensor odd = a;
  odd.dl_tensor.dtype.code = 99; /* no such DLPack type */
  ASSERT_FAILS(pipe_tensor_list_append(list, "odd", &odd), PIPE_ERR_INPUT, "'odd'");

  char path[4200];
  snprintf(path, sizeof path, "%s/appended.safetensors", models_dir());
  ASSERT_OK(pipe_safetensors_write(list, path));
  pipe_tensor_list_destroy(list);
  pipe_tensor_list *back = NULL;
  ASSERT_OK(pipe_safetensors_read(path, &back));
  size_t count = 0, index = 0;
  ASSERT_OK(pipe_tensor_list_size(back, &count));
  assert_int_equal(count, 2);
  const DLManagedTensor *t = NULL;
  ASSERT_OK(pipe_tensor_list_find(back, "weights", &index));
  ASSERT_OK(pipe_tensor_list_get(back, index, &t));
  const float *w = (const float *)t->dl_tensor.data;
  assert_true(w[0] == 1.0f && w[5] == 6.0f);
  assert_int_equal(t->dl_tensor.shape[1], 3);
  ASSERT_OK(pipe_tensor_list_find(back, "ids", &index));
  ASSERT_OK(pipe_tensor_list_get(back, index, &t));
  assert_int_equal(((const int64_t *)t->dl_tensor.data)[1], -8);
  pipe_tensor_list_destroy(back);
  remove(path);
}

static void malformed_safetensors(void **state) {
  (void)state;
  char path[4200];
  snprintf(path, sizeof path, "%s/malformed.safetensors", models_dir());
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  const char header[] = "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}";
  uint64_t len = sizeof header - 1;
  fwrite(&len, 8, 1, f);
  fwrite(header, 1, len, f);
  fwrite("12345678", 1, 8, f); /* 8 of the 16 bytes the header promises */
  fclose(f);
  pipe_tensor_list *list = (pipe_tensor_list *)0x1;
  ASSERT_FAILS(pipe_safetensors_read(path, &list), PIPE_ERR_INVALID_FORMAT, "tensor 'x'");
  assert_ptr_equal(list, (pipe_tensor_list *)0x1);
  ASSERT_FAILS(pipe_safetensors_read("/nonexistent.safetensors", &list), PIPE_ERR_NOT_FOUND,
               "/nonexistent.safetensors");
}

/* Each thread reads its own last error, even while another thread fails differently. */
typedef struct {
  int which;
  int ok;
} thread_result;

static void *fail_in_thread(void *arg) {
  thread_result *r = arg;
  pipe_model *model = NULL;
  for (int i = 0; i < 200; ++i) {
    if (r->which == 0) {
      if (pipe_model_load("/nonexistent/a.pt", &model) != PIPE_ERR_NOT_FOUND) return NULL;
      if (!strstr(pipe_last_error(), "/nonexistent/a.pt")) return NULL;
    } else {
      if (pipe_model_num_inputs(NULL, NULL) != PIPE_ERR_INVALID_ARGUMENT) return NULL;
      if (!strstr(pipe_last_error(), "model is NULL")) return NULL;
    }
  }
  r->ok = 1;
  return NULL;
}

static void last_error_is_per_thread(void **state) {
  (void)state;
  pthread_t a, b;
  thread_result ra = {0, 0}, rb = {1, 0};
  pthread_create(&a, NULL, fail_in_thread, &ra);
  pthread_create(&b, NULL, fail_in_thread, &rb);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  assert_true(ra.ok);
  assert_true(rb.ok);
  /* Infallible calls leave the message alone; the next fallible call that succeeds clears it. */
  assert_int_equal(pipe_model_num_inputs(NULL, NULL), PIPE_ERR_INVALID_ARGUMENT);
  assert_true(pipe_last_error()[0] != '\0');
  assert_string_equal(pipe_status_string(PIPE_OK), "PIPE_OK");
  assert_true(pipe_last_error()[0] != '\0');
  ASSERT_OK(pipe_set_log_callback(NULL, NULL, PIPE_LOG_WARNING));
  assert_string_equal(pipe_last_error(), "");
}

/* The NULL checks the other tests do not reach: each returns INVALID_ARGUMENT with a message and
 * writes nothing. */
static void remaining_null_arguments(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  const char *str = NULL;
  size_t n = 0;
  uint64_t u = 0;
  double d = 0;
  const DLManagedTensor *borrowed = NULL;
  DLManagedTensor *owned = NULL;
  ASSERT_FAILS(pipe_tensor_list_name(NULL, 0, &str), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_tensor_list_name(l.inputs, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "name is NULL");
  ASSERT_FAILS(pipe_tensor_list_name(l.inputs, 9, &str), PIPE_ERR_INVALID_ARGUMENT, "out of range");
  ASSERT_FAILS(pipe_tensor_list_find(l.inputs, NULL, &n), PIPE_ERR_INVALID_ARGUMENT, "name is NULL");
  ASSERT_FAILS(pipe_tensor_list_find(l.inputs, "x", NULL), PIPE_ERR_INVALID_ARGUMENT, "index is NULL");
  ASSERT_FAILS(pipe_tensor_list_get(NULL, 0, &borrowed), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_tensor_list_get(l.inputs, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "tensor is NULL");
  ASSERT_FAILS(pipe_tensor_list_get(l.inputs, 5, &borrowed), PIPE_ERR_INVALID_ARGUMENT, "out of range");
  ASSERT_FAILS(pipe_tensor_list_take(NULL, 0, &owned), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_tensor_list_take(l.inputs, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "tensor is NULL");
  ASSERT_FAILS(pipe_safetensors_write(NULL, "/tmp/x.safetensors"), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_safetensors_write(l.inputs, NULL), PIPE_ERR_INVALID_ARGUMENT, "path is NULL");
  ASSERT_FAILS(pipe_safetensors_read("/tmp/x.safetensors", NULL), PIPE_ERR_INVALID_ARGUMENT, "list is NULL");
  ASSERT_FAILS(pipe_model_num_modules(NULL, &n), PIPE_ERR_INVALID_ARGUMENT, "model is NULL");
  ASSERT_FAILS(pipe_model_num_modules(l.model, NULL), PIPE_ERR_INVALID_ARGUMENT, "count is NULL");
  ASSERT_FAILS(pipe_model_module(NULL, 0, &str, NULL, NULL, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "model is NULL");
  ASSERT_FAILS(pipe_plan_num_stages(l.plan, NULL), PIPE_ERR_INVALID_ARGUMENT, "count is NULL");
  ASSERT_FAILS(pipe_plan_stage_count_names(NULL, 0, PIPE_NAMES_PARAMETERS, &n), PIPE_ERR_INVALID_ARGUMENT,
               "plan is NULL");
  ASSERT_FAILS(pipe_plan_stage_count_names(l.plan, 0, PIPE_NAMES_PARAMETERS, NULL), PIPE_ERR_INVALID_ARGUMENT,
               "count is NULL");
  ASSERT_FAILS(pipe_plan_stage_name(l.plan, 0, PIPE_NAMES_PARAMETERS, 0, NULL), PIPE_ERR_INVALID_ARGUMENT,
               "name is NULL");
  ASSERT_FAILS(pipe_plan_stage_name(l.plan, 0, PIPE_NAMES_PARAMETERS, 99, &str), PIPE_ERR_INVALID_ARGUMENT,
               "index 99 is out of range");
  ASSERT_FAILS(pipe_plan_stage_param_bytes(NULL, 0, &u), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_stage_param_bytes(l.plan, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "bytes is NULL");
  ASSERT_FAILS(pipe_plan_stage_param_bytes(l.plan, 4, &u), PIPE_ERR_INVALID_ARGUMENT, "stage 4 is out of range");
  {
    /* pipe_plan_stage_weight_bytes (0.16): its arguments, and stage options as a session refuses them, with
     * nothing written; tests/cli/test_quantize.py checks the numbers against the layers' shapes. */
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    u = 7;
    ASSERT_FAILS(pipe_plan_stage_weight_bytes(NULL, 0, NULL, &u), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
    ASSERT_FAILS(pipe_plan_stage_weight_bytes(l.plan, 0, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "bytes is NULL");
    ASSERT_FAILS(pipe_plan_stage_weight_bytes(l.plan, 4, NULL, &u), PIPE_ERR_INVALID_ARGUMENT,
                 "stage 4 is out of range");
    so.quantize_head = PIPE_QUANTIZE_HEAD_INT4;
    ASSERT_FAILS(pipe_plan_stage_weight_bytes(l.plan, 0, &so, &u), PIPE_ERR_INVALID_ARGUMENT,
                 "needs quantized weights");
    so.struct_size = 20;
    ASSERT_FAILS(pipe_plan_stage_weight_bytes(l.plan, 0, &so, &u), PIPE_ERR_INVALID_ARGUMENT,
                 "PIPE_STAGE_OPTIONS_INIT");
    assert_int_equal(u, 7);
    /* Stage 1 (lin1 and mm_param1): float weights hold at least the model's bytes (panels pad them); 8-bit codes
     * fewer, where the CPU stores them at all. */
    uint64_t model_bytes = 0, plain = 0, int8 = 0;
    ASSERT_OK(pipe_plan_stage_param_bytes(l.plan, 1, &model_bytes));
    ASSERT_OK(pipe_plan_stage_weight_bytes(l.plan, 1, NULL, &plain));
    assert_true(plain >= model_bytes);
    pipe_stage_options q = PIPE_STAGE_OPTIONS_INIT;
    q.quantize = PIPE_QUANTIZE_INT8;
    const pipe_status st = pipe_plan_stage_weight_bytes(l.plan, 1, &q, &int8);
    if (st == PIPE_ERR_UNSUPPORTED) {
      assert_non_null(strstr(pipe_last_error(), "AVX-512"));
    } else {
      assert_int_equal(st, PIPE_OK);
      assert_true(int8 < plain);
    }
  }
  ASSERT_FAILS(pipe_plan_stage_estimated_ms(NULL, 0, &d), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_stage_estimated_ms(l.plan, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "ms is NULL");
  ASSERT_FAILS(pipe_plan_describe(NULL, &str), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_save_stage(NULL, 0, NULL, "/tmp/s.pt"), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  ASSERT_FAILS(pipe_plan_save_stage(l.plan, 0, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "path is NULL");
  ASSERT_FAILS(pipe_plan_options_set_stages(NULL, 2, "uniform"), PIPE_ERR_INVALID_ARGUMENT, "options is NULL");
  ASSERT_FAILS(pipe_plan_options_set_example_inputs(NULL, l.args, 2), PIPE_ERR_INVALID_ARGUMENT, "options is NULL");
  pipe_plan_options *o = NULL;
  ASSERT_OK(pipe_plan_options_create(&o));
  ASSERT_FAILS(pipe_plan_options_set_example_inputs(o, NULL, 2), PIPE_ERR_INVALID_ARGUMENT, "inputs is NULL");
  const DLManagedTensor *with_null[2] = {l.args[0], NULL};
  ASSERT_FAILS(pipe_plan_options_set_example_inputs(o, with_null, 2), PIPE_ERR_INVALID_ARGUMENT, "inputs[1] is NULL");
  pipe_plan_options_destroy(o);
  pipe_session *session = NULL;
  pipe_request *request = NULL;
  pipe_stage_stats st = PIPE_STAGE_STATS_INIT;
  ASSERT_OK(pipe_session_create(l.plan, NULL, &session));
  ASSERT_FAILS(pipe_session_submit(NULL, l.args, 2, NULL, &request), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_submit(session, l.args, 2, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "request is NULL");
  ASSERT_FAILS(pipe_session_submit(session, NULL, 2, NULL, &request), PIPE_ERR_INVALID_ARGUMENT, "inputs is NULL");
  ASSERT_FAILS(pipe_session_num_stages(NULL, &n), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_num_stages(session, NULL), PIPE_ERR_INVALID_ARGUMENT, "count is NULL");
  ASSERT_FAILS(pipe_session_stage_stats(NULL, 0, &st), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_stage_stats(session, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "stats is NULL");
  ASSERT_FAILS(pipe_session_trace_start(NULL), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_trace_start_with_operators(NULL), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_FAILS(pipe_session_trace_stop(NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");
  ASSERT_OK(pipe_session_trace_stop(session, NULL)); /* stopping without a trace: nothing to write */
  assert_null(request);
  assert_null(borrowed);
  assert_null(owned);
  pipe_session_destroy(session);
  unload(&l);
}

/* ---- plans from options ------------------------------------------------------------------ */

static pipe_model *load_split_model(const char *name) {
  char file[256];
  pipe_model *model = NULL;
  snprintf(file, sizeof file, "split/%s.pt", name);
  ASSERT_OK(pipe_model_load(fixture(file), &model));
  return model;
}

static void plan_options_are_validated(void **state) {
  (void)state;
  pipe_plan_options *options = NULL;
  ASSERT_FAILS(pipe_plan_options_create(NULL), PIPE_ERR_INVALID_ARGUMENT, "options is NULL");
  ASSERT_OK(pipe_plan_options_create(&options));
  ASSERT_FAILS(pipe_plan_options_add_split_point(options, "layers.0"), PIPE_ERR_INVALID_ARGUMENT, "MODULE:begin");
  ASSERT_FAILS(pipe_plan_options_add_split_point(options, "layers.0:middle"), PIPE_ERR_INVALID_ARGUMENT,
               "neither ':begin' nor ':end'");
  ASSERT_FAILS(pipe_plan_options_add_split_point(NULL, "a:end"), PIPE_ERR_INVALID_ARGUMENT, "options is NULL");
  ASSERT_FAILS(pipe_plan_options_add_split_point(options, NULL), PIPE_ERR_INVALID_ARGUMENT, "split_point is NULL");
  ASSERT_FAILS(pipe_plan_options_set_stages(options, 0, "uniform"), PIPE_ERR_INVALID_ARGUMENT, "at least 1");
  ASSERT_FAILS(pipe_plan_options_set_stages(options, -2, "uniform"), PIPE_ERR_INVALID_ARGUMENT, "at least 1");
  ASSERT_FAILS(pipe_plan_options_set_stages(options, 2, "fastest"), PIPE_ERR_INVALID_ARGUMENT,
               "unknown split policy 'fastest'");
  ASSERT_FAILS(pipe_plan_options_set_stages(options, 2, NULL), PIPE_ERR_INVALID_ARGUMENT, "policy is NULL");

  pipe_model *model = load_split_model("tiny_llama");
  pipe_plan *plan = (pipe_plan *)0x1;
  ASSERT_OK(pipe_plan_options_add_split_point(options, "layers.7:end"));
  ASSERT_FAILS(pipe_plan_create(model, options, &plan), PIPE_ERR_SPLIT, "nearest module paths: layers.0");
  pipe_plan_options_destroy(options);

  ASSERT_OK(pipe_plan_options_create(&options));
  ASSERT_OK(pipe_plan_options_add_split_point(options, "layers.0:end"));
  ASSERT_OK(pipe_plan_options_set_stages(options, 2, "uniform"));
  ASSERT_FAILS(pipe_plan_create(model, options, &plan), PIPE_ERR_INVALID_ARGUMENT, "not both");
  pipe_plan_options_destroy(options);

  ASSERT_OK(pipe_plan_options_create(&options));
  ASSERT_OK(pipe_plan_options_set_stages(options, 40, "params"));
  ASSERT_FAILS(pipe_plan_create(model, options, &plan), PIPE_ERR_SPLIT, "cannot make 40 stages");
  ASSERT_OK(pipe_plan_options_set_stages(options, 2, "time"));
  ASSERT_FAILS(pipe_plan_create(model, options, &plan), PIPE_ERR_INVALID_ARGUMENT, "example inputs");
  pipe_plan_options_destroy(options);
  assert_ptr_equal(plan, (pipe_plan *)0x1);
  pipe_plan_options_destroy(NULL);
  pipe_model_destroy(model);
}

static void cuts_inside_blocks_are_refused(void **state) {
  (void)state;
  pipe_plan_options *options = NULL;
  pipe_plan *plan = NULL;
  ASSERT_OK(pipe_plan_options_create(&options));
  ASSERT_OK(pipe_plan_options_add_split_point(options, "lin1:end"));
  pipe_model *branch = load_split_model("call_inside_branch");
  ASSERT_FAILS(pipe_plan_create(branch, options, &plan), PIPE_ERR_SPLIT, "inside an if/loop block");
  pipe_model *autocast = load_split_model("inside_autocast");
  ASSERT_FAILS(pipe_plan_create(autocast, options, &plan), PIPE_ERR_SPLIT, "inside a `with` block");
  assert_null(plan);
  pipe_model_destroy(branch);
  pipe_model_destroy(autocast);
  pipe_plan_options_destroy(options);
}

/* Split by module path, time each stage on example inputs, run with micro-batches, save a stage. */
static void split_points_with_estimates(void **state) {
  (void)state;
  pipe_model *model = load_split_model("tiny_llama");
  pipe_tensor_list *inputs = NULL, *expected = NULL, *out = NULL;
  ASSERT_OK(pipe_safetensors_read(fixture("split/tiny_llama.inputs.safetensors"), &inputs));
  ASSERT_OK(pipe_safetensors_read(fixture("split/tiny_llama.expected.safetensors"), &expected));
  const DLManagedTensor *ids = NULL, *want = NULL, *got = NULL;
  ASSERT_OK(pipe_tensor_list_get(inputs, 0, &ids));
  ASSERT_OK(pipe_tensor_list_get(expected, 0, &want));

  pipe_plan_options *options = NULL;
  pipe_plan *plan = NULL;
  ASSERT_OK(pipe_plan_options_create(&options));
  ASSERT_OK(pipe_plan_options_add_split_point(options, "layers.0:end"));
  ASSERT_OK(pipe_plan_options_add_split_point(options, "layers.1:end"));
  ASSERT_OK(pipe_plan_options_set_example_inputs(options, &ids, 1));
  ASSERT_OK(pipe_plan_create(model, options, &plan));
  pipe_plan_options_destroy(options); /* the plan does not need the options afterwards */

  size_t stages = 0;
  ASSERT_OK(pipe_plan_num_stages(plan, &stages));
  assert_int_equal(stages, 3);
  for (size_t s = 0; s < stages; ++s) {
    double ms = -1;
    ASSERT_OK(pipe_plan_stage_estimated_ms(plan, s, &ms));
    assert_true(ms > 0);
  }
  const char *json = NULL;
  ASSERT_OK(pipe_plan_describe(plan, &json));
  assert_non_null(strstr(json, "\"method\":\"split points\""));
  assert_non_null(strstr(json, "layers.1:end (call 0)"));

  pipe_session_options so = PIPE_SESSION_OPTIONS_INIT;
  so.num_microbatches = 2;
  pipe_session *session = NULL;
  ASSERT_OK(pipe_session_create(plan, &so, &session));
  ASSERT_OK(pipe_session_run(session, &ids, 1, NULL, &out));
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  assert_int_equal(got->dl_tensor.ndim, 3);
  const float *a = floats(&got->dl_tensor), *b = floats(&want->dl_tensor);
  for (int64_t i = 0; i < numel(&got->dl_tensor); ++i) assert_true(fabsf(a[i] - b[i]) <= 1e-4f + 1e-4f * fabsf(b[i]));

  char path[4200];
  snprintf(path, sizeof path, "%s/capi_stage1.pt", models_dir());
  remove(path);
  ASSERT_OK(pipe_plan_save_stage(plan, 1, NULL, path));
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fclose(f);
  ASSERT_FAILS(pipe_plan_save_stage(plan, 3, NULL, path), PIPE_ERR_INVALID_ARGUMENT, "stage 3 is out of range");
  ASSERT_FAILS(pipe_plan_save_stage(plan, 0, NULL, "/nonexistent/dir/s.pt"), PIPE_ERR_IO, "cannot write");

  pipe_tensor_list_destroy(out);
  pipe_session_destroy(session);
  pipe_plan_destroy(plan);
  pipe_tensor_list_destroy(expected);
  pipe_tensor_list_destroy(inputs);
  pipe_model_destroy(model);
}

static void model_module_tree(void **state) {
  (void)state;
  pipe_model *model = load_split_model("tiny_llama");
  size_t count = 0;
  ASSERT_OK(pipe_model_num_modules(model, &count));
  assert_true(count > 10);
  const char *path = NULL, *type = NULL;
  int32_t depth = -1;
  uint64_t params = 0, bytes = 0;
  ASSERT_OK(pipe_model_module(model, 0, &path, &type, &depth, &params, &bytes));
  assert_string_equal(path, "");
  assert_string_equal(type, "TinyLlama");
  assert_int_equal(depth, 0);
  assert_true(params > 0 && bytes == params * 4);
  int found = 0;
  for (size_t i = 0; i < count; ++i) {
    ASSERT_OK(pipe_model_module(model, i, &path, NULL, &depth, NULL, NULL));
    if (strcmp(path, "layers.1.attn") == 0) found = depth == 3;
  }
  assert_true(found);
  ASSERT_FAILS(pipe_model_module(model, count, &path, NULL, NULL, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT,
               "out of range");
  pipe_model_destroy(model);
}

/* ---- asynchronous calls, specs, statistics, trace ------------------------------------------ */

/* The gated model (tests/gate): each of its two stages holds a micro-batch at a gate until the
 * test opens it, so that a test knows where every micro-batch is instead of guessing how long some
 * work takes. A call's key (input n, replicated to every micro-batch) names its gate; key 0 passes
 * at once. Every call runs on the fixture's x, so gated.expected.safetensors holds every result. */
typedef struct {
  int64_t shape[2];
  float x[16 * 64];
  int64_t key;
  DLManagedTensor tx, tn;
  const DLManagedTensor *args[2];
} gated_call;

static void make_gated_call(gated_call *c, const loaded *l, int64_t key) {
  const DLTensor *x = &l->args[0]->dl_tensor;
  memset(c, 0, sizeof *c);
  assert_int_equal(x->dtype.code, kDLFloat);
  assert_int_equal(x->ndim, 2);
  assert_int_equal(numel(x), 16 * 64);
  c->shape[0] = x->shape[0];
  c->shape[1] = x->shape[1];
  memcpy(c->x, floats(x), sizeof c->x);
  c->key = key;
  c->tx.dl_tensor.data = c->x;
  c->tx.dl_tensor.device.device_type = kDLCPU;
  c->tx.dl_tensor.ndim = 2;
  c->tx.dl_tensor.dtype.code = kDLFloat;
  c->tx.dl_tensor.dtype.bits = 32;
  c->tx.dl_tensor.dtype.lanes = 1;
  c->tx.dl_tensor.shape = c->shape;
  c->tn.dl_tensor.data = &c->key;
  c->tn.dl_tensor.device.device_type = kDLCPU;
  c->tn.dl_tensor.ndim = 0;
  c->tn.dl_tensor.dtype.code = kDLInt;
  c->tn.dl_tensor.dtype.bits = 64;
  c->tn.dl_tensor.dtype.lanes = 1;
  c->args[0] = &c->tx;
  c->args[1] = &c->tn;
}

static pipe_session *gated_session(const loaded *l, int32_t microbatches, int32_t microbatching) {
  pipe_session *session = NULL;
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.num_microbatches = microbatches;
  o.microbatching = microbatching;
  ASSERT_OK(pipe_session_create(l->plan, &o, &session));
  return session;
}

/* Micro-batches stage `stage` has run so far. */
static uint64_t stage_microbatches(pipe_session *session, size_t stage) {
  pipe_stage_stats st = PIPE_STAGE_STATS_INIT;
  ASSERT_OK(pipe_session_stage_stats(session, stage, &st));
  return st.microbatches;
}

/* Asserts `out` is the gated model's one output for the fixture's x. */
static void assert_gated_output(const loaded *l, pipe_tensor_list *out) {
  size_t count = 0, index = 0;
  const DLManagedTensor *got = NULL, *want = NULL;
  ASSERT_OK(pipe_tensor_list_size(out, &count));
  assert_int_equal(count, 1);
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  ASSERT_OK(pipe_tensor_list_find(l->expected, "output", &index));
  ASSERT_OK(pipe_tensor_list_get(l->expected, index, &want));
  assert_close(got, want);
}

/* Waits for a call and checks its result is the fixture's. */
static void assert_request_gives_expected(const loaded *l, pipe_request *request, int64_t timeout_ms) {
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_request_wait(request, timeout_ms, &out));
  assert_gated_output(l, out);
  pipe_tensor_list_destroy(out);
}

/* A call that finds the pipeline empty gets all its micro-batches; one that arrives while
 * another fills the pipeline is cut only as far as needed (here: 1, as 4 are already inside).
 * FIXED cuts both into 4. Results are the same either way. */
static void adaptive_microbatching(void **state) {
  (void)state;
  const int32_t modes[2] = {PIPE_MICROBATCHING_ADAPTIVE, PIPE_MICROBATCHING_FIXED};
  const uint64_t expected[2] = {4 + 1, 4 + 4};
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  for (int m = 0; m < 2; ++m) {
    pipe_session *session = gated_session(&l, 4, modes[m]);
    const int64_t key = gate_new_key();
    gated_call busy, second;
    make_gated_call(&busy, &l, key);
    make_gated_call(&second, &l, 0);
    pipe_request *a = NULL, *b = NULL;
    /* Its gate closed, the busy call keeps its 4 micro-batches inside while the second arrives. */
    ASSERT_OK(pipe_session_submit(session, busy.args, 2, NULL, &a));
    ASSERT_OK(pipe_session_submit(session, second.args, 2, NULL, &b));
    gate_open(key, NULL);
    assert_request_gives_expected(&l, a, -1);
    assert_request_gives_expected(&l, b, -1);
    assert_int_equal(stage_microbatches(session, 1), expected[m]);
    /* Alone again, a call gets all 4 in either mode. */
    pipe_tensor_list *out = NULL;
    ASSERT_OK(pipe_session_run(session, second.args, 2, NULL, &out));
    assert_gated_output(&l, out);
    assert_int_equal(stage_microbatches(session, 1), expected[m] + 4);
    pipe_tensor_list_destroy(out);
    pipe_request_destroy(a);
    pipe_request_destroy(b);
    pipe_session_destroy(session);
  }
  unload(&l);
}

static void submit_wait_cancel(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = gated_session(&l, 2, PIPE_MICROBATCHING_FIXED);
  const int64_t key = gate_new_key();
  gated_call held, quick;
  make_gated_call(&held, &l, key);
  make_gated_call(&quick, &l, 0);

  pipe_request *a = NULL, *b = NULL;
  pipe_tensor_list *out = (pipe_tensor_list *)0x1;
  ASSERT_OK(pipe_session_submit(session, held.args, 2, NULL, &a));
  assert_true(gate_wait(key, "stage0", "arrived", 1));              /* a's first micro-batch runs in stage 0 */
  ASSERT_OK(pipe_session_submit(session, quick.args, 2, NULL, &b)); /* queued behind a's second */
  memset(quick.x, 0, sizeof quick.x); /* submit copied the inputs: b still computes the fixture's */
  /* Held at its gate, a cannot finish: a wait of 0 ms says so and leaves outputs alone. */
  ASSERT_FAILS(pipe_request_wait(a, 0, &out), PIPE_ERR_TIMEOUT, "still running");
  assert_ptr_equal(out, (pipe_tensor_list *)0x1);
  ASSERT_OK(pipe_request_cancel(a));
  ASSERT_FAILS(pipe_request_wait(a, -1, &out), PIPE_ERR_CANCELLED, "cancelled");
  gate_open(key, NULL);
  assert_request_gives_expected(&l, b, -1);
  /* a's first micro-batch finished the stage it was running; its second was dropped unrun, and
   * stage 1 ran b's only. */
  assert_int_equal(stage_microbatches(session, 0), 1 + 2);
  assert_int_equal(stage_microbatches(session, 1), 2);
  /* A finished call gives its result again; cancelling it afterwards changes nothing. */
  ASSERT_OK(pipe_request_cancel(b));
  assert_request_gives_expected(&l, b, 0);

  ASSERT_FAILS(pipe_request_wait(NULL, 0, &out), PIPE_ERR_INVALID_ARGUMENT, "request is NULL");
  ASSERT_FAILS(pipe_request_wait(b, 0, NULL), PIPE_ERR_INVALID_ARGUMENT, "outputs is NULL");
  ASSERT_FAILS(pipe_request_cancel(NULL), PIPE_ERR_INVALID_ARGUMENT, "request is NULL");
  pipe_request *none = (pipe_request *)0x1;
  ASSERT_FAILS(pipe_session_submit(session, quick.args, 1, NULL, &none), PIPE_ERR_INPUT, "takes 2 inputs");
  assert_ptr_equal(none, (pipe_request *)0x1);
  pipe_request_destroy(a);
  pipe_request_destroy(b);
  pipe_request_destroy(NULL);
  pipe_session_destroy(session);
  unload(&l);
}

static void *destroy_session(void *session) {
  pipe_session_destroy(session);
  return NULL;
}

/* Requests outlive their session: destroying it cancels the call it is running and the calls
 * queued behind, and a call that had finished keeps its result. */
static void a_request_outlives_its_session(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  worker_threads before, after, workers;
  worker_threads_now(&before);
  pipe_session *session = gated_session(&l, 2, PIPE_MICROBATCHING_FIXED);
  worker_threads_now(&after);
  worker_threads_started(&before, &after, &workers);
  assert_true(workers.count > 0);
  const int64_t key = gate_new_key();
  gated_call held, quick;
  make_gated_call(&held, &l, key);
  make_gated_call(&quick, &l, 0);
  pipe_request *finished = NULL, *running = NULL, *queued = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_submit(session, quick.args, 2, NULL, &finished));
  assert_request_gives_expected(&l, finished, -1);
  ASSERT_OK(pipe_session_submit(session, held.args, 2, NULL, &running));
  assert_true(gate_wait(key, "stage0", "arrived", 1));
  ASSERT_OK(pipe_session_submit(session, quick.args, 2, NULL, &queued));
  /* Destroy waits for the micro-batch held in stage 0. Its gate opens once destroy has begun: once
   * the idle stage 1 worker has ended (worker_threads.h says why that shows it). */
  pthread_t destroyer;
  assert_int_equal(pthread_create(&destroyer, NULL, destroy_session, session), 0);
  const int began = worker_threads_wait_one_ended(&workers);
  gate_open(key, NULL);
  assert_int_equal(pthread_join(destroyer, NULL), 0);
  assert_true(began);
  ASSERT_FAILS(pipe_request_wait(running, -1, &out), PIPE_ERR_CANCELLED,
               "the session was destroyed while the call was running");
  ASSERT_FAILS(pipe_request_wait(queued, -1, &out), PIPE_ERR_CANCELLED,
               "the session was destroyed while the call was running");
  assert_null(out);
  assert_request_gives_expected(&l, finished, 0);
  pipe_request_destroy(finished);
  pipe_request_destroy(running);
  pipe_request_destroy(queued);
  unload(&l);
}

static int64_t monotonic_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t); /* the clock libpipe's deadlines use (steady_clock) */
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

typedef struct {
  pipe_session *session;
  int64_t key;
  uint64_t queued;    /* stage 0's queue depth once the call is in it */
  int64_t timeout_ms; /* the call's */
  int saw_it;         /* the call was seen queued */
} opener_job;

/* Opens a gate once the clock is past the deadline of a call that pipe_session_run runs on another
 * thread. That call's deadline is set before it is queued, so timeout_ms after the queue shows it,
 * the deadline has passed. */
static void *open_after_deadline(void *arg) {
  opener_job *job = arg;
  const time_t give_up = time(NULL) + GATE_WAIT_LIMIT_S;
  pipe_stage_stats st = PIPE_STAGE_STATS_INIT;
  while (pipe_session_stage_stats(job->session, 0, &st) == PIPE_OK && st.queue_depth < job->queued &&
         time(NULL) <= give_up)
    usleep(2000);
  job->saw_it = st.queue_depth >= job->queued;
  const int64_t past = monotonic_ns() + job->timeout_ms * 1000000;
  while (monotonic_ns() <= past) usleep(1000);
  gate_open(job->key, NULL);
  return NULL;
}

/* A call still queued at its deadline fails with PIPE_ERR_DEADLINE_EXCEEDED, whether waited for
 * (pipe_request_wait) or run (pipe_session_run), and never runs. */
static void deadlines(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = gated_session(&l, 2, PIPE_MICROBATCHING_FIXED);
  const int64_t key = gate_new_key();
  gated_call blocking, late;
  make_gated_call(&blocking, &l, key);
  make_gated_call(&late, &l, 0);
  pipe_request *blocker = NULL, *submitted = NULL;
  pipe_tensor_list *out = NULL;
  /* A call holds stage 0: the calls queued behind it cannot finish before the test opens its gate. */
  ASSERT_OK(pipe_session_submit(session, blocking.args, 2, NULL, &blocker));
  assert_true(gate_wait(key, "stage0", "arrived", 1));
  pipe_run_options ro = PIPE_RUN_OPTIONS_INIT;
  ro.timeout_ms = 10;
  ASSERT_OK(pipe_session_submit(session, late.args, 2, &ro, &submitted));
  ASSERT_FAILS(pipe_request_wait(submitted, -1, &out), PIPE_ERR_DEADLINE_EXCEEDED,
               "the call did not finish before its deadline");
  /* pipe_session_run returns once its call is past its deadline and no longer queued: another
   * thread opens the gate once the clock is past that deadline. Stage 0's queue then holds the
   * blocker's second micro-batch, the submitted call's two and the run call's two. */
  opener_job job = {session, key, 1 + 2 + 2, ro.timeout_ms, 0};
  pthread_t opener;
  assert_int_equal(pthread_create(&opener, NULL, open_after_deadline, &job), 0);
  ASSERT_FAILS(pipe_session_run(session, late.args, 2, &ro, &out), PIPE_ERR_DEADLINE_EXCEEDED,
               "the call did not finish before its deadline");
  assert_int_equal(pthread_join(opener, NULL), 0);
  assert_true(job.saw_it);
  assert_null(out);
  assert_request_gives_expected(&l, blocker, -1);
  /* Neither late call ran in any stage: their micro-batches came up past their deadlines. */
  assert_int_equal(stage_microbatches(session, 0), 2);
  assert_int_equal(stage_microbatches(session, 1), 2);

  /* A timeout beyond what the clock counts is no deadline (not one that overflowed into the past). */
  ro.timeout_ms = INT64_MAX;
  ASSERT_OK(pipe_session_run(session, late.args, 2, &ro, &out));
  assert_gated_output(&l, out);
  pipe_tensor_list_destroy(out);
  out = NULL;
  ro.timeout_ms = -5;
  ASSERT_FAILS(pipe_session_run(session, late.args, 2, &ro, &out), PIPE_ERR_INVALID_ARGUMENT, "timeout_ms");
  pipe_run_options zero = PIPE_RUN_OPTIONS_INIT;
  zero.struct_size = 0;
  ASSERT_FAILS(pipe_session_run(session, late.args, 2, &zero, &out), PIPE_ERR_INVALID_ARGUMENT,
               "PIPE_RUN_OPTIONS_INIT");
  pipe_request_destroy(submitted);
  pipe_request_destroy(blocker);
  pipe_session_destroy(session);
  unload(&l);
}

/* ---- completion without a waiting thread: pipe_request_on_done, pipe_request_fd ------------ */

/* What a pipe_request_done_fn saw: how often it ran, with what, and on which thread. */
typedef struct {
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int calls;
  pipe_status status;
  pipe_request *request;
  pthread_t thread;
} done_record;

static void done_record_init(done_record *r) {
  memset(r, 0, sizeof *r);
  pthread_mutex_init(&r->mutex, NULL);
  pthread_cond_init(&r->cond, NULL);
}

static void done_record_free(done_record *r) {
  pthread_cond_destroy(&r->cond);
  pthread_mutex_destroy(&r->mutex);
}

static void record_done(void *user_data, pipe_request *request, pipe_status status) {
  done_record *r = user_data;
  pthread_mutex_lock(&r->mutex);
  r->calls++;
  r->status = status;
  r->request = request;
  r->thread = pthread_self();
  pthread_cond_broadcast(&r->cond);
  pthread_mutex_unlock(&r->mutex);
}

/* The callback's calls once it has run at least once (a bounded wait that only ends a hung test). */
static int wait_done(done_record *r) {
  struct timespec limit;
  clock_gettime(CLOCK_REALTIME, &limit);
  limit.tv_sec += GATE_WAIT_LIMIT_S;
  pthread_mutex_lock(&r->mutex);
  while (r->calls == 0 && pthread_cond_timedwait(&r->cond, &r->mutex, &limit) == 0) {}
  const int calls = r->calls;
  pthread_mutex_unlock(&r->mutex);
  return calls;
}

static int calls_now(done_record *r) {
  pthread_mutex_lock(&r->mutex);
  const int calls = r->calls;
  pthread_mutex_unlock(&r->mutex);
  return calls;
}

/* 1 if `fd` is readable within timeout_ms (0: now, as it is), 0 if not. */
static int readable(int fd, int timeout_ms) {
  struct pollfd p = {fd, POLLIN, 0};
  const int n = poll(&p, 1, timeout_ms);
  assert_true(n >= 0);
  return n == 1 && (p.revents & POLLIN) != 0;
}

static pipe_session *completion_session(const loaded *l) {
  pipe_session *session = NULL;
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.num_microbatches = 2;
  o.microbatching = PIPE_MICROBATCHING_FIXED;
  o.max_inflight = 64; /* room for every held call of many_calls_through_one_poll_loop */
  ASSERT_OK(pipe_session_create(l->plan, &o, &session));
  return session;
}

/* pipe_request_wait with a timeout beyond what the clock counts waits as long as it takes (here:
 * until the call's own deadline fires while its gate stays shut), rather than overflowing into
 * the past and reporting PIPE_ERR_TIMEOUT at once. */
static void a_wait_longer_than_the_clock_counts(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = gated_session(&l, 2, PIPE_MICROBATCHING_FIXED);
  const int64_t key = gate_new_key();
  gated_call held;
  make_gated_call(&held, &l, key);
  pipe_run_options ro = PIPE_RUN_OPTIONS_INIT;
  ro.timeout_ms = 300;
  pipe_request *request = NULL;
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_submit(session, held.args, 2, &ro, &request));
  ASSERT_FAILS(pipe_request_wait(request, INT64_MAX, &out), PIPE_ERR_DEADLINE_EXCEEDED,
               "the call did not finish before its deadline");
  assert_null(out);
  gate_open(key, NULL);
  pipe_request_destroy(request);
  pipe_session_destroy(session);
  unload(&l);
}

/* A call held at its gate: neither told nor readable; once the gate opens, the callback runs once
 * (on a libpipe thread) with PIPE_OK, the descriptor becomes readable and stays so, and
 * pipe_request_wait(0) collects the fixture's result. */
static void on_done_and_fd_tell_a_finished_call(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = completion_session(&l);
  const int64_t key = gate_new_key();
  gated_call held;
  make_gated_call(&held, &l, key);
  pipe_request *a = NULL;
  ASSERT_OK(pipe_session_submit(session, held.args, 2, NULL, &a));
  assert_true(gate_wait(key, "stage0", "arrived", 1));
  done_record rec;
  done_record_init(&rec);
  int fd = -1, again = -1;
  ASSERT_OK(pipe_request_on_done(a, record_done, &rec));
  ASSERT_OK(pipe_request_fd(a, &fd));
  assert_true(fd >= 0);
  ASSERT_OK(pipe_request_fd(a, &again));
  assert_int_equal(again, fd); /* the same descriptor on every call */
  assert_false(readable(fd, 0));
  assert_int_equal(calls_now(&rec), 0);
  done_record other;
  done_record_init(&other);
  ASSERT_FAILS(pipe_request_on_done(a, record_done, &other), PIPE_ERR_INVALID_ARGUMENT, "already has a callback");
  gate_open(key, NULL);
  assert_true(readable(fd, GATE_WAIT_LIMIT_S * 1000));
  assert_int_equal(wait_done(&rec), 1);
  assert_int_equal(rec.status, PIPE_OK);
  assert_ptr_equal(rec.request, a);
  assert_false(pthread_equal(rec.thread, pthread_self()));
  assert_request_gives_expected(&l, a, 0);
  assert_true(readable(fd, 0)); /* level-triggered: still readable after collecting */
  /* Refused after it ran too; the refused callback never runs. */
  ASSERT_FAILS(pipe_request_on_done(a, record_done, &other), PIPE_ERR_INVALID_ARGUMENT, "already has a callback");
  pipe_request_destroy(a);
  assert_int_equal(calls_now(&rec), 1);
  assert_int_equal(calls_now(&other), 0);
  done_record_free(&rec);
  done_record_free(&other);

  /* Asked after the call finished: the callback runs at once on this thread, the descriptor is
   * readable at once. */
  gated_call quick;
  make_gated_call(&quick, &l, 0);
  pipe_request *b = NULL;
  ASSERT_OK(pipe_session_submit(session, quick.args, 2, NULL, &b));
  assert_request_gives_expected(&l, b, -1);
  done_record late;
  done_record_init(&late);
  ASSERT_OK(pipe_request_on_done(b, record_done, &late));
  assert_int_equal(calls_now(&late), 1);
  assert_int_equal(late.status, PIPE_OK);
  assert_true(pthread_equal(late.thread, pthread_self()));
  ASSERT_OK(pipe_request_fd(b, &fd));
  assert_true(readable(fd, 0));
  pipe_request_destroy(b);
  assert_int_equal(calls_now(&late), 1);
  done_record_free(&late);
  pipe_session_destroy(session);
  unload(&l);
}

/* Cancel, destroy and a deadline finish a held call, each telling its callback once with the
 * status pipe_request_wait reports. */
static void on_done_tells_cancel_destroy_and_deadline(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = completion_session(&l);
  pipe_tensor_list *out = NULL;
  int fd = -1;

  /* Cancelled: told at once, on the cancelling thread. */
  const int64_t k1 = gate_new_key();
  gated_call c1;
  make_gated_call(&c1, &l, k1);
  pipe_request *cancelled = NULL;
  ASSERT_OK(pipe_session_submit(session, c1.args, 2, NULL, &cancelled));
  assert_true(gate_wait(k1, "stage0", "arrived", 1));
  done_record rc;
  done_record_init(&rc);
  ASSERT_OK(pipe_request_on_done(cancelled, record_done, &rc));
  ASSERT_OK(pipe_request_fd(cancelled, &fd));
  ASSERT_OK(pipe_request_cancel(cancelled));
  assert_int_equal(calls_now(&rc), 1);
  assert_int_equal(rc.status, PIPE_ERR_CANCELLED);
  assert_true(pthread_equal(rc.thread, pthread_self()));
  assert_true(readable(fd, 0));
  ASSERT_FAILS(pipe_request_wait(cancelled, 0, &out), PIPE_ERR_CANCELLED, "cancelled");
  gate_open(k1, NULL);
  pipe_request_destroy(cancelled);
  assert_int_equal(calls_now(&rc), 1);
  done_record_free(&rc);

  /* Destroyed while held: destroy cancels it and tells the callback before it returns. */
  const int64_t k2 = gate_new_key();
  gated_call c2;
  make_gated_call(&c2, &l, k2);
  pipe_request *dropped = NULL;
  ASSERT_OK(pipe_session_submit(session, c2.args, 2, NULL, &dropped));
  assert_true(gate_wait(k2, "stage0", "arrived", 1));
  done_record rd;
  done_record_init(&rd);
  ASSERT_OK(pipe_request_on_done(dropped, record_done, &rd));
  ASSERT_OK(pipe_request_fd(dropped, &fd));
  pipe_request_destroy(dropped);
  assert_int_equal(calls_now(&rd), 1);
  assert_int_equal(rd.status, PIPE_ERR_CANCELLED);
  assert_true(pthread_equal(rd.thread, pthread_self()));
  gate_open(k2, NULL);
  done_record_free(&rd);

  /* Past its deadline while stage 0 holds it: told and readable although nobody waits and the gate
   * is still closed. */
  const int64_t k3 = gate_new_key();
  gated_call c3;
  make_gated_call(&c3, &l, k3);
  pipe_run_options ro = PIPE_RUN_OPTIONS_INIT;
  ro.timeout_ms = 10;
  pipe_request *late = NULL;
  ASSERT_OK(pipe_session_submit(session, c3.args, 2, &ro, &late));
  done_record rl;
  done_record_init(&rl);
  ASSERT_OK(pipe_request_on_done(late, record_done, &rl));
  ASSERT_OK(pipe_request_fd(late, &fd));
  assert_true(readable(fd, GATE_WAIT_LIMIT_S * 1000));
  assert_int_equal(wait_done(&rl), 1);
  assert_int_equal(rl.status, PIPE_ERR_DEADLINE_EXCEEDED);
  assert_int_equal(gate_count(k3, "stage0", "left"), 0);
  ASSERT_FAILS(pipe_request_wait(late, 0, &out), PIPE_ERR_DEADLINE_EXCEEDED, "before its deadline");
  assert_null(out);
  gate_open(k3, NULL);
  pipe_request_destroy(late);
  assert_int_equal(calls_now(&rl), 1);
  done_record_free(&rl);
  pipe_session_destroy(session);
  unload(&l);
}

/* Many calls collected by one thread through one poll() loop: none is readable while their gate
 * is closed; once it opens, each becomes readable and gives the fixture's result. */
static void many_calls_through_one_poll_loop(void **state) {
  (void)state;
  enum { N = 12 };
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = completion_session(&l);
  const int64_t key = gate_new_key();
  gated_call call;
  make_gated_call(&call, &l, key);
  pipe_request *requests[N];
  struct pollfd fds[N];
  for (int i = 0; i < N; ++i) {
    ASSERT_OK(pipe_session_submit(session, call.args, 2, NULL, &requests[i]));
    fds[i].events = POLLIN;
    fds[i].revents = 0;
    ASSERT_OK(pipe_request_fd(requests[i], &fds[i].fd));
  }
  assert_true(gate_wait(key, "stage0", "arrived", 1));
  assert_int_equal(poll(fds, N, 0), 0);
  gate_open(key, NULL);
  int collected = 0;
  while (collected < N) {
    const int n = poll(fds, N, GATE_WAIT_LIMIT_S * 1000);
    assert_true(n > 0);
    for (int i = 0; i < N; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & POLLIN)) continue;
      assert_request_gives_expected(&l, requests[i], 0); /* finished: no wait */
      fds[i].fd = -1;                                    /* poll skips it from now on */
      ++collected;
    }
  }
  for (int i = 0; i < N; ++i) pipe_request_destroy(requests[i]);
  pipe_session_destroy(session);
  unload(&l);
}

static void completion_null_arguments(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "gated.scripted.pt", "gated");
  pipe_session *session = completion_session(&l);
  gated_call quick;
  make_gated_call(&quick, &l, 0);
  pipe_request *r = NULL;
  ASSERT_OK(pipe_session_submit(session, quick.args, 2, NULL, &r));
  done_record rec;
  done_record_init(&rec);
  int fd = -7;
  ASSERT_FAILS(pipe_request_on_done(NULL, record_done, &rec), PIPE_ERR_INVALID_ARGUMENT, "request is NULL");
  ASSERT_FAILS(pipe_request_on_done(r, NULL, &rec), PIPE_ERR_INVALID_ARGUMENT, "fn is NULL");
  ASSERT_FAILS(pipe_request_fd(NULL, &fd), PIPE_ERR_INVALID_ARGUMENT, "request is NULL");
  assert_int_equal(fd, -7);
  ASSERT_FAILS(pipe_request_fd(r, NULL), PIPE_ERR_INVALID_ARGUMENT, "fd is NULL");
  /* A refused NULL callback does not use up the request's one callback; user_data may be NULL. */
  ASSERT_OK(pipe_request_on_done(r, record_done, &rec));
  assert_int_equal(wait_done(&rec), 1);
  assert_int_equal(rec.status, PIPE_OK);
  assert_request_gives_expected(&l, r, 0);
  pipe_request_destroy(r);
  done_record_free(&rec);
  pipe_session_destroy(session);
  unload(&l);
}

static void specs_stats_and_trace(void **state) {
  (void)state;
  loaded l;
  load_fixture(&l, "example_code.traced.pt", "example_code");
  pipe_chunk_spec bad_in[1] = {{PIPE_CHUNK_SUM, 0}};
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.num_microbatches = 4;
  o.input_specs = bad_in;
  o.num_input_specs = 1;
  pipe_session *session = NULL;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "input_specs[0].kind");
  pipe_chunk_spec bad_out[1] = {{PIPE_CHUNK_REPLICATE, 0}};
  o.input_specs = NULL;
  o.num_input_specs = 0;
  o.output_specs = bad_out;
  o.num_output_specs = 1;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "output_specs[0].kind");
  o.output_specs = NULL;
  o.num_output_specs = 3;
  ASSERT_FAILS(pipe_session_create(l.plan, &o, &session), PIPE_ERR_INVALID_ARGUMENT, "output_specs is NULL");
  pipe_chunk_spec specs[2] = {{PIPE_CHUNK_SPLIT, 0}, {PIPE_CHUNK_SPLIT, -2}};
  pipe_chunk_spec out_specs[1] = {{PIPE_CHUNK_CONCAT, -2}};
  o.input_specs = specs;
  o.num_input_specs = 2;
  o.output_specs = out_specs;
  o.num_output_specs = 1;
  ASSERT_OK(pipe_session_create(l.plan, &o, &session));

  char trace[4200];
  snprintf(trace, sizeof trace, "%s/capi_trace.json", models_dir());
  ASSERT_OK(pipe_session_trace_start(session));
  pipe_tensor_list *out = NULL;
  ASSERT_OK(pipe_session_run(session, l.args, l.num_args, NULL, &out));
  ASSERT_OK(pipe_session_trace_stop(session, trace));
  const DLManagedTensor *got = NULL, *want = NULL;
  size_t index = 0;
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  ASSERT_OK(pipe_tensor_list_find(l.expected, "output", &index));
  ASSERT_OK(pipe_tensor_list_get(l.expected, index, &want));
  assert_close(got, want);
  pipe_tensor_list_destroy(out);

  FILE *f = fopen(trace, "r");
  assert_non_null(f);
  char text[65536];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  assert_non_null(strstr(text, "\"traceEvents\""));
  assert_non_null(strstr(text, "stage 3"));
  ASSERT_FAILS(pipe_session_trace_stop(session, "/nonexistent/dir/t.json"), PIPE_ERR_IO, "cannot create");

  size_t stages = 0;
  ASSERT_OK(pipe_session_num_stages(session, &stages));
  assert_int_equal(stages, 4);
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats st = PIPE_STAGE_STATS_INIT;
    ASSERT_OK(pipe_session_stage_stats(session, s, &st));
    assert_int_equal(st.struct_size, sizeof(pipe_stage_stats));
    assert_int_equal(st.microbatches, 4);
    assert_int_equal(st.failures, 0);
    assert_true(st.busy_ms > 0);
    assert_int_equal(st.queue_depth, 0);
  }
  /* pipe_stage_stats has had one layout: a smaller struct_size is no version's and is refused. */
  pipe_stage_stats small = PIPE_STAGE_STATS_INIT;
  small.struct_size = (uint32_t)offsetof(pipe_stage_stats, failures);
  ASSERT_FAILS(pipe_session_stage_stats(session, 0, &small), PIPE_ERR_INVALID_ARGUMENT, "struct_size");
  pipe_stage_stats st = PIPE_STAGE_STATS_INIT;
  ASSERT_FAILS(pipe_session_stage_stats(session, 4, &st), PIPE_ERR_INVALID_ARGUMENT, "stage 4 is out of range");
  st.struct_size = 0;
  ASSERT_FAILS(pipe_session_stage_stats(session, 0, &st), PIPE_ERR_INVALID_ARGUMENT, "PIPE_STAGE_STATS_INIT");
  pipe_session_destroy(session);
  unload(&l);
}

/* ---- stage weights ------------------------------------------------------------------------ */

typedef struct {
  int calls;
  size_t last_stage;
  uint64_t last_done, last_total;
  int monotonic;
} progress_log;

static void record_progress(void *user_data, size_t stage, uint64_t done, uint64_t total) {
  progress_log *p = user_data;
  if (p->calls > 0 && stage == p->last_stage && done < p->last_done) p->monotonic = 0;
  p->calls++;
  p->last_stage = stage;
  p->last_done = done;
  p->last_total = total;
}

static void weights_from_a_sharded_checkpoint(void **state) {
  (void)state;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_plan_options *o = NULL;
  pipe_session *session = NULL;
  ASSERT_OK(pipe_model_load(fixture("weights/llama.skeleton.pt"), &model));
  ASSERT_OK(pipe_plan_options_create(&o));
  ASSERT_OK(pipe_plan_options_add_split_point(o, "layers.0:end"));
  ASSERT_OK(pipe_plan_options_add_split_point(o, "layers.1:end"));
  ASSERT_OK(pipe_plan_create(model, o, &plan));
  pipe_plan_options_destroy(o);

  /* Without weights a skeleton cannot run, and says which tensor lacks data. */
  ASSERT_FAILS(pipe_session_create(plan, NULL, &session), PIPE_ERR_INVALID_ARGUMENT, "tensor 'embed.weight' (stage 0)");

  char index[4200];
  snprintf(index, sizeof index, "%s/weights/sharded/llama.safetensors.index.json", models_dir());
  progress_log log = {0, 0, 0, 0, 1};
  pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
  so.weights = index;
  so.progress = record_progress;
  so.progress_user_data = &log;
  pipe_session_options opts = PIPE_SESSION_OPTIONS_INIT;
  opts.stage_options = &so;
  ASSERT_OK(pipe_session_create(plan, &opts, &session));
  assert_true(log.calls >= 3);
  assert_true(log.monotonic);
  assert_int_equal(log.last_stage, 2);
  assert_int_equal(log.last_done, log.last_total);
  uint64_t stage_bytes = 0;
  ASSERT_OK(pipe_plan_stage_param_bytes(plan, 2, &stage_bytes));
  assert_int_equal(log.last_total, stage_bytes);

  pipe_tensor_list *inputs = NULL, *expected = NULL, *out = NULL;
  ASSERT_OK(pipe_safetensors_read(fixture("weights/llama.inputs.safetensors"), &inputs));
  ASSERT_OK(pipe_safetensors_read(fixture("weights/llama.expected.safetensors"), &expected));
  const DLManagedTensor *ids = NULL, *want = NULL, *got = NULL;
  ASSERT_OK(pipe_tensor_list_get(inputs, 0, &ids));
  ASSERT_OK(pipe_session_run(session, &ids, 1, NULL, &out));
  ASSERT_OK(pipe_tensor_list_get(out, 0, &got));
  ASSERT_OK(pipe_tensor_list_get(expected, 0, &want));
  assert_close(got, want);

  so.dtype = 77;
  pipe_session *bad = NULL;
  ASSERT_FAILS(pipe_session_create(plan, &opts, &bad), PIPE_ERR_INVALID_ARGUMENT, "PIPE_DTYPE_");
  so.dtype = PIPE_DTYPE_KEEP;
  so.struct_size = 0;
  ASSERT_FAILS(pipe_session_create(plan, &opts, &bad), PIPE_ERR_INVALID_ARGUMENT, "PIPE_STAGE_OPTIONS_INIT");
  assert_null(bad);

  pipe_tensor_list_destroy(out);
  pipe_tensor_list_destroy(expected);
  pipe_tensor_list_destroy(inputs);
  pipe_session_destroy(session);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
}

/* The gated model's operator must be loaded before the model (tests/gate); gate_init also sets the
 * gate folder's environment variable, here, before any session starts its threads. */
static int load_gate(void **state) {
  (void)state;
  return gate_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(version_matches_macros),
      cmocka_unit_test(status_strings_name_codes),
      cmocka_unit_test(example_code_traced),
      cmocka_unit_test(example_code_scripted),
      cmocka_unit_test(multi_mlp_traced),
      cmocka_unit_test(param_alias_scripted),
      cmocka_unit_test(exported_seed_models),
      cmocka_unit_test(model_format_says_what_was_loaded),
      cmocka_unit_test(missing_model_file),
      cmocka_unit_test(junk_model_file),
      cmocka_unit_test(null_arguments),
      cmocka_unit_test(wrong_number_of_inputs),
      cmocka_unit_test(bad_options),
      cmocka_unit_test(stage_failure_keeps_session_usable),
      cmocka_unit_test(mismatched_batch_sizes),
      cmocka_unit_test(batch_smaller_than_microbatches),
      cmocka_unit_test(tensor_list_take_transfers_ownership),
      cmocka_unit_test(tensor_list_from_caller_tensors),
      cmocka_unit_test(dlpack_tensors_are_checked),
      cmocka_unit_test(malformed_safetensors),
      cmocka_unit_test(last_error_is_per_thread),
      cmocka_unit_test(plan_options_are_validated),
      cmocka_unit_test(cuts_inside_blocks_are_refused),
      cmocka_unit_test(split_points_with_estimates),
      cmocka_unit_test(model_module_tree),
      cmocka_unit_test(input_on_a_cuda_device),
      cmocka_unit_test(submit_wait_cancel),
      cmocka_unit_test(a_request_outlives_its_session),
      cmocka_unit_test(adaptive_microbatching),
      cmocka_unit_test(deadlines),
      cmocka_unit_test(a_wait_longer_than_the_clock_counts),
      cmocka_unit_test(on_done_and_fd_tell_a_finished_call),
      cmocka_unit_test(on_done_tells_cancel_destroy_and_deadline),
      cmocka_unit_test(many_calls_through_one_poll_loop),
      cmocka_unit_test(completion_null_arguments),
      cmocka_unit_test(specs_stats_and_trace),
      cmocka_unit_test(remaining_null_arguments),
      cmocka_unit_test(weights_from_a_sharded_checkpoint),
      cmocka_unit_test(distributed_options),
      cmocka_unit_test(device_placement),
  };
  return cmocka_run_group_tests_name("capi", tests, load_gate, NULL);
}
