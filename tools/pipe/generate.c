/* pipe generate MODEL [SPLIT] --weights W --prompt-ids 1,2,3 [--prompt-ids ...] --max-new-tokens N:
 * token generation with a decoder (pipe.h, "Generation") through the C ABI's generator. Every
 * prompt is submitted at once, so that they batch and pipeline together (prompt i samples with
 * seed S + i); the output is one line of generated ids per prompt, in prompt order, or with --json
 * {"outputs": [[...], ...], "tokens_per_s": x, "time_to_first_token_ms": y, "finish_reasons": [...],
 *  "steps_in_flight": {"now": n, "one_at_a_time": a, "pipelined": b},
 *  "peak_rss_mib": {"driver": r, "largest_worker": w}}.
 * Text prompts (--prompt TEXT) go through the model folder's tokenizer and chat template (pipe.h,
 * "Text"); then each reply is printed as text (and --json adds "texts": [...]). */
#include <errno.h>
#include <math.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

typedef struct {
  int64_t *ids;
  size_t len;
} id_list;

/* One prompt: its ids, its generation, and what it generated. */
typedef struct {
  id_list prompt;
  const char *text; /* --prompt TEXT: encoded once the tokenizer is loaded; NULL for --prompt-ids */
  pipe_generation *generation;
  int finished; /* its wait returned */
  id_list out;
  int32_t finish_reason;
} prompt_state;

typedef struct {
  int json;
  int has_max_new_tokens;
  int greedy;                /* no --temperature, or 0 */
  const char *sampling_flag; /* a sampling-only flag given (--top-k, --top-p), for the greedy check */
  pipe_generation_options generation;
  pipe_generator_options generator;
  id_list stop;
  prompt_state *prompts;
  size_t num_prompts;
  const char *trace_path;    /* --trace */
  int trace_operators;       /* --trace-operators */
  const char *tokenizer_dir; /* --tokenizer */
  int has_stop_ids;          /* --stop-ids given */
  pipe_tokenizer *tokenizer; /* loaded for --prompt or --tokenizer: replies are printed as text */
  char **texts;              /* each reply decoded, when a tokenizer is loaded */
} generate_args;

/* "1,2,3" (spaces around the ids allowed) into a fresh list. Only the syntax is checked here:
 * libpipe checks the ids against the model's vocabulary. */
static int parse_ids(const char *flag, const char *text, id_list *out) {
  size_t items = 1;
  for (const char *c = text; *c; ++c) items += *c == ',';
  out->ids = malloc(items * sizeof *out->ids);
  out->len = 0;
  if (!out->ids) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  const char *item = text;
  for (size_t k = 0; k < items; ++k) {
    const char *comma = strchr(item, ',');
    size_t length = comma ? (size_t)(comma - item) : strlen(item);
    char *end = NULL;
    errno = 0;
    long long value = strtoll(item, &end, 10);
    while (end && end < item + length && *end == ' ') ++end;
    if (errno != 0 || end == item || end != item + length) {
      free(out->ids);
      out->ids = NULL;
      return usage_error("generate: %s expects comma-separated token ids such as 1,2,3; id %zu of '%s' is '%.*s'", flag,
                         k + 1, text, (int)length, item);
    }
    out->ids[out->len++] = (int64_t)value;
    item = comma ? comma + 1 : item + length;
  }
  return 0;
}

/* Consumes argv[*i] (and its value) if it is one of generate's own flags: 1 if consumed, 0 if
 * not one of them, 2 after a usage error. */
