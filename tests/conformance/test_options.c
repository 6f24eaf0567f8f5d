/* Conformance tests of the versioned structs' run-time defaults and size checks (pipe/pipe.h, 0.6):
 * each pipe_*_init gives what its *_INIT macro gives; an older layout's struct_size gets only that
 * layout's fields written; and a struct_size no libpipe version had is refused, by the init
 * functions and by every function that reads or fills the struct, with a message that names the
 * struct, the size given, the sizes accepted and how to initialise it. The sizes accepted are the
 * x86-64 sizes each version's pipe.h gave (git log -p of the header), written out here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <pipe/pipe.h>

_Static_assert(sizeof(void *) == 8, "the sizes below are those of a 64-bit ABI");

#define ASSERT_OK(call)                                                                              \
  do {                                                                                               \
    pipe_status st_ = (call);                                                                        \
    if (st_ != PIPE_OK) fail_msg("%s -> %s: %s", #call, pipe_status_string(st_), pipe_last_error()); \
  } while (0)

#define COUNT(a) (sizeof(a) / sizeof *(a))
#define GUARD 0xAB

/* ---- the structs: their name, how to initialise them, their historical sizes ------------------ */

typedef struct {
  const char *name, *macro, *init_function;
  size_t sizes[8]; /* one per layout a version shipped, ascending; 0 ends the list */
  size_t between;  /* a size between two layouts, or below the only one: never valid */
} versioned;

static const versioned stage_options_v = {
    "pipe_stage_options", "PIPE_STAGE_OPTIONS_INIT", "pipe_stage_options_init", {32, 40, 48, 56, 64}, 36};
static const versioned session_options_v = {"pipe_session_options",
                                            "PIPE_SESSION_OPTIONS_INIT",
                                            "pipe_session_options_init",
                                            {12, 48, 56, 64, 88, 104, 112},
                                            72};
static const versioned run_options_v = {"pipe_run_options", "PIPE_RUN_OPTIONS_INIT", "pipe_run_options_init", {16}, 8};
static const versioned stage_stats_v = {"pipe_stage_stats", "PIPE_STAGE_STATS_INIT", "pipe_stage_stats_init", {48}, 40};
static const versioned worker_options_v = {
    "pipe_worker_options", "PIPE_WORKER_OPTIONS_INIT", "pipe_worker_options_init", {32, 40}, 16};

static size_t num_sizes(const versioned *v) {
  size_t n = 0;
  while (n < COUNT(v->sizes) && v->sizes[n]) ++n;
  return n;
}

/* The sizes no version had that every check must refuse: 0, one too small to hold struct_size,
 * one past today's and one between two layouts (or a truncated only layout). For init, whose size
 * is a size_t, also today's plus 2^32, which a check that narrowed it to struct_size's uint32_t
 * would take for today's. */
static size_t bogus_sizes(const versioned *v, size_t out[5], int as_size_t) {
  size_t today = v->sizes[num_sizes(v) - 1];
  out[0] = 0;
  out[1] = 3;
  out[2] = today + 1;
  out[3] = v->between;
  out[4] = ((size_t)1 << 32) + today;
  return as_size_t ? 5 : 4;
}

/* The last error names the struct, the size given, the sizes accepted ("(12, 48, ... or 104
 * bytes)"), the macro and the init function. `given` is the size the call was given. */
static void assert_size_message(const versioned *v, size_t given, const char *call) {
  const char *msg = pipe_last_error();
  char text[128];
  if (!strstr(msg, v->name)) fail_msg("%s: message '%s' does not name %s", call, msg, v->name);
  snprintf(text, sizeof text, " is %zu,", given);
  if (!strstr(msg, text)) fail_msg("%s: message '%s' does not give the size %zu", call, msg, given);
  size_t len = (size_t)snprintf(text, sizeof text, "(");
  for (size_t i = 0, n = num_sizes(v); i < n; ++i)
    len += (size_t)snprintf(text + len, sizeof text - len, "%s%zu",
                            i == 0       ? ""
                            : i + 1 == n ? " or "
                                         : ", ",
                            v->sizes[i]);
  snprintf(text + len, sizeof text - len, " bytes)");
  if (!strstr(msg, text)) fail_msg("%s: message '%s' does not list the sizes as '%s'", call, msg, text);
  if (!strstr(msg, v->macro)) fail_msg("%s: message '%s' does not mention %s", call, msg, v->macro);
  if (!strstr(msg, v->init_function)) fail_msg("%s: message '%s' does not mention %s", call, msg, v->init_function);
}

