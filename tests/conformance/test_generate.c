/* Conformance tests of token generation through the C ABI (pipe/pipe.h, "Generation", 0.8), in C,
 * against libpipe.so: greedy generation of the tiny decoder equals transformers' greedy tokens for
 * the same weights (tiny_decoder.expected.json, written by tests/models/decoder_models.py), tokens
 * are told by callback and descriptor as documented, and every failure returns its status and a
 * message without touching outputs. Steps are held with the gated decoder (tests/gate): a prefill
 * row whose first token is 119 + key holds its step in stage 1 at gate `key`; 119 fails the step. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include <pipe/pipe.h>

#include "../gate/gate.h"

/* ---- the ABI's layout, frozen: a change here is an ABI break (see README) ------------------- */

_Static_assert(sizeof(void *) == 8, "the sizes below are those of a 64-bit ABI");
_Static_assert(PIPE_ERR_BUSY == 15, "status codes");
_Static_assert(PIPE_FINISH_NONE == 0 && PIPE_FINISH_STOP == 1 && PIPE_FINISH_LENGTH == 2 &&
                   PIPE_FINISH_CANCELLED == 3 && PIPE_FINISH_DEADLINE == 4 && PIPE_FINISH_ERROR == 5,
               "finish reasons");
_Static_assert(sizeof(pipe_generator_options) == 40 && offsetof(pipe_generator_options, struct_size) == 0 &&
                   offsetof(pipe_generator_options, max_queued) == 8 &&
                   offsetof(pipe_generator_options, prefill_chunk) == 16 &&
                   offsetof(pipe_generator_options, steps_in_flight) == 24 &&
                   offsetof(pipe_generator_options, max_rows_per_step) == 32,
               "pipe_generator_options");
_Static_assert(sizeof(pipe_generator_info) == 40 && offsetof(pipe_generator_info, struct_size) == 0 &&
                   offsetof(pipe_generator_info, slots) == 8 && offsetof(pipe_generator_info, max_len) == 16 &&
                   offsetof(pipe_generator_info, vocab) == 24 &&
                   offsetof(pipe_generator_info, cache_bytes_per_slot) == 32,
               "pipe_generator_info");
_Static_assert(sizeof(pipe_generation_options) == 88 && offsetof(pipe_generation_options, struct_size) == 0 &&
                   offsetof(pipe_generation_options, max_new_tokens) == 8 &&
                   offsetof(pipe_generation_options, temperature) == 16 &&
                   offsetof(pipe_generation_options, top_k) == 24 && offsetof(pipe_generation_options, top_p) == 32 &&
                   offsetof(pipe_generation_options, seed) == 40 && offsetof(pipe_generation_options, stop_ids) == 48 &&
                   offsetof(pipe_generation_options, num_stop_ids) == 56 &&
                   offsetof(pipe_generation_options, timeout_ms) == 64 &&
                   offsetof(pipe_generation_options, logprobs) == 72 &&
                   offsetof(pipe_generation_options, top_logprobs) == 76 &&
                   offsetof(pipe_generation_options, prompt_logprobs) == 80,
               "pipe_generation_options");
_Static_assert(sizeof(pipe_generation_info) == 56 && offsetof(pipe_generation_info, struct_size) == 0 &&
                   offsetof(pipe_generation_info, finish_reason) == 4 &&
                   offsetof(pipe_generation_info, prompt_tokens) == 8 &&
                   offsetof(pipe_generation_info, generated_tokens) == 16 &&
                   offsetof(pipe_generation_info, queued_ms) == 24 &&
                   offsetof(pipe_generation_info, time_to_first_token_ms) == 32 &&
                   offsetof(pipe_generation_info, mean_inter_token_ms) == 40 &&
                   offsetof(pipe_generation_info, cached_tokens) == 48,
               "pipe_generation_info");
_Static_assert(sizeof(pipe_generator_stats) == 128 && offsetof(pipe_generator_stats, struct_size) == 0 &&
                   offsetof(pipe_generator_stats, slots_in_use) == 8 && offsetof(pipe_generator_stats, queued) == 16 &&
                   offsetof(pipe_generator_stats, sequences_finished) == 24 &&
                   offsetof(pipe_generator_stats, prompt_tokens) == 32 &&
                   offsetof(pipe_generator_stats, generated_tokens) == 40 &&
                   offsetof(pipe_generator_stats, steps) == 48 && offsetof(pipe_generator_stats, tokens_per_s) == 56 &&
                   offsetof(pipe_generator_stats, mean_time_to_first_token_ms) == 64 &&
                   offsetof(pipe_generator_stats, mean_inter_token_ms) == 72 &&
                   offsetof(pipe_generator_stats, mean_rows_per_step) == 80 &&
                   offsetof(pipe_generator_stats, sampling_ms) == 88 &&
                   offsetof(pipe_generator_stats, steps_in_flight) == 96 &&
                   offsetof(pipe_generator_stats, steps_one_at_a_time) == 104 &&
                   offsetof(pipe_generator_stats, steps_pipelined) == 112 &&
                   offsetof(pipe_generator_stats, cached_prompt_tokens) == 120,
               "pipe_generator_stats");

/* The tiny decoder's configuration (tests/models/decoder_models.py: hf_model's LlamaConfig and the
 * cache it is built with): 2 layers, hidden 64 over 4 heads (head_dim 16), 2 key/value heads,
 * float32, 4 slots of 64 positions. Its caches hold K and V per layer: 2 x 2 x kv_heads x max_len x
 * head_dim x 4 bytes per slot. */
enum { LAYERS = 2, KV_HEADS = 2, HEAD_DIM = 64 / 4, SLOTS = 4, MAX_LEN = 64, VOCAB = 128 };
#define CACHE_BYTES_PER_SLOT ((uint64_t)LAYERS * 2 * KV_HEADS * MAX_LEN * HEAD_DIM * 4)
#define SPLIT "model.layers.1:begin" /* two stages, one layer each */
#define WAIT_LIMIT_MS (GATE_WAIT_LIMIT_S * 1000)

static const char *fixture(const char *name) {
  static _Thread_local char path[4096];
  const char *dir = getenv("PIPE_TEST_MODELS");
  snprintf(path, sizeof path, "%s/%s", dir ? dir : ".", name);
  return path;
}