static int parse_generate_arg(int argc, char **argv, int *i, generate_args *g, session_args *s) {
  static const char *const flags[] = {
      "--prompt-ids", "--max-new-tokens",  "--temperature",   "--top-k",    "--top-p",
      "--seed",       "--stop-ids",        "--prefill-chunk", "--json",     "--threads-per-stage",
      "--trace",      "--trace-operators", "--prompt",        "--tokenizer"};
  const char *a = argv[*i];
  size_t k = 0;
  while (k < sizeof flags / sizeof *flags && strcmp(a, flags[k]) != 0) ++k;
  if (k == sizeof flags / sizeof *flags) return 0;
  if (strcmp(a, "--json") == 0) {
    g->json = 1;
    return 1;
  }
  if (strcmp(a, "--trace-operators") == 0) {
    g->trace_operators = 1;
    return 1;
  }
  if (*i + 1 >= argc) return usage_error("generate: %s needs a value", a);
  const char *v = argv[++*i];
  pipe_generation_options *o = &g->generation;
  switch (k) {
    case 0: {
      prompt_state *p = &g->prompts[g->num_prompts];
      if (parse_ids(a, v, &p->prompt) != 0) return 2;
      ++g->num_prompts;
      return 1;
    }
    case 1: g->has_max_new_tokens = 1; return parse_int64_at_least("generate", a, v, 1, &o->max_new_tokens) ? 2 : 1;
    case 2:
      if (parse_number("generate", a, v, &o->temperature)) return 2;
      if (o->temperature < 0) return usage_error("generate: --temperature must be 0 (greedy) or more, got %s", v);
      g->greedy = o->temperature == 0;
      return 1;
    case 3: g->sampling_flag = a; return parse_int64_at_least("generate", a, v, 0, &o->top_k) ? 2 : 1;
    case 4:
      g->sampling_flag = a;
      if (parse_number("generate", a, v, &o->top_p)) return 2;
      if (!(o->top_p > 0 && o->top_p <= 1)) return usage_error("generate: --top-p must be in (0, 1], got %s", v);
      return 1;
    case 5: return parse_seed("generate", v, &o->seed) ? 2 : 1;
    case 6:
      free(g->stop.ids);
      g->has_stop_ids = 1;
      return parse_ids(a, v, &g->stop) ? 2 : 1;
    case 7: return parse_int64_at_least("generate", a, v, 1, &g->generator.prefill_chunk) ? 2 : 1;
    case 10: g->trace_path = v; return 1;
    case 12: g->prompts[g->num_prompts++].text = v; return 1;
    case 13: g->tokenizer_dir = v; return 1;
    default:
      if (parse_int(a, v, &s->options.threads_per_stage)) return 2;
      if (s->options.threads_per_stage < 0)
        return usage_error("generate: --threads-per-stage must be 0 (libpipe decides) or more, got %s", v);
      return 1;
  }
}

static void free_args(generate_args *g) {
  for (size_t i = 0; i < g->num_prompts; ++i) {
    free(g->prompts[i].prompt.ids);
    free(g->prompts[i].out.ids);
    if (g->texts) free(g->texts[i]);
  }
  free(g->texts);
  free(g->prompts);
  free(g->stop.ids);
  pipe_tokenizer_destroy(g->tokenizer);
}

static int fail_prompt(const generate_args *g, size_t i, const char *what, pipe_status status);

/* A copy of `n` ids or bytes lent by libpipe (until this thread's next call), or NULL when out of
 * memory (reported). `extra` bytes more are zeroed (a string's NUL). */
static void *copy_lent(const void *data, size_t bytes, size_t extra) {
  char *copy = calloc(bytes + extra ? bytes + extra : 1, 1);
  if (!copy) fprintf(stderr, "pipe: error: out of memory\n");
  else if (bytes) memcpy(copy, data, bytes);
  return copy;
}

/* --prompt TEXT and --tokenizer: loads the tokenizer (--tokenizer DIR, else the folder of --weights),
 * encodes each text prompt as one user turn of the folder's chat template with its generation prompt
 * (the text as it is, with the tokenizer's special tokens, when the folder has no template), and takes
 * the folder's stop ids unless --stop-ids gave some. 0, 1 after reporting a failure, 2 after a usage
 * error. */