#define ASSERT_SIZE_REFUSED(call, v, given)                                                           \
  do {                                                                                                \
    pipe_status st_ = (call);                                                                         \
    if (st_ != PIPE_ERR_INVALID_ARGUMENT)                                                             \
      fail_msg("%s with size %zu -> %s (want PIPE_ERR_INVALID_ARGUMENT): %s", #call, (size_t)(given), \
               pipe_status_string(st_), pipe_last_error());                                           \
    assert_size_message((v), (given), #call);                                                         \
  } while (0)

/* ---- each init gives exactly the macro's fields --------------------------------------------- */

#define FIELD_EQ(got, want, field) assert_memory_equal(&(got).field, &(want).field, sizeof(got).field)

/* A struct's fields end where its size says, up to the padding its alignment adds: a field
 * appended without being compared below fails here. */
#define ASSERT_LAST_FIELD(type, field)                                                                             \
  assert_int_equal(                                                                                                \
      (offsetof(type, field) + sizeof(((type *)0)->field) + _Alignof(type) - 1) / _Alignof(type) * _Alignof(type), \
      sizeof(type))

static void init_gives_the_macros_defaults(void **state) {
  (void)state;
  {
    pipe_stage_options got, want = PIPE_STAGE_OPTIONS_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_stage_options_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, dtype);
    FIELD_EQ(got, want, weights);
    FIELD_EQ(got, want, progress);
    FIELD_EQ(got, want, progress_user_data);
    FIELD_EQ(got, want, quantize);
    FIELD_EQ(got, want, quantize_group);
    FIELD_EQ(got, want, quantize_head);
    FIELD_EQ(got, want, quantize_embedding);
    ASSERT_LAST_FIELD(pipe_stage_options, quantize_embedding);
  }
  {
    pipe_session_options got, want = PIPE_SESSION_OPTIONS_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_session_options_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, num_microbatches);
    FIELD_EQ(got, want, threads_per_stage);
    FIELD_EQ(got, want, max_inflight);
    FIELD_EQ(got, want, input_specs);
    FIELD_EQ(got, want, num_input_specs);
    FIELD_EQ(got, want, output_specs);
    FIELD_EQ(got, want, num_output_specs);
    FIELD_EQ(got, want, stage_options);
    FIELD_EQ(got, want, microbatching);
    FIELD_EQ(got, want, transport);
    FIELD_EQ(got, want, world_size);
    FIELD_EQ(got, want, store);
    FIELD_EQ(got, want, comm_timeout_ms);
    FIELD_EQ(got, want, devices);
    FIELD_EQ(got, want, outputs);
    FIELD_EQ(got, want, token);
    ASSERT_LAST_FIELD(pipe_session_options, token);
  }
  {
    pipe_run_options got, want = PIPE_RUN_OPTIONS_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_run_options_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, timeout_ms);
    ASSERT_LAST_FIELD(pipe_run_options, timeout_ms);
  }
  {
    pipe_stage_stats got, want = PIPE_STAGE_STATS_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_stage_stats_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, microbatches);
    FIELD_EQ(got, want, failures);
    FIELD_EQ(got, want, busy_ms);
    FIELD_EQ(got, want, idle_ms);
    FIELD_EQ(got, want, queue_depth);
    ASSERT_LAST_FIELD(pipe_stage_stats, queue_depth);
  }
  {
    pipe_worker_options got, want = PIPE_WORKER_OPTIONS_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_worker_options_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, rank);
    FIELD_EQ(got, want, world_size);
    FIELD_EQ(got, want, store);
    FIELD_EQ(got, want, comm_timeout_ms);
    FIELD_EQ(got, want, threads_per_stage);
    FIELD_EQ(got, want, token);
    ASSERT_LAST_FIELD(pipe_worker_options, token);
  }
  {
    pipe_launch_info got, want = PIPE_LAUNCH_INFO_INIT;
    memset(&got, GUARD, sizeof got);
    ASSERT_OK(pipe_launch_info_init(&got, sizeof got));
    FIELD_EQ(got, want, struct_size);
    FIELD_EQ(got, want, rank);
    FIELD_EQ(got, want, world_size);
    FIELD_EQ(got, want, local_rank);
    FIELD_EQ(got, want, local_world_size);
    assert_int_equal(memcmp(got.launcher, want.launcher, sizeof got.launcher), 0);
    assert_int_equal(memcmp(got.store, want.store, sizeof got.store), 0);
    ASSERT_LAST_FIELD(pipe_launch_info, store);
  }
}

