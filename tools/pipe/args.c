/* Argument parsing shared by the commands: SPLIT and weight options, session and process
 * options, integers, and the two ways an error is reported. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pipe: error: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs(" (run 'pipe --help' for usage)\n", stderr);
  va_end(ap);
  return 2;
}

int fail(const char *what, pipe_status status) {
  fprintf(stderr, "pipe: error: %s: ", what);
  for (const char *c = pipe_last_error(); *c; ++c) fputc(*c == '\n' || *c == '\r' ? ' ' : *c, stderr);
  fprintf(stderr, " [%s]\n", pipe_status_string(status));
  return 1;
}

int parse_int(const char *flag, const char *text, int32_t *out) {
  char *end = NULL;
  errno = 0;
  long value = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < INT32_MIN || value > INT32_MAX)
    return usage_error("%s expects an integer, got '%s'", flag, text);
  *out = (int32_t)value;
  return 0;
}

int parse_int64_at_least(const char *command, const char *flag, const char *text, int64_t min, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long value = strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0')
    return usage_error("%s: %s expects an integer, got '%s'", command, flag, text);
  if (value < min) return usage_error("%s: %s must be at least %lld, got %lld", command, flag, (long long)min, value);
  *out = (int64_t)value;
  return 0;
}

int parse_number(const char *command, const char *flag, const char *text, double *out) {
  char *end = NULL;
  errno = 0;
  double value = strtod(text, &end);
  if (errno != 0 || end == text || *end != '\0' || !isfinite(value))
    return usage_error("%s: %s expects a number, got '%s'", command, flag, text);
  *out = value;
  return 0;
}

int parse_seed(const char *command, const char *text, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  const char *digits = text + strspn(text, " ");
  unsigned long long value = strtoull(digits, &end, 10);
  if (*digits == '-' || *digits == '+' || errno != 0 || end == digits || *end != '\0')
    return usage_error("%s: --seed expects an integer from 0 to 18446744073709551615, got '%s'", command, text);
  *out = (uint64_t)value;
  return 0;
}

/* A progress bar on stderr while a stage's weights load, when stderr is a terminal. */
static void show_progress(void *user_data, size_t stage, uint64_t done, uint64_t total) {
  (void)user_data;
  const int width = 30;
  int filled = total ? (int)((double)done / (double)total * width) : width;
  fprintf(stderr, "\rloading stage %zu [%.*s%*s] %6.1f / %.1f MiB", stage, filled, "##############################",
          width - filled, "", (double)done / 1048576.0, (double)total / 1048576.0);
  if (done >= total) fputc('\n', stderr);
  fflush(stderr);
}

int parse_split_arg(int argc, char **argv, int *i, split_args *s) {
  const char *a = argv[*i];
  if (strcmp(a, "--split-at") != 0 && strcmp(a, "--stages") != 0 && strcmp(a, "--policy") != 0 &&
      strcmp(a, "--weights") != 0 && strcmp(a, "--dtype") != 0 && strcmp(a, "--quantize") != 0 &&
      strcmp(a, "--quantize-head") != 0 && strcmp(a, "--quantize-embedding") != 0)
    return 0;
  if (*i + 1 >= argc) return usage_error("%s needs a value", a);
  const char *v = argv[++*i];
  if (strcmp(a, "--weights") == 0) {
    s->weights.weights = v;
    if (isatty(2)) s->weights.progress = show_progress;
  } else if (strcmp(a, "--dtype") == 0) {
    if (strcmp(v, "fp32") == 0 || strcmp(v, "float32") == 0) s->weights.dtype = PIPE_DTYPE_FLOAT32;
    else if (strcmp(v, "fp16") == 0 || strcmp(v, "float16") == 0) s->weights.dtype = PIPE_DTYPE_FLOAT16;
    else if (strcmp(v, "bf16") == 0 || strcmp(v, "bfloat16") == 0) s->weights.dtype = PIPE_DTYPE_BFLOAT16;
    else return usage_error("--dtype takes fp32, fp16 or bf16, not '%s'", v);
  } else if (strcmp(a, "--quantize") == 0) {
    s->weights.quantize_group = 0;
    if (strcmp(v, "int8") == 0) s->weights.quantize = PIPE_QUANTIZE_INT8;
    else if (strcmp(v, "int4") == 0) s->weights.quantize = PIPE_QUANTIZE_INT4;
    else if (strcmp(v, "int4:32") == 0 || strcmp(v, "int4:64") == 0 || strcmp(v, "int4:128") == 0) {
      s->weights.quantize = PIPE_QUANTIZE_INT4;
      s->weights.quantize_group = atoi(v + 5);
    } else if (strcmp(v, "none") == 0) s->weights.quantize = PIPE_QUANTIZE_NONE;
    else return usage_error("--quantize takes int8, int4, int4:32, int4:64, int4:128 or none, not '%s'", v);
  } else if (strcmp(a, "--quantize-head") == 0) {
    if (strcmp(v, "int8") == 0) s->weights.quantize_head = PIPE_QUANTIZE_HEAD_INT8;
    else if (strcmp(v, "int4") == 0) s->weights.quantize_head = PIPE_QUANTIZE_HEAD_INT4;
    else if (strcmp(v, "none") == 0) s->weights.quantize_head = PIPE_QUANTIZE_HEAD_NONE;
    else return usage_error("--quantize-head takes int8, int4 or none, not '%s'", v);
  } else if (strcmp(a, "--quantize-embedding") == 0) {
    if (strcmp(v, "int8") == 0) s->weights.quantize_embedding = PIPE_QUANTIZE_EMBEDDING_INT8;
    else if (strcmp(v, "none") == 0) s->weights.quantize_embedding = PIPE_QUANTIZE_EMBEDDING_NONE;
    else return usage_error("--quantize-embedding takes int8 or none, not '%s'", v);
  } else if (strcmp(a, "--split-at") == 0) {
    if (s->num_points == MAX_SPLIT_POINTS) return usage_error("at most %d --split-at", MAX_SPLIT_POINTS);
    s->points[s->num_points++] = v;
  } else if (strcmp(a, "--stages") == 0) {
    if (parse_int(a, v, &s->stages) != 0) return 2;
    s->has_stages = 1;
  } else {
    s->policy = v;
  }
  return 1;
}