static int prepare_text(generate_args *g, const char *weights) {
  int texts = 0;
  for (size_t i = 0; i < g->num_prompts; ++i) texts += g->prompts[i].text != NULL;
  if (!texts && !g->tokenizer_dir) return 0;
  char folder[4096];
  if (g->tokenizer_dir) {
    snprintf(folder, sizeof folder, "%s", g->tokenizer_dir);
  } else if (weights) {
    struct stat st;
    snprintf(folder, sizeof folder, "%s", weights);
    if (stat(weights, &st) != 0 || !S_ISDIR(st.st_mode)) {
      char *slash = strrchr(folder, '/');
      if (slash) *slash = '\0';
      else snprintf(folder, sizeof folder, ".");
    }
  } else {
    return usage_error(
        "generate: --prompt TEXT needs the model's tokenizer: give --tokenizer DIR (a Hugging Face "
        "model folder) or --weights from that folder");
  }
  pipe_status st = pipe_tokenizer_load(folder, &g->tokenizer);
  if (st != PIPE_OK) return fail("cannot load the tokenizer", st);
  for (size_t i = 0; i < g->num_prompts; ++i) {
    prompt_state *p = &g->prompts[i];
    if (!p->text) continue;
    const char *role = "user", *text = NULL;
    size_t length = 0;
    int32_t add_special = 0;
    st = pipe_tokenizer_apply_chat_template(g->tokenizer, &role, &p->text, 1, 1, &text, &length);
    if (st == PIPE_ERR_INVALID_FORMAT && strstr(pipe_last_error(), "no chat template")) {
      text = p->text; /* no template: the text as it is */
      length = strlen(p->text);
      add_special = 1;
    } else if (st != PIPE_OK) {
      return fail_prompt(g, i, "cannot apply the chat template", st);
    }
    char *chat = copy_lent(text, length, 1); /* lent until the next call, which encode is */
    if (!chat) return 1;
    const int64_t *ids = NULL;
    size_t count = 0;
    st = pipe_tokenizer_encode(g->tokenizer, chat, length, add_special, &ids, &count);
    free(chat);
    if (st != PIPE_OK) return fail_prompt(g, i, "cannot encode the prompt", st);
    if (!(p->prompt.ids = copy_lent(ids, count * sizeof *ids, 0))) return 1;
    p->prompt.len = count;
  }
  if (!g->has_stop_ids) {
    const int64_t *ids = NULL;
    size_t count = 0;
    st = pipe_tokenizer_stop_ids(g->tokenizer, &ids, &count);
    if (st != PIPE_OK) return fail("cannot read the tokenizer's stop ids", st);
    free(g->stop.ids);
    if (!(g->stop.ids = copy_lent(ids, count * sizeof *ids, 0))) return 1;
    g->stop.len = count;
  }
  return 0;
}

/* Each reply as text (special tokens left out). 0, or 1 after reporting. */
static int decode_replies(generate_args *g) {
  g->texts = calloc(g->num_prompts ? g->num_prompts : 1, sizeof *g->texts);
  if (!g->texts) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < g->num_prompts; ++i) {
    const char *text = NULL;
    size_t length = 0;
    pipe_status st =
        pipe_tokenizer_decode(g->tokenizer, g->prompts[i].out.ids, g->prompts[i].out.len, 1, &text, &length);
    if (st != PIPE_OK) return fail_prompt(g, i, "cannot decode the reply", st);
    if (!(g->texts[i] = copy_lent(text, length, 1))) return 1;
  }
  return 0;
}

/* `s` as a JSON string (UTF-8 passes through; quotes, backslashes and control characters escaped). */
static void print_json_string(const char *s) {
  putchar('"');
  for (const unsigned char *c = (const unsigned char *)s; *c; ++c) {
    if (*c == '"' || *c == '\\') printf("\\%c", *c);
    else if (*c == '\n') printf("\\n");
    else if (*c < 0x20) printf("\\u%04x", *c);
    else putchar(*c);
  }
  putchar('"');
}

/* --trace: the generator's session records its stages and the engine's steps from before the
 * first prompt is submitted. */
static int start_trace(const generate_args *g, pipe_generator *generator, pipe_session **session) {
  pipe_status st = pipe_generator_session(generator, session);
  if (st == PIPE_OK)
    st = g->trace_operators ? pipe_session_trace_start_with_operators(*session) : pipe_session_trace_start(*session);
  if (st != PIPE_OK) return fail("cannot start the trace", st);
  return 0;
}

static int stop_trace(const generate_args *g, pipe_session *session) {
  pipe_status st = pipe_session_trace_stop(session, g->trace_path);
  if (st != PIPE_OK) return fail("cannot write the trace", st);
  return 0;
}