#define ASSERT_OK(call)                                                                              \
  do {                                                                                               \
    pipe_status st_ = (call);                                                                        \
    if (st_ != PIPE_OK) fail_msg("%s -> %s: %s", #call, pipe_status_string(st_), pipe_last_error()); \
  } while (0)

/* Asserts a call fails with `status` and leaves a message containing `needle`. */
#define ASSERT_FAILS(call, status, needle)                                                           \
  do {                                                                                               \
    pipe_status st_ = (call);                                                                        \
    if (st_ != (status))                                                                             \
      fail_msg("%s -> %s (want %s): %s", #call, pipe_status_string(st_), pipe_status_string(status), \
               pipe_last_error());                                                                   \
    if (strstr(pipe_last_error(), (needle)) == NULL)                                                 \
      fail_msg("%s: message '%s' does not mention '%s'", #call, pipe_last_error(), (needle));        \
  } while (0)

/* ---- the reference: tiny_decoder.expected.json, read by a reader for its few shapes -------- */

#define MAX_PROMPTS 8
#define MAX_IDS 64

typedef struct {
  size_t len;
  int64_t ids[MAX_IDS];
} id_list;

typedef struct {
  size_t num_prompts;
  id_list prompts[MAX_PROMPTS];
  id_list greedy[MAX_PROMPTS]; /* the max_new_tokens tokens after each prompt */
  int64_t max_new_tokens, vocab, slots, max_len;
  id_list max_len_prompt, max_len_greedy; /* every token max_len positions have room for */
} reference;

static const char *skip_space(const char *p) {
  while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') ++p;
  return p;
}

/* The text after `"key":` in a JSON object of unique keys. */
static const char *json_value(const char *text, const char *key) {
  char quoted[64];
  snprintf(quoted, sizeof quoted, "\"%s\"", key);
  const char *p = strstr(text, quoted);
  if (!p) fail_msg("tiny_decoder.expected.json has no %s", quoted);
  p = skip_space(p + strlen(quoted));
  assert_int_equal(*p, ':');
  return skip_space(p + 1);
}

static int64_t json_int(const char **p) {
  char *end = NULL;
  errno = 0;
  const long long v = strtoll(*p, &end, 10);
  if (end == *p || errno) fail_msg("tiny_decoder.expected.json: no integer at '%.20s'", *p);
  *p = skip_space(end);
  return (int64_t)v;
}

/* [1, 2, 3] */
static void json_ids(const char **p, id_list *out) {
  assert_int_equal(**p, '[');
  *p = skip_space(*p + 1);
  out->len = 0;
  while (**p != ']') {
    assert_true(out->len < MAX_IDS);
    out->ids[out->len++] = json_int(p);
    if (**p == ',') *p = skip_space(*p + 1);
  }
  *p = skip_space(*p + 1);
}

/* [[1, 2], [3]] */
static size_t json_id_lists(const char **p, id_list *out) {
  size_t n = 0;
  assert_int_equal(**p, '[');
  *p = skip_space(*p + 1);
  while (**p != ']') {
    assert_true(n < MAX_PROMPTS);
    json_ids(p, &out[n++]);
    if (**p == ',') *p = skip_space(*p + 1);
  }
  *p = skip_space(*p + 1);
  return n;
}

static void load_reference(reference *r) {
  FILE *f = fopen(fixture("tiny_decoder.expected.json"), "rb");
  if (!f) fail_msg("cannot open %s (made by the decoder_models fixture)", fixture("tiny_decoder.expected.json"));
  static char text[1 << 16];
  const size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  assert_true(n > 0 && n < sizeof text - 1);
  text[n] = '\0';
  memset(r, 0, sizeof *r);
  const char *p = json_value(text, "prompts");
  r->num_prompts = json_id_lists(&p, r->prompts);
  p = json_value(text, "greedy");
  assert_int_equal(json_id_lists(&p, r->greedy), r->num_prompts);
  p = json_value(text, "max_new_tokens");
  r->max_new_tokens = json_int(&p);
  p = json_value(text, "vocab");
  r->vocab = json_int(&p);
  p = json_value(text, "slots");
  r->slots = json_int(&p);
  p = json_value(text, "max_len");
  r->max_len = json_int(&p);
  p = json_value(text, "max_len_prompt");
  json_ids(&p, &r->max_len_prompt);
  p = json_value(text, "max_len_greedy");
  json_ids(&p, &r->max_len_greedy);
  assert_true(r->num_prompts >= 2);
  for (size_t i = 0; i < r->num_prompts; ++i) assert_int_equal(r->greedy[i].len, (size_t)r->max_new_tokens);
  /* The constants above describe this fixture. */
  assert_int_equal(r->vocab, VOCAB);
  assert_int_equal(r->slots, SLOTS);
  assert_int_equal(r->max_len, MAX_LEN);
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* A generator of `model_file` cut in two stages at SPLIT; the plan and model go at once (the
 * generator keeps what it needs). steps_in_flight 0 and max_queued 0 are the defaults. */
static pipe_generator *make_generator(const char *model_file, int64_t steps_in_flight, int64_t max_queued) {
  pipe_model *model = NULL;
  pipe_plan_options *po = NULL;
  pipe_plan *plan = NULL;
  pipe_generator *generator = NULL;
  ASSERT_OK(pipe_model_load(fixture(model_file), &model));
  ASSERT_OK(pipe_plan_options_create(&po));
  ASSERT_OK(pipe_plan_options_add_split_point(po, SPLIT));
  ASSERT_OK(pipe_plan_create(model, po, &plan));
  pipe_generator_options go = PIPE_GENERATOR_OPTIONS_INIT;
  go.steps_in_flight = steps_in_flight;
  go.max_queued = max_queued;
  ASSERT_OK(pipe_generator_create(plan, NULL, &go, &generator));
  assert_non_null(generator);
  pipe_plan_destroy(plan);
  pipe_plan_options_destroy(po);
  pipe_model_destroy(model);
  return generator;
}

static pipe_generation *submit(pipe_generator *g, const int64_t *prompt, size_t len, int64_t max_new_tokens) {
  pipe_generation_options o = PIPE_GENERATION_OPTIONS_INIT;
  o.max_new_tokens = max_new_tokens;
  pipe_generation *generation = NULL;
  ASSERT_OK(pipe_generator_submit(g, prompt, len, &o, &generation));
  assert_non_null(generation);
  return generation;
}

/* Every unread token of `g` into `out` (appended at out->len); returns `finished`. */
static int32_t read_all(pipe_generation *g, id_list *out) {
  size_t count = 0;
  int32_t finished = 0;
  do {
    ASSERT_OK(pipe_generation_read(g, out->ids + out->len, MAX_IDS - out->len, &count, &finished));
    out->len += count;
  } while (count > 0 && out->len < MAX_IDS);
  return finished;
}

static int contains(const id_list *list, int64_t id) {
  for (size_t i = 0; i < list->len; ++i)
    if (list->ids[i] == id) return 1;
  return 0;
}

static void assert_ids_equal(const id_list *got, const id_list *want, const char *what) {
  int same = got->len == want->len;
  for (size_t i = 0; same && i < got->len; ++i) same = got->ids[i] == want->ids[i];
  if (same) return;
  char text[1024];
  size_t n = 0;
  n += (size_t)snprintf(text + n, sizeof text - n, "%s: got", what);
  for (size_t i = 0; i < got->len && n < 900; ++i)
    n += (size_t)snprintf(text + n, sizeof text - n, " %lld", (long long)got->ids[i]);
  n += (size_t)snprintf(text + n, sizeof text - n, ", want");
  for (size_t i = 0; i < want->len && n < 1000; ++i)
    n += (size_t)snprintf(text + n, sizeof text - n, " %lld", (long long)want->ids[i]);
  fail_msg("%s", text);
}

/* 1 if `fd` is readable within timeout_ms (0: now, as it is), 0 if not. */
static int readable(int fd, int timeout_ms) {
  struct pollfd p = {fd, POLLIN, 0};
  const int n = poll(&p, 1, timeout_ms);
  assert_true(n >= 0);
  return n == 1 && (p.revents & POLLIN) != 0;
}

static pipe_generation_info info_of(const pipe_generation *g) {
  pipe_generation_info info = PIPE_GENERATION_INFO_INIT;
  ASSERT_OK(pipe_generation_get_info(g, &info));
  return info;
}

static pipe_generator_stats stats_of(const pipe_generator *g) {
  pipe_generator_stats stats = PIPE_GENERATOR_STATS_INIT;
  ASSERT_OK(pipe_generator_get_stats(g, &stats));
  return stats;
}

static int64_t monotonic_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Waits until every token the generator has sampled is handed to `a` (its only generating
 * sequence): tokens are handed out just after the scheduler launched its next step. 1 once they
 * are, 0 if that never happens within the bound (a hung test). */
static int wait_delivered(const pipe_generation *a, const pipe_generator *g) {
  const int64_t give_up = monotonic_ms() + WAIT_LIMIT_MS;
  while (info_of(a).generated_tokens != (int64_t)stats_of(g).generated_tokens) {
    if (monotonic_ms() > give_up) return 0;
    const struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
  return 1;
}

/* A prompt whose prefill holds its step at gate `key` (119 + key, then two ordinary ids). */
static void gated_prompt(int64_t key, int64_t out[3]) {
  assert_true(key >= 1 && key <= 8); /* ids 120..127 */
  out[0] = 119 + key;
  out[1] = 5;
  out[2] = 7;
}

/* ---- the versioned structs ----------------------------------------------------------------- */

/* Each pipe_*_init gives its *_INIT macro's fields; struct_size is the size given. */
static void init_functions_equal_macros(void **state) {
  (void)state;
  pipe_generator_options go, go_macro = PIPE_GENERATOR_OPTIONS_INIT;
  memset(&go, 0xAB, sizeof go);
  ASSERT_OK(pipe_generator_options_init(&go, sizeof go));
  assert_int_equal(go.struct_size, sizeof go);
  assert_int_equal(go_macro.struct_size, sizeof go);
  assert_int_equal(go.max_queued, go_macro.max_queued);
  assert_int_equal(go.prefill_chunk, go_macro.prefill_chunk);
  assert_int_equal(go.steps_in_flight, go_macro.steps_in_flight);
  assert_int_equal(go.max_rows_per_step, go_macro.max_rows_per_step);
  assert_int_equal(go.max_queued, 0);

  pipe_generator_info gi, gi_macro = PIPE_GENERATOR_INFO_INIT;
  memset(&gi, 0xAB, sizeof gi);
  ASSERT_OK(pipe_generator_info_init(&gi, sizeof gi));
  assert_int_equal(gi.struct_size, sizeof gi);
  assert_int_equal(gi_macro.struct_size, sizeof gi);
  assert_int_equal(gi.slots, gi_macro.slots);
  assert_int_equal(gi.max_len, gi_macro.max_len);
  assert_int_equal(gi.vocab, gi_macro.vocab);
  assert_int_equal(gi.cache_bytes_per_slot, gi_macro.cache_bytes_per_slot);

  pipe_generation_options o, o_macro = PIPE_GENERATION_OPTIONS_INIT;
  memset(&o, 0xAB, sizeof o);
  ASSERT_OK(pipe_generation_options_init(&o, sizeof o));
  assert_int_equal(o.struct_size, sizeof o);
  assert_int_equal(o_macro.struct_size, sizeof o);
  assert_int_equal(o.max_new_tokens, o_macro.max_new_tokens);
  assert_int_equal(o.max_new_tokens, 16);
  assert_true(o.temperature == o_macro.temperature && o.temperature == 0.0);
  assert_int_equal(o.top_k, o_macro.top_k);
  assert_true(o.top_p == o_macro.top_p && o.top_p == 1.0);
  assert_int_equal(o.seed, o_macro.seed);
  assert_null(o.stop_ids);
  assert_null(o_macro.stop_ids);
  assert_int_equal(o.num_stop_ids, o_macro.num_stop_ids);
  assert_int_equal(o.timeout_ms, o_macro.timeout_ms);
  assert_int_equal(o.logprobs, o_macro.logprobs);
  assert_int_equal(o.top_logprobs, o_macro.top_logprobs);
  assert_int_equal(o.prompt_logprobs, o_macro.prompt_logprobs);
  assert_int_equal(o.prompt_logprobs, 0);
  assert_int_equal(o.logprobs, 0);

  pipe_generation_info i, i_macro = PIPE_GENERATION_INFO_INIT;
  memset(&i, 0xAB, sizeof i);
  ASSERT_OK(pipe_generation_info_init(&i, sizeof i));
  assert_int_equal(i.struct_size, sizeof i);
  assert_int_equal(i_macro.struct_size, sizeof i);
  assert_int_equal(i.finish_reason, i_macro.finish_reason);
  assert_int_equal(i.prompt_tokens, i_macro.prompt_tokens);
  assert_int_equal(i.generated_tokens, i_macro.generated_tokens);
  assert_true(i.queued_ms == i_macro.queued_ms && i.queued_ms == -1.0);
  assert_true(i.time_to_first_token_ms == i_macro.time_to_first_token_ms && i.time_to_first_token_ms == -1.0);
  assert_true(i.mean_inter_token_ms == i_macro.mean_inter_token_ms && i.mean_inter_token_ms == -1.0);
  assert_int_equal(i.cached_tokens, i_macro.cached_tokens);

  pipe_generator_stats s, s_macro = PIPE_GENERATOR_STATS_INIT;
  memset(&s, 0xAB, sizeof s);
  ASSERT_OK(pipe_generator_stats_init(&s, sizeof s));
  assert_int_equal(s.struct_size, sizeof s);
  assert_int_equal(s_macro.struct_size, sizeof s);
  assert_int_equal(s.slots_in_use, s_macro.slots_in_use);
  assert_int_equal(s.queued, s_macro.queued);
  assert_int_equal(s.sequences_finished, s_macro.sequences_finished);
  assert_int_equal(s.prompt_tokens, s_macro.prompt_tokens);
  assert_int_equal(s.generated_tokens, s_macro.generated_tokens);
  assert_int_equal(s.steps, s_macro.steps);
  assert_true(s.tokens_per_s == s_macro.tokens_per_s && s.mean_time_to_first_token_ms == 0.0 &&
              s.mean_inter_token_ms == s_macro.mean_inter_token_ms &&
              s.mean_rows_per_step == s_macro.mean_rows_per_step && s.sampling_ms == s_macro.sampling_ms);
  assert_int_equal(s.steps_in_flight, s_macro.steps_in_flight);
  assert_int_equal(s.steps_one_at_a_time, s_macro.steps_one_at_a_time);
  assert_int_equal(s.steps_pipelined, s_macro.steps_pipelined);
  assert_int_equal(s.cached_prompt_tokens, s_macro.cached_prompt_tokens);
  assert_string_equal(pipe_status_string(PIPE_ERR_BUSY), "PIPE_ERR_BUSY");
}

/* The structs have the layouts their versions gave (pipe_generator_stats: 0.8, 0.11 and 0.14; pipe_generation_info: 0.8
 * and 0.14; sizeof - 4 is none of them): every other size is refused by the init functions, nothing written, with a
 * message naming the struct, the macro and the init function. */
static void unknown_struct_sizes_are_refused(void **state) {
  (void)state;
  unsigned char buf[256];
  const size_t bogus[] = {0, 3, 8, 24};
#define REFUSED(init, type, name)                                                                                      \
  do {                                                                                                                 \
    const size_t sizes[] = {                                                                                           \
        bogus[0], bogus[1], bogus[2], bogus[3], sizeof(type) - 4, sizeof(type) + 8, ((size_t)1 << 32) + sizeof(type)}; \
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; ++k) {                                                        \
      memset(buf, 0xAB, sizeof buf);                                                                                   \
      ASSERT_FAILS(init((type *)(void *)buf, sizes[k]), PIPE_ERR_INVALID_ARGUMENT, name);                              \
      assert_non_null(strstr(pipe_last_error(), #init));                                                               \
      for (size_t b = 0; b < sizeof buf; ++b) assert_int_equal(buf[b], 0xAB);                                          \
    }                                                                                                                  \
    ASSERT_FAILS(init(NULL, sizeof(type)), PIPE_ERR_INVALID_ARGUMENT, "is NULL");                                      \
  } while (0)
  REFUSED(pipe_generator_options_init, pipe_generator_options, "pipe_generator_options");
  REFUSED(pipe_generator_info_init, pipe_generator_info, "pipe_generator_info");
  REFUSED(pipe_generation_options_init, pipe_generation_options, "pipe_generation_options");
  REFUSED(pipe_generation_info_init, pipe_generation_info, "pipe_generation_info");
  REFUSED(pipe_generator_stats_init, pipe_generator_stats, "pipe_generator_stats");
#undef REFUSED
}

/* Functions that read or fill the structs refuse an unknown struct_size too, leaving outputs. */
static void struct_sizes_checked_where_used(void **state) {
  (void)state;
  pipe_generator *g = make_generator("tiny_decoder.pt", 0, 0);
  const int64_t prompt[] = {1, 2, 3};
  pipe_generation *gen = (pipe_generation *)0x1;
  pipe_generation_options o = PIPE_GENERATION_OPTIONS_INIT;
  o.struct_size = 40;
  ASSERT_FAILS(pipe_generator_submit(g, prompt, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "options->struct_size is 40, which is not the size of pipe_generation_options");
  assert_ptr_equal(gen, (pipe_generation *)0x1);

  pipe_generator_info gi = PIPE_GENERATOR_INFO_INIT;
  gi.struct_size = 16;
  ASSERT_FAILS(pipe_generator_get_info(g, &gi), PIPE_ERR_INVALID_ARGUMENT,
               "info->struct_size is 16, which is not the size of pipe_generator_info");
  assert_int_equal(gi.slots, 0);
  pipe_generator_stats s = PIPE_GENERATOR_STATS_INIT;
  s.struct_size = 0;
  ASSERT_FAILS(pipe_generator_get_stats(g, &s), PIPE_ERR_INVALID_ARGUMENT, "pipe_generator_stats");
  /* 0.8's layout (96 bytes) is filled that far: the fields 0.11 appended keep what the caller put there. */
  memset(&s, 0x5A, sizeof s);
  s.struct_size = 96;
  ASSERT_OK(pipe_generator_get_stats(g, &s));
  assert_int_equal(s.slots_in_use, 0);
  const unsigned char *tail = (const unsigned char *)&s + 96;
  for (size_t b = 0; b < sizeof s - 96; ++b) assert_int_equal(tail[b], 0x5A);

  gen = submit(g, prompt, 3, 2);
  pipe_generation_info i = PIPE_GENERATION_INFO_INIT;
  i.struct_size = 47;
  ASSERT_FAILS(pipe_generation_get_info(gen, &i), PIPE_ERR_INVALID_ARGUMENT, "pipe_generation_info");
  assert_int_equal(i.finish_reason, 0);
  assert_int_equal(i.prompt_tokens, 0);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  pipe_generation_destroy(gen);
  pipe_generator_destroy(g);

  /* At create: the generator options' size, then each option's range, named as the caller's
   * fields; the session options are checked as pipe_session_create checks them. */
  pipe_model *model = NULL;
  pipe_plan_options *po = NULL;
  pipe_plan *plan = NULL;
  ASSERT_OK(pipe_model_load(fixture("tiny_decoder.pt"), &model));
  ASSERT_OK(pipe_plan_options_create(&po));
  ASSERT_OK(pipe_plan_options_add_split_point(po, SPLIT));
  ASSERT_OK(pipe_plan_create(model, po, &plan));
  pipe_generator *none = (pipe_generator *)0x1;
  pipe_generator_options go = PIPE_GENERATOR_OPTIONS_INIT;
  go.struct_size = 12;
  ASSERT_FAILS(pipe_generator_create(plan, NULL, &go, &none), PIPE_ERR_INVALID_ARGUMENT,
               "generator_options->struct_size is 12, which is not the size of pipe_generator_options");
  const char *fields[] = {"max_queued", "prefill_chunk", "steps_in_flight", "max_rows_per_step"};
  for (int f = 0; f < 4; ++f) {
    pipe_generator_options bad = PIPE_GENERATOR_OPTIONS_INIT;
    int64_t *values[] = {&bad.max_queued, &bad.prefill_chunk, &bad.steps_in_flight, &bad.max_rows_per_step};
    *values[f] = -1;
    char want[96];
    snprintf(want, sizeof want, "generator_options->%s is -1", fields[f]);
    ASSERT_FAILS(pipe_generator_create(plan, NULL, &bad, &none), PIPE_ERR_INVALID_ARGUMENT, want);
  }
  pipe_session_options so = PIPE_SESSION_OPTIONS_INIT;
  so.outputs = 7;
  ASSERT_FAILS(pipe_generator_create(plan, &so, NULL, &none), PIPE_ERR_INVALID_ARGUMENT, "session_options->outputs");
  so = (pipe_session_options)PIPE_SESSION_OPTIONS_INIT;
  so.struct_size = 20;
  ASSERT_FAILS(pipe_generator_create(plan, &so, NULL, &none), PIPE_ERR_INVALID_ARGUMENT,
               "session_options->struct_size is 20");
  assert_ptr_equal(none, (pipe_generator *)0x1);
  pipe_plan_destroy(plan);
  pipe_plan_options_destroy(po);
  pipe_model_destroy(model);
}

/* ---- failure paths ------------------------------------------------------------------------- */

static void ignore_event(void *user_data, pipe_generation *generation, size_t available, int32_t finished) {
  (void)user_data, (void)generation, (void)available, (void)finished;
}

/* Every NULL handle and output pointer is refused, naming it, and outputs stay untouched. */
static void null_arguments(void **state) {
  (void)state;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  ASSERT_OK(pipe_model_load(fixture("tiny_decoder.pt"), &model));
  ASSERT_OK(pipe_plan_create(model, NULL, &plan));
  pipe_generator *g = (pipe_generator *)0x1;
  ASSERT_FAILS(pipe_generator_create(NULL, NULL, NULL, &g), PIPE_ERR_INVALID_ARGUMENT, "plan is NULL");
  assert_ptr_equal(g, (pipe_generator *)0x1);
  ASSERT_FAILS(pipe_generator_create(plan, NULL, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "generator is NULL");
  g = NULL;
  ASSERT_OK(pipe_generator_create(plan, NULL, NULL, &g)); /* one stage, every option its default */
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);

  pipe_generator_info gi = PIPE_GENERATOR_INFO_INIT;
  ASSERT_FAILS(pipe_generator_get_info(NULL, &gi), PIPE_ERR_INVALID_ARGUMENT, "generator is NULL");
  ASSERT_FAILS(pipe_generator_get_info(g, NULL), PIPE_ERR_INVALID_ARGUMENT, "info is NULL");
  pipe_generator_stats st = PIPE_GENERATOR_STATS_INIT;
  ASSERT_FAILS(pipe_generator_get_stats(NULL, &st), PIPE_ERR_INVALID_ARGUMENT, "generator is NULL");
  ASSERT_FAILS(pipe_generator_get_stats(g, NULL), PIPE_ERR_INVALID_ARGUMENT, "stats is NULL");
  pipe_session *session = (pipe_session *)0x1;
  ASSERT_FAILS(pipe_generator_session(NULL, &session), PIPE_ERR_INVALID_ARGUMENT, "generator is NULL");
  assert_ptr_equal(session, (pipe_session *)0x1);
  ASSERT_FAILS(pipe_generator_session(g, NULL), PIPE_ERR_INVALID_ARGUMENT, "session is NULL");

  const int64_t prompt[] = {4, 5, 6};
  pipe_generation *gen = (pipe_generation *)0x1;
  ASSERT_FAILS(pipe_generator_submit(NULL, prompt, 3, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "generator is NULL");
  ASSERT_FAILS(pipe_generator_submit(g, prompt, 3, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  ASSERT_FAILS(pipe_generator_submit(g, NULL, 3, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "prompt is NULL but prompt_len is 3");
  assert_ptr_equal(gen, (pipe_generation *)0x1);
  gen = NULL;
  ASSERT_OK(pipe_generator_submit(g, prompt, 3, NULL, &gen)); /* NULL options: PIPE_GENERATION_OPTIONS_INIT */

  ASSERT_FAILS(pipe_generation_on_event(NULL, ignore_event, NULL), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  ASSERT_FAILS(pipe_generation_on_event(gen, NULL, NULL), PIPE_ERR_INVALID_ARGUMENT, "fn is NULL");
  int fd = -7;
  ASSERT_FAILS(pipe_generation_fd(NULL, &fd), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  ASSERT_FAILS(pipe_generation_fd(gen, NULL), PIPE_ERR_INVALID_ARGUMENT, "fd is NULL");
  assert_int_equal(fd, -7);
  int64_t tokens[4];
  size_t count = 99;
  int32_t finished = 7;
  ASSERT_FAILS(pipe_generation_read(NULL, tokens, 4, &count, &finished), PIPE_ERR_INVALID_ARGUMENT,
               "generation is NULL");
  ASSERT_FAILS(pipe_generation_read(gen, NULL, 4, &count, &finished), PIPE_ERR_INVALID_ARGUMENT, "tokens is NULL");
  ASSERT_FAILS(pipe_generation_read(gen, tokens, 4, NULL, &finished), PIPE_ERR_INVALID_ARGUMENT, "count is NULL");
  ASSERT_FAILS(pipe_generation_read(gen, tokens, 4, &count, NULL), PIPE_ERR_INVALID_ARGUMENT, "finished is NULL");
  assert_int_equal(count, 99);
  assert_int_equal(finished, 7);
  ASSERT_OK(pipe_generation_read(gen, NULL, 0, &count, &finished)); /* no room: nothing read */
  assert_int_equal(count, 0);
  ASSERT_FAILS(pipe_generation_wait(NULL, 0), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  ASSERT_FAILS(pipe_generation_cancel(NULL), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  pipe_generation_info info = PIPE_GENERATION_INFO_INIT;
  ASSERT_FAILS(pipe_generation_get_info(NULL, &info), PIPE_ERR_INVALID_ARGUMENT, "generation is NULL");
  ASSERT_FAILS(pipe_generation_get_info(gen, NULL), PIPE_ERR_INVALID_ARGUMENT, "info is NULL");

  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list got = {0};
  assert_int_equal(read_all(gen, &got), 1);
  assert_int_equal(got.len, 16); /* PIPE_GENERATION_OPTIONS_INIT's max_new_tokens */
  pipe_generation_destroy(NULL);
  pipe_generator_destroy(NULL);
  pipe_generation_destroy(gen);
  pipe_generator_destroy(g);
}

/* pipe_generator_submit refuses what cannot be generated, before anything starts, with a
 * message that says what was wrong; the generator goes on serving. */
static void submit_errors(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("tiny_decoder.pt", 0, 0);
  pipe_generation *gen = (pipe_generation *)0x1;
  const int64_t ok[] = {1, 2, 3};
  const int64_t outside[] = {1, VOCAB, 3};
  const int64_t negative[] = {-1};
  int64_t too_long[MAX_LEN];
  for (int i = 0; i < MAX_LEN; ++i) too_long[i] = i % 100;

  ASSERT_FAILS(pipe_generator_submit(g, NULL, 0, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "empty");
  ASSERT_FAILS(pipe_generator_submit(g, ok, 0, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "empty");
  ASSERT_FAILS(pipe_generator_submit(g, outside, 3, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "128");
  assert_non_null(strstr(pipe_last_error(), "vocabulary"));
  ASSERT_FAILS(pipe_generator_submit(g, negative, 1, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "-1");
  /* max_len 64 positions: a prompt of 64 leaves no room for a token. */
  ASSERT_FAILS(pipe_generator_submit(g, too_long, MAX_LEN, NULL, &gen), PIPE_ERR_INVALID_ARGUMENT, "max_len");
  assert_non_null(strstr(pipe_last_error(), "64"));

  pipe_generation_options o = PIPE_GENERATION_OPTIONS_INIT;
  o.temperature = -1.0;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "temperature");
  o = (pipe_generation_options)PIPE_GENERATION_OPTIONS_INIT;
  o.top_p = 0.0;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "top_p");
  o.top_p = 1.5;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "top_p");
  o = (pipe_generation_options)PIPE_GENERATION_OPTIONS_INIT;
  o.top_k = -3;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "top_k");
  o = (pipe_generation_options)PIPE_GENERATION_OPTIONS_INIT;
  o.max_new_tokens = 0;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "options->max_new_tokens is 0");
  o = (pipe_generation_options)PIPE_GENERATION_OPTIONS_INIT;
  o.timeout_ms = -5;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT, "options->timeout_ms is -5");
  o = (pipe_generation_options)PIPE_GENERATION_OPTIONS_INIT;
  o.num_stop_ids = 2;
  ASSERT_FAILS(pipe_generator_submit(g, ok, 3, &o, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "options->stop_ids is NULL but options->num_stop_ids is 2");
  assert_ptr_equal(gen, (pipe_generation *)0x1);
  pipe_generator_stats st = stats_of(g);
  assert_int_equal(st.queued, 0);
  assert_int_equal(st.slots_in_use, 0);

  /* 63 tokens leave room for two: one fed back at position 63, and the last sampled after it,
   * never fed back; then the cache is full (length). */
  gen = submit(g, too_long, MAX_LEN - 1, 8);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list got = {0};
  assert_int_equal(read_all(gen, &got), 1);
  assert_int_equal(got.len, 2);
  assert_int_equal(info_of(gen).finish_reason, PIPE_FINISH_LENGTH);
  pipe_generation_destroy(gen);
  /* And it still serves the reference. */
  gen = submit(g, ref.prompts[0].ids, ref.prompts[0].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  got.len = 0;
  assert_int_equal(read_all(gen, &got), 1);
  assert_ids_equal(&got, &ref.greedy[0], "prompt 0 after refused submits");
  pipe_generation_destroy(gen);
  pipe_generator_destroy(g);
}

/* A model that does not follow the decoder contract is refused at create, saying so. */
static void not_a_decoder(void **state) {
  (void)state;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  ASSERT_OK(pipe_model_load(fixture("example_code.scripted.pt"), &model));
  ASSERT_OK(pipe_plan_create(model, NULL, &plan));
  pipe_generator *g = (pipe_generator *)0x1;
  ASSERT_FAILS(pipe_generator_create(plan, NULL, NULL, &g), PIPE_ERR_INVALID_ARGUMENT, "decoder contract");
  assert_ptr_equal(g, (pipe_generator *)0x1);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
}

/* ---- generation against the reference ---------------------------------------------------------- */

/* Every reference prompt submitted at once (one more than the slots: one queues), through the
 * two-stage pipeline: each sequence's greedy tokens equal transformers', read after
 * pipe_generation_wait; the sequence that fills max_len ends there; info and stats add up. */
static void greedy_equals_transformers(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("tiny_decoder.pt", 0, 0);
  pipe_generator_info gi = PIPE_GENERATOR_INFO_INIT;
  ASSERT_OK(pipe_generator_get_info(g, &gi));
  assert_int_equal(gi.slots, SLOTS);
  assert_int_equal(gi.vocab, VOCAB);
  assert_int_equal(gi.max_len, MAX_LEN);
  assert_int_equal(gi.cache_bytes_per_slot, CACHE_BYTES_PER_SLOT);

  pipe_generation *gens[MAX_PROMPTS + 1];
  const size_t n = ref.num_prompts;
  uint64_t prompt_tokens = 0, generated = 0;
  for (size_t i = 0; i < n; ++i) {
    gens[i] = submit(g, ref.prompts[i].ids, ref.prompts[i].len, ref.max_new_tokens);
    prompt_tokens += ref.prompts[i].len;
    generated += (uint64_t)ref.max_new_tokens;
  }
  /* More tokens asked than max_len has room for: the sequence ends when the cache is full. */
  gens[n] = submit(g, ref.max_len_prompt.ids, ref.max_len_prompt.len, MAX_LEN);
  prompt_tokens += ref.max_len_prompt.len;
  generated += ref.max_len_greedy.len;

  for (size_t i = 0; i <= n; ++i) {
    ASSERT_OK(pipe_generation_wait(gens[i], -1));
    ASSERT_OK(pipe_generation_wait(gens[i], 0)); /* finished: the same status at once */
    id_list got = {0};
    assert_int_equal(read_all(gens[i], &got), 1);
    char what[64];
    snprintf(what, sizeof what, "prompt %zu", i);
    assert_ids_equal(&got, i < n ? &ref.greedy[i] : &ref.max_len_greedy, what);
    const pipe_generation_info info = info_of(gens[i]);
    assert_int_equal(info.finish_reason, PIPE_FINISH_LENGTH);
    assert_int_equal(info.prompt_tokens, i < n ? ref.prompts[i].len : ref.max_len_prompt.len);
    assert_int_equal(info.generated_tokens, got.len);
    assert_true(info.queued_ms >= 0);
    assert_true(info.time_to_first_token_ms >= info.queued_ms);
    assert_true(info.mean_inter_token_ms >= 0);
  }
  const pipe_generator_stats st = stats_of(g);
  assert_int_equal(st.slots_in_use, 0);
  assert_int_equal(st.queued, 0);
  assert_int_equal(st.sequences_finished, n + 1);
  assert_int_equal(st.prompt_tokens, prompt_tokens);
  assert_int_equal(st.generated_tokens, generated);
  /* Each token of a sequence is its own step (the first one comes with the prefill). */
  assert_true(st.steps >= (uint64_t)ref.max_new_tokens && st.steps <= generated + prompt_tokens);
  assert_true(st.tokens_per_s > 0);
  assert_true(st.mean_time_to_first_token_ms > 0);
  assert_true(st.mean_inter_token_ms > 0);
  assert_true(st.mean_rows_per_step >= 1 && st.mean_rows_per_step <= SLOTS);
  assert_true(st.sampling_ms >= 0);
  assert_true(st.steps_in_flight >= 1);
  assert_int_equal(st.steps_one_at_a_time + st.steps_pipelined, st.steps);
  for (size_t i = 0; i <= n; ++i) pipe_generation_destroy(gens[i]);

  /* A stop id ends the sequence with it as the last token: the reference's 4th token of prompt 0
   * (at its first occurrence), listed after an id the reference never generates. */
  const id_list *r0 = &ref.greedy[0];
  const int64_t stop = r0->ids[3];
  size_t first = 0;
  while (r0->ids[first] != stop) ++first;
  int64_t never = 0;
  while (contains(r0, never)) ++never;
  pipe_generation_options o = PIPE_GENERATION_OPTIONS_INIT;
  o.max_new_tokens = ref.max_new_tokens;
  const int64_t stops[] = {never, stop};
  o.stop_ids = stops;
  o.num_stop_ids = 2;
  pipe_generation *gen = NULL;
  ASSERT_OK(pipe_generator_submit(g, ref.prompts[0].ids, ref.prompts[0].len, &o, &gen));
  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list got = {0}, want = *r0;
  want.len = first + 1;
  assert_int_equal(read_all(gen, &got), 1);
  assert_ids_equal(&got, &want, "prompt 0 up to its stop id");
  assert_int_equal(info_of(gen).finish_reason, PIPE_FINISH_STOP);
  pipe_generation_destroy(gen);

  /* Prefix reuse: a prompt submitted once more, after the first has ended (its slot is free by the time its end is
   * told), is found in that slot but for its last token, and gives the same tokens. */
  for (int round = 0; round < 2; ++round) {
    gen = submit(g, ref.prompts[1].ids, ref.prompts[1].len, ref.max_new_tokens);
    ASSERT_OK(pipe_generation_wait(gen, -1));
    id_list again = {0};
    assert_int_equal(read_all(gen, &again), 1);
    assert_ids_equal(&again, &ref.greedy[1], "prompt 1 once more");
    if (round == 1) assert_int_equal(info_of(gen).cached_tokens, (int64_t)ref.prompts[1].len - 1);
    pipe_generation_destroy(gen);
  }
  assert_true(stats_of(g).cached_prompt_tokens >= ref.prompts[1].len - 1);

  /* Log-probabilities: greedy tokens are the likeliest at their positions, so each one's log-probability is the first
   * of the top ones, which come most likely first; none without asking, nor past the tokens generated. */
  pipe_generation_options lo = PIPE_GENERATION_OPTIONS_INIT;
  lo.max_new_tokens = ref.max_new_tokens;
  lo.logprobs = 1;
  lo.top_logprobs = 3;
  ASSERT_OK(pipe_generator_submit(g, ref.prompts[2].ids, ref.prompts[2].len, &lo, &gen));
  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list lp_tokens = {0};
  assert_int_equal(read_all(gen, &lp_tokens), 1);
  assert_ids_equal(&lp_tokens, &ref.greedy[2], "prompt 2 with logprobs");
  for (size_t t = 0; t < lp_tokens.len; ++t) {
    float logprob = 1, top_lp[4] = {0};
    int64_t top_ids[4] = {-1, -1, -1, -1};
    size_t count = 0;
    ASSERT_OK(pipe_generation_logprobs(gen, t, &logprob, top_ids, top_lp, 4, &count));
    assert_int_equal(count, 3);
    assert_true(logprob <= 0 && logprob == top_lp[0] && top_ids[0] == lp_tokens.ids[t]);
    assert_true(top_lp[0] >= top_lp[1] && top_lp[1] >= top_lp[2] && top_ids[3] == -1);
    ASSERT_OK(pipe_generation_logprobs(gen, t, &logprob, NULL, NULL, 0, &count));
    assert_int_equal(count, 0);
  }
  float unused = 0;
  size_t unused_count = 0;
  ASSERT_FAILS(pipe_generation_logprobs(gen, lp_tokens.len, &unused, NULL, NULL, 0, &unused_count),
               PIPE_ERR_INVALID_ARGUMENT, "has been generated yet");
  pipe_generation_destroy(gen);
  gen = submit(g, ref.prompts[2].ids, ref.prompts[2].len, 1);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  ASSERT_FAILS(pipe_generation_logprobs(gen, 0, &unused, NULL, NULL, 0, &unused_count), PIPE_ERR_INVALID_ARGUMENT,
               "logprobs = 1");
  pipe_generation_destroy(gen);
  lo.top_logprobs = 21; /* 0..20 */
  ASSERT_FAILS(pipe_generator_submit(g, ref.prompts[2].ids, ref.prompts[2].len, &lo, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "top_logprobs");
  lo.logprobs = 0;
  lo.top_logprobs = 2;
  ASSERT_FAILS(pipe_generator_submit(g, ref.prompts[2].ids, ref.prompts[2].len, &lo, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "set one to 1");

  /* The prompt scored (0.15): the same greedy tokens, every position after the first scored with its alternatives
   * most likely first, nothing taken from the cache (prompt 2 is in a slot by now); position 0, positions past the
   * prompt and a generation that did not ask are refused. The values against transformers': the Python binding's
   * test. */
  lo.prompt_logprobs = 1;
  lo.top_logprobs = 3;
  ASSERT_OK(pipe_generator_submit(g, ref.prompts[2].ids, ref.prompts[2].len, &lo, &gen));
  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list scored_tokens = {0};
  assert_int_equal(read_all(gen, &scored_tokens), 1);
  assert_ids_equal(&scored_tokens, &ref.greedy[2], "prompt 2 scored");
  assert_int_equal(info_of(gen).cached_tokens, 0);
  for (size_t pos = 1; pos < ref.prompts[2].len; ++pos) {
    float logprob = 1, top_lp[4] = {0};
    int64_t top_ids[4] = {-1, -1, -1, -1};
    size_t count = 0;
    ASSERT_OK(pipe_generation_prompt_logprobs(gen, pos, &logprob, top_ids, top_lp, 4, &count));
    assert_int_equal(count, 3);
    assert_true(logprob <= 0 && logprob <= top_lp[0] && top_ids[3] == -1);
    assert_true(top_lp[0] >= top_lp[1] && top_lp[1] >= top_lp[2]);
    for (size_t k = 0; k < 3; ++k) /* the token's own entry, when it is among the likeliest */
      if (top_ids[k] == ref.prompts[2].ids[pos]) assert_true(top_lp[k] == logprob);
  }
  ASSERT_FAILS(pipe_generation_prompt_logprobs(gen, 0, &unused, NULL, NULL, 0, &unused_count),
               PIPE_ERR_INVALID_ARGUMENT, "first token has nothing before it");
  ASSERT_FAILS(pipe_generation_prompt_logprobs(gen, ref.prompts[2].len, &unused, NULL, NULL, 0, &unused_count),
               PIPE_ERR_INVALID_ARGUMENT, "is not scored");
  pipe_generation_destroy(gen);
  gen = submit(g, ref.prompts[2].ids, ref.prompts[2].len, 1);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  ASSERT_FAILS(pipe_generation_prompt_logprobs(gen, 1, &unused, NULL, NULL, 0, &unused_count),
               PIPE_ERR_INVALID_ARGUMENT, "prompt_logprobs = 1");
  pipe_generation_destroy(gen);
  lo.prompt_logprobs = 2;
  ASSERT_FAILS(pipe_generator_submit(g, ref.prompts[2].ids, ref.prompts[2].len, &lo, &gen), PIPE_ERR_INVALID_ARGUMENT,
               "prompt_logprobs is 2");
  pipe_generator_destroy(g);
}

/* What the event callback saw. */
typedef struct {
  pthread_mutex_t mutex;
  pthread_cond_t changed;
  int events, finished_events, after_finished, available_mismatch;
  id_list tokens;
  pthread_t last_thread;
} event_record;

static void event_record_init(event_record *r) {
  memset(r, 0, sizeof *r);
  pthread_mutex_init(&r->mutex, NULL);
  pthread_cond_init(&r->changed, NULL);
}

static void event_record_free(event_record *r) {
  pthread_cond_destroy(&r->changed);
  pthread_mutex_destroy(&r->mutex);
}

/* Reads what the event announces, from inside the callback (which the ABI allows). */
static void record_event(void *user_data, pipe_generation *generation, size_t available, int32_t finished) {
  event_record *r = user_data;
  pthread_mutex_lock(&r->mutex);
  r->events++;
  if (r->finished_events) r->after_finished++;
  r->finished_events += finished != 0;
  r->last_thread = pthread_self();
  size_t count = 0;
  int32_t done = 0;
  const size_t before = r->tokens.len;
  if (pipe_generation_read(generation, r->tokens.ids + r->tokens.len, MAX_IDS - r->tokens.len, &count, &done))
    r->available_mismatch++; /* counted as a mismatch: asserted 0 */
  r->tokens.len += count;
  /* `available` were unread when it was told; more may have come since, never fewer. */
  if (r->tokens.len - before < available) r->available_mismatch++;
  pthread_cond_broadcast(&r->changed);
  pthread_mutex_unlock(&r->mutex);
}

/* Waits (bounded: only a hung test reaches the bound) until the callback heard finished. */
static int wait_finished_event(event_record *r) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += GATE_WAIT_LIMIT_S;
  pthread_mutex_lock(&r->mutex);
  int rc = 0;
  while (!r->finished_events && rc == 0) rc = pthread_cond_timedwait(&r->changed, &r->mutex, &until);
  const int heard = r->finished_events;
  pthread_mutex_unlock(&r->mutex);
  return heard;
}

/* The callback tells every token (read inside it, they are the reference's) and, exactly once and
 * last, the end; a second callback is refused; a callback set on a finished sequence runs at once
 * on the caller's thread; after pipe_generation_destroy none runs. */
static void events_tell_tokens_and_the_end(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("tiny_decoder.pt", 0, 0);
  event_record rec;
  event_record_init(&rec);
  pipe_generation *gen = submit(g, ref.prompts[1].ids, ref.prompts[1].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_on_event(gen, record_event, &rec));
  ASSERT_FAILS(pipe_generation_on_event(gen, record_event, &rec), PIPE_ERR_INVALID_ARGUMENT, "already has a callback");
  assert_true(wait_finished_event(&rec));
  ASSERT_OK(pipe_generation_wait(gen, 0));
  pthread_mutex_lock(&rec.mutex);
  assert_int_equal(rec.finished_events, 1);
  assert_int_equal(rec.after_finished, 0);
  assert_int_equal(rec.available_mismatch, 0);
  assert_true(rec.events >= 1 && rec.events <= ref.max_new_tokens + 1);
  assert_ids_equal(&rec.tokens, &ref.greedy[1], "tokens read in the callback");
  const int events = rec.events;
  pthread_mutex_unlock(&rec.mutex);
  size_t count = 9;
  int32_t finished = 0;
  ASSERT_OK(pipe_generation_read(gen, NULL, 0, &count, &finished));
  assert_int_equal(count, 0);
  assert_int_equal(finished, 1);
  pipe_generation_destroy(gen);
  assert_int_equal(rec.events, events);
  event_record_free(&rec);

  /* Set on a sequence that already finished, none of whose tokens was read: at once, here, once,
   * with every token available and finished. */
  gen = submit(g, ref.prompts[2].ids, ref.prompts[2].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  event_record late;
  event_record_init(&late);
  ASSERT_OK(pipe_generation_on_event(gen, record_event, &late));
  assert_int_equal(late.events, 1);
  assert_int_equal(late.finished_events, 1);
  assert_true(pthread_equal(late.last_thread, pthread_self()));
  assert_ids_equal(&late.tokens, &ref.greedy[2], "tokens read in a late callback");
  pipe_generation_destroy(gen);
  assert_int_equal(late.events, 1);
  event_record_free(&late);
  pipe_generator_destroy(g);
}

/* The descriptor: not readable while the sequence has no token (its prefill held at a gate),
 * readable once one is unread, cleared by reading every token of a sequence that goes on, and
 * readable for good once it finished. One step in flight, so that while a step is held nothing
 * else runs: sequence A is held in its prefill (gate k1) while B, whose prefill holds gate k2,
 * waits; k1 opens, A gets its first token, and the next step (A's decode row, B's prefill) holds at
 * k2, so A has tokens and can get no more until k2 opens. */
static void descriptor_follows_tokens(void **state) {
  (void)state;
  pipe_generator *g = make_generator("gated_decoder.pt", 1, 0);
  const int64_t k1 = gate_new_key(), k2 = gate_new_key();
  int64_t pa[3], pb[3];
  gated_prompt(k1, pa);
  gated_prompt(k2, pb);
  pipe_generation *a = submit(g, pa, 3, 30);
  int fd = -1, again = -1;
  ASSERT_OK(pipe_generation_fd(a, &fd));
  assert_true(fd >= 0);
  ASSERT_OK(pipe_generation_fd(a, &again));
  assert_int_equal(again, fd); /* one descriptor per generation */
  assert_true(gate_wait(k1, "stage1", "arrived", 1));
  assert_false(readable(fd, 0));
  id_list got = {0};
  assert_int_equal(read_all(a, &got), 0);
  assert_int_equal(got.len, 0);
  assert_true(info_of(a).time_to_first_token_ms == -1.0);
  pipe_generation *b = submit(g, pb, 3, 2);
  gate_open(k1, NULL);
  assert_true(gate_wait(k2, "stage1", "arrived", 1));
  /* A's first token, sampled before the held step left, is handed out right after it: wait for
   * it (bounded), then every token A has got is the engine's every token so far. */
  assert_true(readable(fd, WAIT_LIMIT_MS));
  assert_true(wait_delivered(a, g));
  assert_int_equal(read_all(a, &got), 0);
  assert_true(got.len >= 1);
  assert_false(readable(fd, 0)); /* every token read, the sequence goes on: cleared */
  size_t count = 5;
  int32_t finished = 5;
  int64_t spare[4];
  ASSERT_OK(pipe_generation_read(a, spare, 4, &count, &finished));
  assert_int_equal(count, 0);
  assert_int_equal(finished, 0);
  assert_int_equal(info_of(a).finish_reason, PIPE_FINISH_NONE);
  ASSERT_FAILS(pipe_generation_wait(a, 0), PIPE_ERR_TIMEOUT, "still being generated");

  gate_open(k2, NULL);
  ASSERT_OK(pipe_generation_wait(a, -1));
  assert_true(readable(fd, 0)); /* finished: readable, before and after reading */
  assert_int_equal(read_all(a, &got), 1);
  assert_int_equal(got.len, 30);
  assert_true(readable(fd, 0));
  ASSERT_OK(pipe_generation_wait(b, -1));
  pipe_generation_destroy(a);
  pipe_generation_destroy(b);
  pipe_generator_destroy(g);
}

/* One slot and room for one waiting sequence: with the slot held (its prefill at a gate) and one
 * sequence queued, the next submit is PIPE_ERR_BUSY. Cancelling the queued one ends it at once
 * (PIPE_ERR_CANCELLED) and frees its place; cancelling the held one ends it at once too, and its
 * slot goes to the next sequence once its step has returned. */
static void busy_and_cancel(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("gated_decoder_1slot.pt", 0, 1);
  pipe_generator_info gi = PIPE_GENERATOR_INFO_INIT;
  ASSERT_OK(pipe_generator_get_info(g, &gi));
  assert_int_equal(gi.slots, 1);
  const int64_t key = gate_new_key();
  int64_t held_prompt[3];
  gated_prompt(key, held_prompt);
  pipe_generation *held = submit(g, held_prompt, 3, 4);
  pipe_generation *queued = submit(g, ref.prompts[0].ids, ref.prompts[0].len, 4);
  pipe_generator_stats st = stats_of(g);
  assert_int_equal(st.slots_in_use, 1);
  assert_int_equal(st.queued, 1);
  pipe_generation *refused = (pipe_generation *)0x1;
  ASSERT_FAILS(pipe_generator_submit(g, ref.prompts[1].ids, ref.prompts[1].len, NULL, &refused), PIPE_ERR_BUSY, "busy");
  assert_ptr_equal(refused, (pipe_generation *)0x1);
  assert_true(gate_wait(key, "stage1", "arrived", 1));

  ASSERT_OK(pipe_generation_cancel(queued));
  ASSERT_FAILS(pipe_generation_wait(queued, -1), PIPE_ERR_CANCELLED, "cancelled");
  pipe_generation_info info = info_of(queued);
  assert_int_equal(info.finish_reason, PIPE_FINISH_CANCELLED);
  assert_int_equal(info.generated_tokens, 0);
  assert_true(info.queued_ms == -1.0); /* it never got the slot */
  id_list got = {0};
  assert_int_equal(read_all(queued, &got), 1);
  assert_int_equal(got.len, 0);
  ASSERT_OK(pipe_generation_cancel(queued)); /* a finished one is left as it is */
  ASSERT_FAILS(pipe_generation_wait(queued, 0), PIPE_ERR_CANCELLED, "cancelled");

  pipe_generation *next = submit(g, ref.prompts[0].ids, ref.prompts[0].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_cancel(held));
  ASSERT_FAILS(pipe_generation_wait(held, -1), PIPE_ERR_CANCELLED, "cancelled");
  assert_int_equal(info_of(held).finish_reason, PIPE_FINISH_CANCELLED);
  gate_open(key, NULL);
  ASSERT_OK(pipe_generation_wait(next, -1));
  assert_int_equal(read_all(next, &got), 1);
  assert_ids_equal(&got, &ref.greedy[0], "prompt 0 in the slot a cancelled sequence left");
  got.len = 0;
  assert_int_equal(read_all(held, &got), 1);
  assert_int_equal(got.len, 0); /* the held step's token was dropped */
  st = stats_of(g);
  assert_int_equal(st.slots_in_use, 0);
  assert_int_equal(st.queued, 0);
  pipe_generation_destroy(held);
  pipe_generation_destroy(queued);
  pipe_generation_destroy(next);
  pipe_generator_destroy(g);
}

/* A deadline that passes while the sequence's step is held ends it with
 * PIPE_ERR_DEADLINE_EXCEEDED; a failing step (a prompt starting with 119) ends its sequence with the
 * step's error, and the generator goes on serving. */
static void deadline_and_failing_step(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("gated_decoder.pt", 0, 0);
  const int64_t key = gate_new_key();
  int64_t held_prompt[3];
  gated_prompt(key, held_prompt);
  pipe_generation_options o = PIPE_GENERATION_OPTIONS_INIT;
  o.timeout_ms = 200;
  pipe_generation *late = NULL;
  ASSERT_OK(pipe_generator_submit(g, held_prompt, 3, &o, &late));
  ASSERT_FAILS(pipe_generation_wait(late, -1), PIPE_ERR_DEADLINE_EXCEEDED, "deadline");
  assert_int_equal(info_of(late).finish_reason, PIPE_FINISH_DEADLINE);
  gate_open(key, NULL);

  const int64_t failing[] = {119, 3, 4};
  pipe_generation *bad = submit(g, failing, 3, 4);
  ASSERT_FAILS(pipe_generation_wait(bad, -1), PIPE_ERR_EXECUTION, "119");
  assert_int_equal(info_of(bad).finish_reason, PIPE_FINISH_ERROR);
  id_list got = {0};
  assert_int_equal(read_all(bad, &got), 1);
  assert_int_equal(got.len, 0);

  pipe_generation *good = submit(g, ref.prompts[3].ids, ref.prompts[3].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_wait(good, -1));
  assert_int_equal(read_all(good, &got), 1);
  assert_ids_equal(&got, &ref.greedy[3], "prompt 3 after a failed step");
  pipe_generation_destroy(late);
  pipe_generation_destroy(bad);
  pipe_generation_destroy(good);
  pipe_generator_destroy(g);
}

/* The generator's session, borrowed: its stages' statistics, traces and check work; running or
 * submitting on it is refused (the generator drives it), destroying it does nothing. */
static void borrowed_session(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("tiny_decoder.pt", 0, 0);
  pipe_session *session = NULL, *again = NULL;
  ASSERT_OK(pipe_generator_session(g, &session));
  ASSERT_OK(pipe_generator_session(g, &again));
  assert_ptr_equal(session, again);
  size_t stages = 0;
  ASSERT_OK(pipe_session_num_stages(session, &stages));
  assert_int_equal(stages, 2);
  ASSERT_OK(pipe_session_trace_start_with_operators(session));
  pipe_generation *gen = submit(g, ref.prompts[0].ids, ref.prompts[0].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  pipe_generation_destroy(gen);
  ASSERT_OK(pipe_session_trace_stop(session, NULL));
  ASSERT_OK(pipe_session_check(session));
  const uint64_t steps = stats_of(g).steps;
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats ss = PIPE_STAGE_STATS_INIT;
    ASSERT_OK(pipe_session_stage_stats(session, s, &ss));
    assert_true(ss.microbatches >= steps); /* every step, and the probe at create */
    assert_int_equal(ss.failures, 0);
  }
  pipe_tensor_list *out = (pipe_tensor_list *)0x1;
  pipe_request *request = (pipe_request *)0x1;
  ASSERT_FAILS(pipe_session_run(session, NULL, 0, NULL, &out), PIPE_ERR_INVALID_ARGUMENT, "pipe_generator_session");
  ASSERT_FAILS(pipe_session_submit(session, NULL, 0, NULL, &request), PIPE_ERR_INVALID_ARGUMENT,
               "pipe_generator_session");
  assert_ptr_equal(out, (pipe_tensor_list *)0x1);
  assert_ptr_equal(request, (pipe_request *)0x1);
  pipe_session_destroy(session); /* ignored: the generator's */
  ASSERT_OK(pipe_session_num_stages(session, &stages));
  gen = submit(g, ref.prompts[1].ids, ref.prompts[1].len, ref.max_new_tokens);
  ASSERT_OK(pipe_generation_wait(gen, -1));
  id_list got = {0};
  assert_int_equal(read_all(gen, &got), 1);
  assert_ids_equal(&got, &ref.greedy[1], "prompt 1 after pipe_session_destroy on the borrowed session");
  pipe_generation_destroy(gen);
  pipe_generator_destroy(g);
}

static void *destroy_generator(void *generator) {
  pipe_generator_destroy(generator);
  return NULL;
}

/* Destroying a generator cancels every generation, running, held in a stage or queued (their
 * callbacks hear it once), waits for the step a stage holds, and the generations outlive it. */
static void destroy_cancels_and_generations_outlive(void **state) {
  (void)state;
  reference ref;
  load_reference(&ref);
  pipe_generator *g = make_generator("gated_decoder.pt", 0, 0);
  const int64_t key = gate_new_key();
  int64_t held_prompt[3];
  gated_prompt(key, held_prompt);
  enum { N = SLOTS + 2 }; /* the held one, SLOTS - 1 stuck behind it, 2 queued */
  pipe_generation *gens[N];
  event_record recs[N];
  gens[0] = submit(g, held_prompt, 3, 8);
  assert_true(gate_wait(key, "stage1", "arrived", 1));
  for (int i = 1; i < N; ++i) {
    const id_list *p = &ref.prompts[(size_t)i % ref.num_prompts];
    gens[i] = submit(g, p->ids, p->len, ref.max_new_tokens);
  }
  const pipe_generator_stats st = stats_of(g);
  assert_int_equal(st.slots_in_use, SLOTS);
  assert_int_equal(st.queued, N - SLOTS);
  for (int i = 0; i < N; ++i) {
    event_record_init(&recs[i]);
    ASSERT_OK(pipe_generation_on_event(gens[i], record_event, &recs[i]));
  }
  /* Destroy waits for the step held in stage 1: the gate opens once destroy has begun, which the
   * cancelled end of a queued generation shows (only destroy ends it). */
  pthread_t destroyer;
  assert_int_equal(pthread_create(&destroyer, NULL, destroy_generator, g), 0);
  const pipe_status queued_status = pipe_generation_wait(gens[N - 1], WAIT_LIMIT_MS);
  gate_open(key, NULL);
  assert_int_equal(pthread_join(destroyer, NULL), 0);
  assert_int_equal(queued_status, PIPE_ERR_CANCELLED);
  for (int i = 0; i < N; ++i) {
    ASSERT_FAILS(pipe_generation_wait(gens[i], 0), PIPE_ERR_CANCELLED, "destroyed");
    const pipe_generation_info info = info_of(gens[i]);
    assert_int_equal(info.finish_reason, PIPE_FINISH_CANCELLED);
    assert_true(wait_finished_event(&recs[i]));
    pthread_mutex_lock(&recs[i].mutex);
    assert_int_equal(recs[i].finished_events, 1);
    assert_int_equal(recs[i].after_finished, 0);
    assert_int_equal((int64_t)recs[i].tokens.len, info.generated_tokens);
    pthread_mutex_unlock(&recs[i].mutex);
    size_t count = 3;
    int32_t finished = 0;
    ASSERT_OK(pipe_generation_read(gens[i], NULL, 0, &count, &finished));
    assert_int_equal(finished, 1);
    int fd = -1;
    ASSERT_OK(pipe_generation_fd(gens[i], &fd));
    assert_true(readable(fd, 0));
    ASSERT_OK(pipe_generation_cancel(gens[i]));
    pipe_generation_destroy(gens[i]);
    event_record_free(&recs[i]);
  }
}

/* The gated decoder's operator must be loaded before the model (tests/gate). */
static int load_gate(void **state) {
  (void)state;
  return gate_init();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(init_functions_equal_macros),
      cmocka_unit_test(unknown_struct_sizes_are_refused),
      cmocka_unit_test(struct_sizes_checked_where_used),
      cmocka_unit_test(null_arguments),
      cmocka_unit_test(submit_errors),
      cmocka_unit_test(not_a_decoder),
      cmocka_unit_test(greedy_equals_transformers),
      cmocka_unit_test(events_tell_tokens_and_the_end),
      cmocka_unit_test(descriptor_follows_tokens),
      cmocka_unit_test(busy_and_cancel),
      cmocka_unit_test(deadline_and_failing_step),
      cmocka_unit_test(borrowed_session),
      cmocka_unit_test(destroy_cancels_and_generations_outlive),
  };
  return cmocka_run_group_tests_name("generate", tests, load_gate, NULL);
}