/* ---- an older layout gets only its own fields ------------------------------------------------- */

/* A caller built against 0.4's pipe.h has an 88-byte pipe_session_options (it ends after
 * comm_timeout_ms); one built against the first 0.1.0 header a 12-byte one. init writes their
 * fields with the macro's defaults and not one byte past them. */
static void older_sizes_get_only_their_fields(void **state) {
  (void)state;
  const pipe_session_options want = PIPE_SESSION_OPTIONS_INIT;
  const size_t old_sizes[] = {88, 12};
  for (size_t k = 0; k < COUNT(old_sizes); ++k) {
    const size_t size = old_sizes[k];
    union {
      pipe_session_options s;
      unsigned char bytes[sizeof(pipe_session_options) + 32];
    } buf;
    memset(&buf, GUARD, sizeof buf);
    ASSERT_OK(pipe_session_options_init(&buf.s, size));
    assert_int_equal(buf.s.struct_size, size);
    FIELD_EQ(buf.s, want, num_microbatches);
    FIELD_EQ(buf.s, want, threads_per_stage);
    if (size == 88) {
      FIELD_EQ(buf.s, want, max_inflight);
      FIELD_EQ(buf.s, want, input_specs);
      FIELD_EQ(buf.s, want, num_input_specs);
      FIELD_EQ(buf.s, want, output_specs);
      FIELD_EQ(buf.s, want, num_output_specs);
      FIELD_EQ(buf.s, want, stage_options);
      FIELD_EQ(buf.s, want, microbatching);
      FIELD_EQ(buf.s, want, transport);
      FIELD_EQ(buf.s, want, world_size);
      FIELD_EQ(buf.s, want, store);
      FIELD_EQ(buf.s, want, comm_timeout_ms);
      assert_int_equal(offsetof(pipe_session_options, devices), 88); /* the first 0.5 field */
    }
    for (size_t i = size; i < sizeof buf.bytes; ++i)
      if (buf.bytes[i] != GUARD) fail_msg("init with struct_size %zu wrote byte %zu", size, i);
  }
}

/* ---- sizes no version had are refused by init ---------------------------------------------- */