/* Reports a failed call about prompt `i` (0-based; users count from 1). Returns 1. */
static int fail_prompt(const generate_args *g, size_t i, const char *what, pipe_status status) {
  char label[160];
  snprintf(label, sizeof label, "prompt %zu of %zu: %s", i + 1, g->num_prompts, what);
  return fail(label, status);
}

/* Waits for prompt i's generation to finish and reads what it generated. 0, or 1 after
 * reporting (a sequence that failed names its prompt and the error). */
static int collect(generate_args *g, size_t i) {
  prompt_state *p = &g->prompts[i];
  pipe_status st = pipe_generation_wait(p->generation, -1);
  p->finished = 1;
  if (st != PIPE_OK) return fail_prompt(g, i, "generation failed", st);
  if (p->out.ids) return 0; /* collected before, while waiting for room to submit */
  pipe_generation_info info = PIPE_GENERATION_INFO_INIT;
  if ((st = pipe_generation_get_info(p->generation, &info)) != PIPE_OK)
    return fail_prompt(g, i, "cannot read the generation's progress", st);
  p->finish_reason = info.finish_reason;
  size_t capacity = info.generated_tokens > 0 ? (size_t)info.generated_tokens : 1;
  p->out.ids = malloc(capacity * sizeof *p->out.ids);
  if (!p->out.ids) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  for (int32_t done = 0; !done;) {
    if (p->out.len == capacity) {
      int64_t *grown = realloc(p->out.ids, 2 * capacity * sizeof *grown);
      if (!grown) {
        fprintf(stderr, "pipe: error: out of memory\n");
        return 1;
      }
      p->out.ids = grown;
      capacity *= 2;
    }
    size_t count = 0;
    st = pipe_generation_read(p->generation, p->out.ids + p->out.len, capacity - p->out.len, &count, &done);
    if (st != PIPE_OK) return fail_prompt(g, i, "cannot read the generated tokens", st);
    p->out.len += count;
    /* A finished sequence has every token ready: a read that gives none and is not done would
     * loop forever. */
    if (count == 0 && !done) {
      fprintf(stderr, "pipe: error: prompt %zu: libpipe reported the sequence finished but holds back its tokens\n",
              i + 1);
      return 1;
    }
  }
  return 0;
}

/* libpipe checks prompts, but a stop id outside the vocabulary would just never match: a typo
 * that silently generates to the limit. 0, or 1 after reporting. */
static int check_stop_ids(const generate_args *g, const pipe_generator *generator) {
  pipe_generator_info info = PIPE_GENERATOR_INFO_INIT;
  pipe_status st = pipe_generator_get_info(generator, &info);
  if (st != PIPE_OK) return fail("cannot read what the decoder offers", st);
  for (size_t k = 0; k < g->stop.len; ++k) {
    if (g->stop.ids[k] < 0 || g->stop.ids[k] >= info.vocab) {
      fprintf(stderr, "pipe: error: --stop-ids: %lld is outside the model's vocabulary 0..%lld\n",
              (long long)g->stop.ids[k], (long long)info.vocab - 1);
      return 1;
    }
  }
  return 0;
}

/* Submits every prompt. When the generator's queue is full (PIPE_ERR_BUSY), waits for the
 * oldest generation still going, which holds a cache slot, to finish and tries again. */
static int submit_all(generate_args *g, pipe_generator *generator) {
  size_t oldest = 0; /* every prompt before it has finished */
  for (size_t i = 0; i < g->num_prompts; ++i) {
    pipe_generation_options o = g->generation;
    o.seed = g->generation.seed + (uint64_t)i; /* wraps around, as the seed is any 64-bit value */
    o.stop_ids = g->stop.ids;
    o.num_stop_ids = g->stop.len;
    prompt_state *p = &g->prompts[i];
    for (;;) {
      pipe_status st = pipe_generator_submit(generator, p->prompt.ids, p->prompt.len, &o, &p->generation);
      if (st == PIPE_OK) break;
      if (st != PIPE_ERR_BUSY) return fail_prompt(g, i, "cannot submit", st);
      while (oldest < i && g->prompts[oldest].finished) ++oldest;
      if (oldest == i) { /* nothing of ours is in flight: busy would never end */
        fail_prompt(g, i, "the generator is busy with no generation of this command in flight", st);
        return 1;
      }
      if (collect(g, oldest) != 0) return 1;
    }
  }
  return 0;
}