int check_split_args(const char *cmd, const split_args *split) {
  if (split->policy && !split->has_stages) return usage_error("%s: --policy needs --stages N", cmd);
  /* The head's storage is a choice among quantized weights (pipe_stage_options.quantize_head). */
  if (split->weights.quantize_head != PIPE_QUANTIZE_HEAD_DEFAULT && split->weights.quantize == PIPE_QUANTIZE_NONE)
    return usage_error("%s: --quantize-head needs --quantize int8 or int4 (the other weights' storage)", cmd);
  return 0;
}

static int parse_microbatching(const char *command, const char *text, int32_t *out) {
  if (strcmp(text, "adaptive") == 0) *out = PIPE_MICROBATCHING_ADAPTIVE;
  else if (strcmp(text, "fixed") == 0) *out = PIPE_MICROBATCHING_FIXED;
  else return usage_error("%s: --microbatching is adaptive or fixed, got '%s'", command, text);
  return 0;
}

void init_session_args(session_args *s) {
  pipe_session_options defaults = PIPE_SESSION_OPTIONS_INIT;
  memset(s, 0, sizeof *s);
  s->options = defaults;
}

int parse_session_arg(int argc, char **argv, int *i, const char *command, session_args *s) {
  static const char *const flags[] = {"--microbatches", "--microbatching", "--processes", "--world-size",
                                      "--store",        "--transport",     "--devices",   "--comm-timeout-ms",
                                      "--replicate",    "--token-file"};
  const char *a = argv[*i];
  size_t k = 0;
  while (k < sizeof flags / sizeof *flags && strcmp(a, flags[k]) != 0) ++k;
  if (k == sizeof flags / sizeof *flags) return 0;
  if (*i + 1 >= argc) return usage_error("%s: %s needs a value", command, a);
  const char *v = argv[++*i];
  pipe_session_options *o = &s->options;
  switch (k) {
    case 0: return parse_int(a, v, &o->num_microbatches) ? 2 : 1;
    case 1: return parse_microbatching(command, v, &o->microbatching) ? 2 : 1;
    case 2:
      if (parse_int(a, v, &s->processes)) return 2;
      if (s->processes < 1) return usage_error("%s: --processes must be at least 1, got %d", command, s->processes);
      return 1;
    case 3: return parse_int(a, v, &o->world_size) ? 2 : 1;
    case 4: o->store = v; return 1;
    case 5:
      /* gloo: the name of the TCP transport before 0.12 */
      if (strcmp(v, "tcp") == 0 || strcmp(v, "gloo") == 0) o->transport = PIPE_TRANSPORT_TCP;
      else if (strcmp(v, "nccl") == 0) o->transport = PIPE_TRANSPORT_NCCL;
      else if (strcmp(v, "local") == 0) o->transport = PIPE_TRANSPORT_LOCAL;
      else return usage_error("%s: --transport is tcp, nccl or local, got '%s'", command, v);
      return 1;
    case 6: o->devices = v; return 1; /* libpipe checks the list against the plan */
    case 8:
      if (strcmp(command, "run") != 0 && strcmp(command, "bench") != 0)
        return usage_error("%s: --replicate applies to run and bench, whose inputs are cut into micro-batches",
                           command);
      if (s->num_replicated == MAX_REPLICATED)
        return usage_error("%s: at most %d --replicate", command, MAX_REPLICATED);
      s->replicated[s->num_replicated++] = v; /* names are checked against the model once it is loaded */
      return 1;
    case 9:
      if (read_token_file(command, v, s->token, sizeof s->token)) return 2;
      o->token = s->token;
      return 1;
    default:
      if (parse_int(a, v, &o->comm_timeout_ms)) return 2;
      if (o->comm_timeout_ms < 1)
        return usage_error("%s: --comm-timeout-ms must be positive, got %d", command, o->comm_timeout_ms);
      return 1;
  }
}

int check_session_args(const char *cmd, session_args *s) {
  pipe_session_options *o = &s->options;
  if (apply_launcher(cmd, s)) return 2;
  if (s->processes > 0 && o->world_size != 1)
    return usage_error("%s: give either --processes N (local workers) or --world-size N (workers started elsewhere)",
                       cmd);
  if (s->processes > 1) o->world_size = s->processes;
  if (o->world_size < 1) return usage_error("%s: --world-size must be at least 1, got %d", cmd, o->world_size);
  if (o->world_size > 1 && s->processes == 0 && !o->store)
    return usage_error("%s: --world-size needs --store HOST:PORT, the address its workers were given", cmd);
  if (o->world_size > 1 && o->transport == PIPE_TRANSPORT_LOCAL) o->transport = PIPE_TRANSPORT_TCP;
  /* Local workers share a token made now, unless one was given: it reaches them in their environment. */
  if (s->processes > 1 && !o->token && !getenv("LIBPIPE_TOKEN")) {
    if (fresh_token(s->token, sizeof s->token)) return 2;
    o->token = s->token;
  }
  return 0;
}