/* The struct is left as it was (output parameters are written only on success). */
#define INIT_REFUSES(type, init, v)                                                  \
  do {                                                                               \
    size_t bad[5];                                                                   \
    size_t n = bogus_sizes(&(v), bad, 1);                                            \
    for (size_t i = 0; i < n; ++i) {                                                 \
      type s;                                                                        \
      memset(&s, GUARD, sizeof s);                                                   \
      ASSERT_SIZE_REFUSED(init(&s, bad[i]), &(v), bad[i]);                           \
      for (size_t b = 0; b < sizeof s; ++b)                                          \
        if (((unsigned char *)&s)[b] != GUARD) fail_msg(#init " wrote byte %zu", b); \
    }                                                                                \
    for (size_t i = 0; i < num_sizes(&(v)); ++i) {                                   \
      type s;                                                                        \
      ASSERT_OK(init(&s, (v).sizes[i]));                                             \
      assert_int_equal(s.struct_size, (v).sizes[i]);                                 \
    }                                                                                \
    assert_int_equal(init(NULL, sizeof(type)), PIPE_ERR_INVALID_ARGUMENT);           \
    assert_non_null(strstr(pipe_last_error(), "NULL"));                              \
  } while (0)

static void init_refuses_sizes_no_version_had(void **state) {
  (void)state;
  INIT_REFUSES(pipe_stage_options, pipe_stage_options_init, stage_options_v);
  INIT_REFUSES(pipe_session_options, pipe_session_options_init, session_options_v);
  INIT_REFUSES(pipe_run_options, pipe_run_options_init, run_options_v);
  INIT_REFUSES(pipe_stage_stats, pipe_stage_stats_init, stage_stats_v);
  INIT_REFUSES(pipe_worker_options, pipe_worker_options_init, worker_options_v);
}

/* ---- ... and by every function that takes the struct ------------------------------------------ */

typedef struct {
  pipe_model *model;
  pipe_plan *plan;
  pipe_tensor_list *inputs;
  const DLManagedTensor *args[8];
  size_t num_args;
  pipe_session *session;
} fixture;

static void open_fixture(fixture *f) {
  const char *dir = getenv("PIPE_TEST_MODELS");
  char path[4096];
  memset(f, 0, sizeof *f);
  snprintf(path, sizeof path, "%s/example_code.traced.pt", dir ? dir : ".");
  ASSERT_OK(pipe_model_load(path, &f->model));
  ASSERT_OK(pipe_plan_create(f->model, NULL, &f->plan));
  snprintf(path, sizeof path, "%s/example_code.inputs.safetensors", dir ? dir : ".");
  ASSERT_OK(pipe_safetensors_read(path, &f->inputs));
  ASSERT_OK(pipe_model_num_inputs(f->model, &f->num_args));
  assert_true(f->num_args <= COUNT(f->args));
  for (size_t i = 0; i < f->num_args; ++i) {
    const char *name = NULL;
    size_t index = 0;
    ASSERT_OK(pipe_model_input_name(f->model, i, &name));
    ASSERT_OK(pipe_tensor_list_find(f->inputs, name, &index));
    ASSERT_OK(pipe_tensor_list_get(f->inputs, index, &f->args[i]));
  }
  ASSERT_OK(pipe_session_create(f->plan, NULL, &f->session));
}

static void close_fixture(fixture *f) {
  pipe_session_destroy(f->session);
  pipe_tensor_list_destroy(f->inputs);
  pipe_plan_destroy(f->plan);
  pipe_model_destroy(f->model);
}

/* An older caller's pipe_stage_options of `size` bytes, followed by bytes that are no valid value of any later
 * field: a session is made from it, so nothing past `size` was read. */
static void older_stage_options_are_read_to_their_end(pipe_plan *plan, size_t size) {
  union {
    pipe_stage_options so;
    unsigned char bytes[sizeof(pipe_stage_options)];
  } buf;
  memset(&buf, GUARD, sizeof buf);
  ASSERT_OK(pipe_stage_options_init(&buf.so, size));
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  pipe_session *s = NULL;
  o.stage_options = &buf.so;
  ASSERT_OK(pipe_session_create(plan, &o, &s));
  pipe_session_destroy(s);
}

/* pipe_stage_options.quantize_head (0.16): a value outside PIPE_QUANTIZE_HEAD_*, or any but the default without
 * quantized weights, is PIPE_ERR_INVALID_ARGUMENT naming the field and what to do, with no session made; each
 * value with int8 or int4 weights passes the options' checks (the session is made where the CPU has AVX-512, else
 * refused for that reason only), and so does quantize_group with an int4 head under int8 weights. */
static void quantize_head_needs_quantized_weights(void **state) {
  (void)state;
  fixture f;
  open_fixture(&f);
  const struct {
    int32_t quantize, head;
    int64_t group;
    const char *message; /* NULL: accepted */
  } cases[] = {
      {PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_HEAD_INT8, 0, "set quantize to PIPE_QUANTIZE_INT8 or PIPE_QUANTIZE_INT4"},
      {PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_HEAD_INT4, 0, "needs quantized weights"},
      {PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_HEAD_NONE, 0, "leave quantize_head PIPE_QUANTIZE_HEAD_DEFAULT"},
      {PIPE_QUANTIZE_INT8, 4, 0, "quantize_head 4 is not PIPE_QUANTIZE_HEAD_DEFAULT"},
      {PIPE_QUANTIZE_INT4, -1, 0, "quantize_head -1 is not"},
      {PIPE_QUANTIZE_INT8, PIPE_QUANTIZE_HEAD_INT8, 64, "quantize_group 64 is for PIPE_QUANTIZE_INT4 only"},
      {PIPE_QUANTIZE_INT8, PIPE_QUANTIZE_HEAD_DEFAULT, 0, NULL},
      {PIPE_QUANTIZE_INT8, PIPE_QUANTIZE_HEAD_INT4, 64, NULL},
      {PIPE_QUANTIZE_INT8, PIPE_QUANTIZE_HEAD_NONE, 0, NULL},
      {PIPE_QUANTIZE_INT4, PIPE_QUANTIZE_HEAD_INT4, 128, NULL},
      {PIPE_QUANTIZE_INT4, PIPE_QUANTIZE_HEAD_INT8, 0, NULL},
      {PIPE_QUANTIZE_INT4, PIPE_QUANTIZE_HEAD_NONE, 0, NULL},
  };
  for (size_t i = 0; i < COUNT(cases); ++i) {
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    pipe_session *s = NULL;
    so.quantize = cases[i].quantize;
    so.quantize_head = cases[i].head;
    so.quantize_group = cases[i].group;
    o.stage_options = &so;
    const pipe_status st = pipe_session_create(f.plan, &o, &s);
    if (cases[i].message) {
      if (st != PIPE_ERR_INVALID_ARGUMENT || !strstr(pipe_last_error(), cases[i].message) ||
          !strstr(pipe_last_error(), "quantize_"))
        fail_msg("case %zu: %s: %s (expected PIPE_ERR_INVALID_ARGUMENT saying '%s')", i, pipe_status_string(st),
                 pipe_last_error(), cases[i].message);
      assert_null(s);
    } else if (st == PIPE_ERR_UNSUPPORTED) {
      if (!strstr(pipe_last_error(), "AVX-512")) fail_msg("case %zu: %s", i, pipe_last_error());
    } else {
      if (st != PIPE_OK) fail_msg("case %zu: %s: %s", i, pipe_status_string(st), pipe_last_error());
      pipe_session_destroy(s);
    }
  }
  /* A 0.14 caller's struct ends before quantize_head: whatever lies beyond is not read. */
  older_stage_options_are_read_to_their_end(f.plan, offsetof(pipe_stage_options, quantize_head));
  close_fixture(&f);
}

/* pipe_stage_options.quantize_embedding (0.17): a value outside PIPE_QUANTIZE_EMBEDDING_* is PIPE_ERR_INVALID_ARGUMENT
 * naming the field and the values to set, from pipe_session_create and pipe_plan_stage_weight_bytes alike, with
 * no session made; PIPE_QUANTIZE_EMBEDDING_INT8 is accepted alone (a memory choice, no quantize needed) and with
 * quantized weights; an exported (.pt2) model refuses it with PIPE_ERR_UNSUPPORTED saying what to do; a 0.16
 * caller's struct, which ends before the field, is not read past its end. */
static void quantize_embedding_values(void **state) {
  (void)state;
  fixture f;
  open_fixture(&f);
  const struct {
    int32_t quantize;
    int64_t embedding;
    const char *message; /* NULL: accepted */
  } cases[] = {
      {PIPE_QUANTIZE_NONE, 2,
       "quantize_embedding 2 is not PIPE_QUANTIZE_EMBEDDING_NONE or PIPE_QUANTIZE_EMBEDDING_INT8"},
      {PIPE_QUANTIZE_INT8, -1, "quantize_embedding -1 is not"},
      {PIPE_QUANTIZE_NONE, (int64_t)1 << 32, "quantize_embedding 4294967296 is not"},
      {PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_EMBEDDING_NONE, NULL},
      {PIPE_QUANTIZE_NONE, PIPE_QUANTIZE_EMBEDDING_INT8, NULL},
      {PIPE_QUANTIZE_INT8, PIPE_QUANTIZE_EMBEDDING_INT8, NULL},
      {PIPE_QUANTIZE_INT4, PIPE_QUANTIZE_EMBEDDING_INT8, NULL},
  };
  for (size_t i = 0; i < COUNT(cases); ++i) {
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    pipe_session *s = NULL;
    uint64_t bytes = 7;
    so.quantize = cases[i].quantize;
    so.quantize_embedding = cases[i].embedding;
    o.stage_options = &so;
    const pipe_status st = pipe_session_create(f.plan, &o, &s);
    if (cases[i].message) {
      if (st != PIPE_ERR_INVALID_ARGUMENT || !strstr(pipe_last_error(), cases[i].message))
        fail_msg("case %zu: %s: %s (expected PIPE_ERR_INVALID_ARGUMENT saying '%s')", i, pipe_status_string(st),
                 pipe_last_error(), cases[i].message);
      assert_null(s);
      if (pipe_plan_stage_weight_bytes(f.plan, 0, &so, &bytes) != PIPE_ERR_INVALID_ARGUMENT ||
          !strstr(pipe_last_error(), cases[i].message))
        fail_msg("case %zu: pipe_plan_stage_weight_bytes: %s", i, pipe_last_error());
      assert_int_equal(bytes, 7);
    } else if (st == PIPE_ERR_UNSUPPORTED && cases[i].quantize != PIPE_QUANTIZE_NONE) {
      if (!strstr(pipe_last_error(), "AVX-512")) fail_msg("case %zu: %s", i, pipe_last_error());
    } else {
      if (st != PIPE_OK) fail_msg("case %zu: %s: %s", i, pipe_status_string(st), pipe_last_error());
      pipe_session_destroy(s);
    }
  }
  /* A 0.16 caller's struct ends before quantize_embedding: whatever lies beyond is not read. */
  older_stage_options_are_read_to_their_end(f.plan, offsetof(pipe_stage_options, quantize_embedding));
  close_fixture(&f);
  /* An exported program runs its graph as archived: no lookup to rewrite. */
  {
    const char *dir = getenv("PIPE_TEST_MODELS");
    char path[4096];
    pipe_model *model = NULL;
    pipe_plan *plan = NULL;
    pipe_session *s = NULL;
    snprintf(path, sizeof path, "%s/exported/example_code.pt2", dir ? dir : ".");
    ASSERT_OK(pipe_model_load(path, &model));
    ASSERT_OK(pipe_plan_create(model, NULL, &plan));
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    so.quantize_embedding = PIPE_QUANTIZE_EMBEDDING_INT8;
    o.stage_options = &so;
    const pipe_status st = pipe_session_create(plan, &o, &s);
    if (st != PIPE_ERR_UNSUPPORTED || !strstr(pipe_last_error(), "not exported (.pt2) ones") ||
        !strstr(pipe_last_error(), "PIPE_QUANTIZE_EMBEDDING_NONE"))
      fail_msg("exported: %s: %s", pipe_status_string(st), pipe_last_error());
    assert_null(s);
    uint64_t bytes = 0;
    if (pipe_plan_stage_weight_bytes(plan, 0, &so, &bytes) != PIPE_ERR_UNSUPPORTED)
      fail_msg("exported weight bytes: %s", pipe_last_error());
    pipe_plan_destroy(plan);
    pipe_model_destroy(model);
  }
}

/* Each function first accepts a struct from init (every historical size, for the session
 * options), so a refusal below is the size's doing, then refuses each bogus size. */
static void consumers_refuse_sizes_no_version_had(void **state) {
  (void)state;
  fixture f;
  open_fixture(&f);
  size_t bad[5], n;

  /* pipe_session_create: the session options, and the stage options they point to. */
  for (size_t i = 0; i < num_sizes(&session_options_v); ++i) {
    pipe_session_options o;
    pipe_session *s = NULL;
    ASSERT_OK(pipe_session_options_init(&o, session_options_v.sizes[i]));
    ASSERT_OK(pipe_session_create(f.plan, &o, &s));
    pipe_session_destroy(s);
  }
  n = bogus_sizes(&session_options_v, bad, 0);
  for (size_t i = 0; i < n; ++i) {
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    pipe_session *s = NULL;
    o.struct_size = (uint32_t)bad[i];
    ASSERT_SIZE_REFUSED(pipe_session_create(f.plan, &o, &s), &session_options_v, (uint32_t)bad[i]);
    assert_null(s);
  }
  n = bogus_sizes(&stage_options_v, bad, 0);
  for (size_t i = 0; i < n; ++i) {
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
    pipe_session *s = NULL;
    so.struct_size = (uint32_t)bad[i];
    o.stage_options = &so;
    ASSERT_SIZE_REFUSED(pipe_session_create(f.plan, &o, &s), &stage_options_v, (uint32_t)bad[i]);
    assert_null(s);
  }

  /* pipe_plan_save_stage: the stage options (checked before anything is written). */
  char path[64];
  snprintf(path, sizeof path, "/tmp/libpipe-test-options-%ld.pt", (long)getpid());
  {
    pipe_stage_options so;
    ASSERT_OK(pipe_stage_options_init(&so, sizeof so));
    ASSERT_OK(pipe_plan_save_stage(f.plan, 0, &so, path));
    assert_int_equal(unlink(path), 0);
  }
  for (size_t i = 0; i < n; ++i) {
    pipe_stage_options so = PIPE_STAGE_OPTIONS_INIT;
    so.struct_size = (uint32_t)bad[i];
    ASSERT_SIZE_REFUSED(pipe_plan_save_stage(f.plan, 0, &so, path), &stage_options_v, (uint32_t)bad[i]);
    assert_int_equal(access(path, F_OK), -1);
  }

  /* pipe_session_run and pipe_session_submit: the run options. */
  {
    pipe_run_options ro;
    pipe_tensor_list *out = NULL;
    pipe_request *r = NULL;
    ASSERT_OK(pipe_run_options_init(&ro, sizeof ro));
    ASSERT_OK(pipe_session_run(f.session, f.args, f.num_args, &ro, &out));
    pipe_tensor_list_destroy(out);
    ASSERT_OK(pipe_session_submit(f.session, f.args, f.num_args, &ro, &r));
    out = NULL;
    ASSERT_OK(pipe_request_wait(r, -1, &out));
    pipe_tensor_list_destroy(out);
    pipe_request_destroy(r);
  }
  n = bogus_sizes(&run_options_v, bad, 0);
  for (size_t i = 0; i < n; ++i) {
    pipe_run_options ro = PIPE_RUN_OPTIONS_INIT;
    pipe_tensor_list *out = NULL;
    pipe_request *r = NULL;
    ro.struct_size = (uint32_t)bad[i];
    ASSERT_SIZE_REFUSED(pipe_session_run(f.session, f.args, f.num_args, &ro, &out), &run_options_v, (uint32_t)bad[i]);
    assert_null(out);
    ASSERT_SIZE_REFUSED(pipe_session_submit(f.session, f.args, f.num_args, &ro, &r), &run_options_v, (uint32_t)bad[i]);
    assert_null(r);
  }

  /* pipe_session_stage_stats: the statistics it fills, left untouched when refused. */
  {
    pipe_stage_stats st;
    ASSERT_OK(pipe_stage_stats_init(&st, sizeof st));
    ASSERT_OK(pipe_session_stage_stats(f.session, 0, &st));
  }
  n = bogus_sizes(&stage_stats_v, bad, 0);
  for (size_t i = 0; i < n; ++i) {
    pipe_stage_stats st;
    memset(&st, GUARD, sizeof st);
    st.struct_size = (uint32_t)bad[i];
    ASSERT_SIZE_REFUSED(pipe_session_stage_stats(f.session, 0, &st), &stage_stats_v, (uint32_t)bad[i]);
    for (size_t b = sizeof st.struct_size; b < sizeof st; ++b)
      if (((unsigned char *)&st)[b] != GUARD) fail_msg("pipe_session_stage_stats wrote byte %zu", b);
  }

  /* pipe_worker_run: with today's size it gets as far as the rank (0 is the driver's), which
   * shows the size passed; the bogus sizes stop it before that. */
  {
    pipe_worker_options w;
    ASSERT_OK(pipe_worker_options_init(&w, sizeof w));
    w.world_size = 2;
    w.store = "127.0.0.1:1";
    assert_int_equal(pipe_worker_run(&w), PIPE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(pipe_last_error(), "rank 0 is the driver"));
  }
  n = bogus_sizes(&worker_options_v, bad, 0);
  for (size_t i = 0; i < n; ++i) {
    pipe_worker_options w = PIPE_WORKER_OPTIONS_INIT;
    w.rank = 1;
    w.world_size = 2;
    w.store = "127.0.0.1:1";
    w.comm_timeout_ms = 100; /* were the size taken, the failure to connect comes soon */
    w.struct_size = (uint32_t)bad[i];
    ASSERT_SIZE_REFUSED(pipe_worker_run(&w), &worker_options_v, (uint32_t)bad[i]);
  }
  close_fixture(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(init_gives_the_macros_defaults),        cmocka_unit_test(older_sizes_get_only_their_fields),
      cmocka_unit_test(init_refuses_sizes_no_version_had),     cmocka_unit_test(consumers_refuse_sizes_no_version_had),
      cmocka_unit_test(quantize_head_needs_quantized_weights), cmocka_unit_test(quantize_embedding_values),
  };
  return cmocka_run_group_tests_name("options", tests, NULL, NULL);
}