static const char *finish_reason_name(int32_t reason) {
  switch (reason) {
    case PIPE_FINISH_STOP: return "stop";
    case PIPE_FINISH_LENGTH: return "length";
    case PIPE_FINISH_CANCELLED: return "cancelled";
    case PIPE_FINISH_DEADLINE: return "deadline";
    case PIPE_FINISH_ERROR: return "error";
    default: return "none";
  }
}

static void print_ids(const id_list *ids) {
  for (size_t k = 0; k < ids->len; ++k) printf("%s%lld", k ? " " : "", (long long)ids->ids[k]);
}

/* This process's peak resident memory in MiB: VmHWM, the high-water mark of its own address space. Not
 * getrusage's ru_maxrss: Linux carries that over from the address space an exec replaced, so a `pipe` started by
 * a benchmark holding a 5 GB model reported 5 GB for a 135M model. ru_maxrss only where /proc is absent. */
static double own_peak_rss_mib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (f) {
    char line[256];
    long long kib = -1;
    while (kib < 0 && fgets(line, sizeof line, f))
      if (sscanf(line, "VmHWM: %lld kB", &kib) != 1) kib = -1;
    fclose(f);
    if (kib >= 0) return (double)kib / 1024.0;
  }
  struct rusage u;
  return getrusage(RUSAGE_SELF, &u) == 0 ? (double)u.ru_maxrss / 1024.0 : 0.0; /* ru_maxrss is in KiB */
}

/* Peak resident memory in MiB: of this process, and of the largest worker process it started and has
 * waited for (0 without workers). A worker's figure is getrusage's: the larger of its own peak and what this
 * process held in anonymous memory when it forked the worker, which is before any weight is loaded. */
static void peak_rss_mib(double *self, double *workers) {
  struct rusage u;
  *self = own_peak_rss_mib();
  *workers = getrusage(RUSAGE_CHILDREN, &u) == 0 ? (double)u.ru_maxrss / 1024.0 : 0.0;
}

/* After the generator is closed (its workers waited for), with the statistics read before. */
static void print_json(const generate_args *g, const pipe_generator_stats *stats_in) {
  const pipe_generator_stats stats = *stats_in;
  double rss, worker_rss;
  peak_rss_mib(&rss, &worker_rss);
  printf("{\"outputs\": [");
  for (size_t i = 0; i < g->num_prompts; ++i) {
    const id_list *out = &g->prompts[i].out;
    printf("%s[", i ? ", " : "");
    for (size_t k = 0; k < out->len; ++k) printf("%s%lld", k ? ", " : "", (long long)out->ids[k]);
    printf("]");
  }
  printf("], \"tokens_per_s\": %.3f, \"time_to_first_token_ms\": %.3f, \"finish_reasons\": [",
         isfinite(stats.tokens_per_s) ? stats.tokens_per_s : 0.0,
         isfinite(stats.mean_time_to_first_token_ms) ? stats.mean_time_to_first_token_ms : 0.0);
  for (size_t i = 0; i < g->num_prompts; ++i)
    printf("%s\"%s\"", i ? ", " : "", finish_reason_name(g->prompts[i].finish_reason));
  printf("], \"steps_in_flight\": {\"now\": %lld, \"one_at_a_time\": %llu, \"pipelined\": %llu}",
         (long long)stats.steps_in_flight, (unsigned long long)stats.steps_one_at_a_time,
         (unsigned long long)stats.steps_pipelined);
  printf(", \"peak_rss_mib\": {\"driver\": %.1f, \"largest_worker\": %.1f}", rss, worker_rss);
  if (g->texts) {
    printf(", \"texts\": [");
    for (size_t i = 0; i < g->num_prompts; ++i) {
      if (i) printf(", ");
      print_json_string(g->texts[i]);
    }
    printf("]");
  }
  printf("}\n");
}

