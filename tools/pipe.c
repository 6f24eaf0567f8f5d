/* pipe: the libpipe command-line tool. Written against the public C ABI (pipe/pipe.h) only, so
 * it is also a working example of that ABI. Every error ends with one line on stderr and a
 * non-zero exit status: 1 for a failed operation, 2 for a usage error. */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pipe/pipe.h>

static const char usage_text[] =
    "usage: pipe <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  split MODEL [--json]\n"
    "      Cut MODEL (a TorchScript file) at its pipe::split() markers and print the plan.\n"
    "  run MODEL --input IN.safetensors --output OUT.safetensors [--microbatches M]\n"
    "      Run MODEL through the pipeline. IN holds one tensor per forward argument, named as\n"
    "      in the model code; OUT receives 'output' (or output.0, output.1, ... for tuples,\n"
    "      output.<key> for dicts).\n"
    "  version\n"
    "      Print the libpipe version.\n";

static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pipe: error: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs(" (run 'pipe --help' for usage)\n", stderr);
  va_end(ap);
  return 2;
}

/* Reports a failed libpipe call: its status name and message on one line (line breaks in the
 * message become spaces, so scripts can rely on a single line). */
static int fail(const char *what, pipe_status status) {
  fprintf(stderr, "pipe: error: %s: ", what);
  for (const char *c = pipe_last_error(); *c; ++c) fputc(*c == '\n' || *c == '\r' ? ' ' : *c, stderr);
  fprintf(stderr, " [%s]\n", pipe_status_string(status));
  return 1;
}

static int parse_positive_int(const char *flag, const char *text, int32_t *out) {
  char *end = NULL;
  errno = 0;
  long value = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < INT32_MIN || value > INT32_MAX)
    return usage_error("%s expects an integer, got '%s'", flag, text);
  *out = (int32_t)value;
  return 0;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int load_plan(const char *model_path, pipe_model **model, pipe_plan **plan) {
  pipe_status st = pipe_model_load(model_path, model);
  if (st != PIPE_OK) return fail("cannot load model", st);
  st = pipe_plan_create(*model, NULL, plan);
  if (st != PIPE_OK) {
    pipe_model_destroy(*model);
    *model = NULL;
    return fail("cannot split model", st);
  }
  return 0;
}

static void print_names(const pipe_plan *plan, size_t stage, int32_t kind, const char *label) {
  size_t n = 0;
  pipe_plan_stage_count_names(plan, stage, kind, &n);
  if (n == 0) return;
  printf("    %s:", label);
  for (size_t i = 0; i < n; ++i) {
    const char *name = NULL;
    pipe_plan_stage_name(plan, stage, kind, i, &name);
    printf(" %s", name);
  }
  printf("\n");
}

static int cmd_split(int argc, char **argv) {
  const char *model_path = NULL;
  int json = 0;
  for (int i = 0; i < argc; ++i) {
    if (strcmp(argv[i], "--json") == 0) json = 1;
    else if (argv[i][0] == '-') return usage_error("split: unknown option '%s'", argv[i]);
    else if (!model_path) model_path = argv[i];
    else return usage_error("split: unexpected argument '%s'", argv[i]);
  }
  if (!model_path) return usage_error("split: MODEL is required");

  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  if (load_plan(model_path, &model, &plan) != 0) return 1;
  if (json) {
    const char *text = NULL;
    pipe_plan_describe(plan, &text);
    printf("%s\n", text);
  } else {
    size_t stages = 0;
    pipe_plan_num_stages(plan, &stages);
    printf("%s: %zu stage%s\n", model_path, stages, stages == 1 ? "" : "s");
    for (size_t s = 0; s < stages; ++s) {
      uint64_t bytes = 0;
      size_t params = 0, buffers = 0;
      pipe_plan_stage_param_bytes(plan, s, &bytes);
      pipe_plan_stage_count_names(plan, s, PIPE_NAMES_PARAMETERS, &params);
      pipe_plan_stage_count_names(plan, s, PIPE_NAMES_BUFFERS, &buffers);
      printf("  stage %zu: %zu parameters, %zu buffers, %.2f MiB\n", s, params, buffers,
             (double)bytes / (1024.0 * 1024.0));
      print_names(plan, s, PIPE_NAMES_PARAMETERS, "parameters");
      print_names(plan, s, PIPE_NAMES_BUFFERS, "buffers");
    }
  }
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return 0;
}