int cmd_generate(int argc, char **argv) {
  const char *model_path = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args session;
  init_session_args(&session);
  generate_args g;
  memset(&g, 0, sizeof g);
  pipe_generation_options generation = PIPE_GENERATION_OPTIONS_INIT;
  pipe_generator_options generator = PIPE_GENERATOR_OPTIONS_INIT;
  g.generation = generation;
  g.generator = generator;
  g.greedy = 1;
  g.prompts = calloc(argc > 0 ? (size_t)argc : 1, sizeof *g.prompts);
  if (!g.prompts) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  int rc = 2;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--microbatches") == 0 || strcmp(a, "--microbatching") == 0) {
      usage_error("generate: %s does not apply: each generation step is one micro-batch", a);
      goto done;
    }
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "generate", &session);
    if (r == 0) r = parse_generate_arg(argc, argv, &i, &g, &session);
    if (r == 2) goto done;
    if (r == 1) continue;
    if (a[0] == '-') {
      usage_error("generate: unknown option '%s'", a);
      goto done;
    }
    if (model_path) {
      usage_error("generate: unexpected argument '%s'", a);
      goto done;
    }
    model_path = a;
  }
  if (!model_path) {
    usage_error("generate: MODEL is required");
    goto done;
  }
  if (g.num_prompts == 0) {
    usage_error(
        "generate: give at least one prompt as --prompt TEXT or --prompt-ids ID,ID,... (token ids of the "
        "model's vocabulary)");
    goto done;
  }
  if (!g.has_max_new_tokens) {
    usage_error("generate: --max-new-tokens N is required (tokens to generate per prompt at most)");
    goto done;
  }
  if (g.greedy && g.sampling_flag) {
    usage_error("generate: %s samples, which needs --temperature T above 0 (without it, decoding is greedy)",
                g.sampling_flag);
    goto done;
  }
  if (g.trace_operators && !g.trace_path) {
    usage_error("generate: --trace-operators adds to a trace: give --trace TRACE.json too");
    goto done;
  }
  if (split.policy && strcmp(split.policy, "time") == 0) {
    usage_error(
        "generate: --policy time measures the model on inputs, which generate does not take; use uniform "
        "or params, or --split-at between decoder layers");
    goto done;
  }
  if (check_split_args("generate", &split) || check_session_args("generate", &session)) goto done;
  if (session.launched && session.launch.rank != 0) {
    rc = serve_launched_rank(&session);
    goto done;
  }

  if ((rc = prepare_text(&g, split.weights.weights)) != 0) goto done;
  rc = 1;
  pipeline p;
  pipe_generator_stats stats = PIPE_GENERATOR_STATS_INIT;
  if (open_generator(&p, model_path, &split, &session, &g.generator) != 0) goto done;
  pipe_session *traced = NULL;
  if (g.trace_path && start_trace(&g, p.generator, &traced) != 0) {
    close_pipeline(&p);
    goto done;
  }
  if (check_stop_ids(&g, p.generator) == 0 && submit_all(&g, p.generator) == 0) {
    int failed = 0;
    for (size_t i = 0; i < g.num_prompts && !failed; ++i) {
      failed = collect(&g, i) != 0;
      if (!failed && !g.json && !g.tokenizer) {
        print_ids(&g.prompts[i].out);
        putchar('\n');
        fflush(stdout);
      }
    }
    if (!failed && g.tokenizer) failed = decode_replies(&g) != 0;
    if (!failed && g.tokenizer && !g.json)
      for (size_t i = 0; i < g.num_prompts; ++i) printf("%s\n", g.texts[i]);
    if (!failed && traced) failed = stop_trace(&g, traced) != 0;
    if (!failed && g.json) {
      pipe_status st = pipe_generator_get_stats(p.generator, &stats);
      if (st != PIPE_OK) failed = fail("cannot read the generator's statistics", st);
    }
    if (!failed) rc = 0;
  }
  /* The generator first: it cancels what still runs (after an error) at once. */
  close_pipeline(&p);
  if (rc == 0 && g.json) print_json(&g, &stats); /* now its workers have exited: their peak memory is known */
  for (size_t i = 0; i < g.num_prompts; ++i) pipe_generation_destroy(g.prompts[i].generation);
done:
  free_args(&g);
  return rc;
}