/* Lists the model's forward argument names, comma-separated, into buf. */
static void input_list(const pipe_model *model, char *buf, size_t size) {
  size_t n = 0, used = 0;
  buf[0] = '\0';
  pipe_model_num_inputs(model, &n);
  for (size_t i = 0; i < n && used < size; ++i) {
    const char *name = NULL;
    pipe_model_input_name(model, i, &name);
    int w = snprintf(buf + used, size - used, "%s%s", i ? ", " : "", name);
    if (w < 0) break;
    used += (size_t)w;
  }
}

static int cmd_run(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL, *out_path = NULL;
  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    int has_value = i + 1 < argc;
    if (strcmp(a, "--input") == 0 || strcmp(a, "--output") == 0 || strcmp(a, "--microbatches") == 0) {
      if (!has_value) return usage_error("run: %s needs a value", a);
      const char *v = argv[++i];
      if (strcmp(a, "--input") == 0) in_path = v;
      else if (strcmp(a, "--output") == 0) out_path = v;
      else if (parse_positive_int(a, v, &options.num_microbatches) != 0) return 2;
    } else if (a[0] == '-') {
      return usage_error("run: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("run: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("run: MODEL is required");
  if (!in_path) return usage_error("run: --input IN.safetensors is required");
  if (!out_path) return usage_error("run: --output OUT.safetensors is required");

  int rc = 1;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_session *session = NULL;
  pipe_tensor_list *in = NULL, *out = NULL;
  const DLManagedTensor **args = NULL;
  char names[1024];
  pipe_status st;

  if (load_plan(model_path, &model, &plan) != 0) goto done;
  if ((st = pipe_safetensors_read(in_path, &in)) != PIPE_OK) {
    fail("cannot read inputs", st);
    goto done;
  }
  size_t num_inputs = 0, num_tensors = 0;
  pipe_model_num_inputs(model, &num_inputs);
  pipe_tensor_list_size(in, &num_tensors);
  input_list(model, names, sizeof names);
  /* Every tensor in the file must be a forward argument: a misspelt name is an error, not a
   * silently ignored tensor. */
  for (size_t t = 0; t < num_tensors; ++t) {
    const char *tensor_name = NULL;
    pipe_tensor_list_name(in, t, &tensor_name);
    int known = 0;
    for (size_t i = 0; i < num_inputs && !known; ++i) {
      const char *input_name = NULL;
      pipe_model_input_name(model, i, &input_name);
      known = strcmp(input_name, tensor_name) == 0;
    }
    if (!known) {
      fprintf(stderr, "pipe: error: '%s' holds tensor '%s', which is not an input of the model (inputs: %s)\n",
              in_path, tensor_name, names);
      goto done;
    }
  }
  args = calloc(num_inputs ? num_inputs : 1, sizeof *args);
  if (!args) {
    fprintf(stderr, "pipe: error: out of memory\n");
    goto done;
  }
  for (size_t i = 0; i < num_inputs; ++i) {
    const char *input_name = NULL;
    size_t index = 0;
    pipe_model_input_name(model, i, &input_name);
    if (pipe_tensor_list_find(in, input_name, &index) != PIPE_OK) {
      fprintf(stderr, "pipe: error: '%s' has no tensor named '%s' (the model's inputs are: %s)\n",
              in_path, input_name, names);
      goto done;
    }
    pipe_tensor_list_get(in, index, &args[i]);
  }
  if ((st = pipe_session_create(plan, &options, &session)) != PIPE_OK) {
    fail("cannot create session", st);
    goto done;
  }
  double start = now_ms();
  if ((st = pipe_session_run(session, args, num_inputs, &out)) != PIPE_OK) {
    fail("run failed", st);
    goto done;
  }
  double elapsed = now_ms() - start;
  if ((st = pipe_safetensors_write(out, out_path)) != PIPE_OK) {
    fail("cannot write outputs", st);
    goto done;
  }
  size_t num_outputs = 0;
  pipe_tensor_list_size(out, &num_outputs);
  printf("pipe: ran %s in %.1f ms; wrote %zu output%s to %s\n", model_path, elapsed,
          num_outputs, num_outputs == 1 ? "" : "s", out_path);
  rc = 0;

done:
  free(args);
  pipe_tensor_list_destroy(out);
  pipe_tensor_list_destroy(in);
  pipe_session_destroy(session);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fputs(usage_text, stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    fputs(usage_text, stdout);
    return 0;
  }
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("pipe %s\n", pipe_version());
    return 0;
  }
  if (strcmp(cmd, "split") == 0) return cmd_split(argc - 2, argv + 2);
  if (strcmp(cmd, "run") == 0) return cmd_run(argc - 2, argv + 2);
  return usage_error("unknown command '%s'", cmd);
}
