/* pipe: the libpipe command-line tool. Written against the public C ABI (pipe/pipe.h) only, so
 * it is also a working example of that ABI. Every error ends with one line on stderr and a
 * non-zero exit status: 1 for a failed operation, 2 for a usage error. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <pipe/pipe.h>

static const char usage_text[] =
    "usage: pipe <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  inspect MODEL\n"
    "      Print MODEL's module tree with parameter counts and bytes.\n"
    "  split MODEL [SPLIT] [--input IN.safetensors] [--json] [--save-stages DIR [--stage K]]\n"
    "      Cut MODEL (a TorchScript file) into stages and print the plan. With --input, each\n"
    "      stage is timed on those inputs; --save-stages writes DIR/stage<i>.pt (only stage K\n"
    "      with --stage), each a standalone TorchScript module holding only its weights.\n"
    "  run MODEL [SPLIT] --input IN.safetensors --output OUT.safetensors [--microbatches M]\n"
    "      [--microbatching adaptive|fixed] [--trace TRACE.json]\n"
    "      Run MODEL through the pipeline. IN holds one tensor per forward argument, named as\n"
    "      in the model code; OUT receives 'output' (or output.0, output.1, ... for tuples,\n"
    "      output.<key> for dicts). --trace writes a Chrome trace of the run (one track per\n"
    "      stage), viewable in Perfetto.\n"
    "  bench MODEL [SPLIT] --input IN.safetensors [--microbatches M] [--requests R]\n"
    "      [--concurrency C] [--threads-per-stage T] [--microbatching adaptive|fixed] [--json]\n"
    "      Run R requests (default 100) of IN from C threads at once (default 2) after a\n"
    "      warm-up, and report throughput, latency percentiles and each stage's busy fraction.\n"
    "      --microbatching fixed cuts every request into M micro-batches; adaptive (the\n"
    "      default) cuts a request that arrives while others are in flight more coarsely.\n"
    "  worker --rank R --world-size N --store HOST:PORT [--comm-timeout-ms T] [--threads T]\n"
    "      Host stages for a session whose driver (a `pipe run`/`bench` with --world-size, or a\n"
    "      program of the C ABI) listens at HOST:PORT; exits when that session ends.\n"
    "  version\n"
    "      Print the libpipe version.\n"
    "\n"
    "SPLIT is one of:\n"
    "  (nothing)                       cut at the pipe::split() markers in the model code\n"
    "  --split-at FQN:begin|FQN:end    cut before/after module FQN (repeatable; FQN@K:end\n"
    "                                  for the K-th call of a module called several times)\n"
    "  --stages N --policy P           N stages balanced by P: uniform (equal layers), params\n"
    "                                  (equal parameter bytes) or time (measured on --input)\n"
    "and may add:\n"
    "  --weights FILE_OR_INDEX         load each stage's weights from a .safetensors file or a\n"
    "                                  *.safetensors.index.json (needed for skeleton models)\n"
    "  --dtype fp32|fp16|bf16          convert floating weights (and inputs) to this dtype\n"
    "\n"
    "run and bench spread the stages over processes with:\n"
    "  --processes N                   start N-1 local workers (`pipe worker`) and use them\n"
    "  --world-size N --store HOST:PORT  drive N-1 workers started elsewhere; this process\n"
    "                                  hosts the rendezvous store at HOST:PORT\n"
    "  --transport gloo|nccl           how stages talk (default gloo: CPU tensors over TCP)\n"
    "  --comm-timeout-ms T             how long workers may stay silent (default 60000)\n";

#define MAX_SPLIT_POINTS 256

/* The SPLIT arguments shared by split, run and bench, with the stage weight options. */
typedef struct {
  const char *points[MAX_SPLIT_POINTS];
  int num_points;
  int32_t stages;
  int has_stages;
  const char *policy;
  pipe_stage_options weights; /* --weights, --dtype */
} split_args;

#define SPLIT_ARGS_INIT {{0}, 0, 0, 0, NULL, PIPE_STAGE_OPTIONS_INIT}

/* A progress bar on stderr while a stage's weights load, when stderr is a terminal. */
static void show_progress(void *user_data, size_t stage, uint64_t done, uint64_t total) {
  (void)user_data;
  const int width = 30;
  int filled = total ? (int)((double)done / (double)total * width) : width;
  fprintf(stderr, "\rloading stage %zu [%.*s%*s] %6.1f / %.1f MiB", stage, filled,
          "##############################", width - filled, "", (double)done / 1048576.0, (double)total / 1048576.0);
  if (done >= total) fputc('\n', stderr);
  fflush(stderr);
}

/* Consumes argv[*i] (and its value) if it is a SPLIT argument: returns 1 if consumed, 0 if not
 * a SPLIT argument, 2 after reporting a usage error. */
static int parse_split_arg(int argc, char **argv, int *i, split_args *s);

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

static int parse_int(const char *flag, const char *text, int32_t *out) {
  char *end = NULL;
  errno = 0;
  long value = strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < INT32_MIN || value > INT32_MAX)
    return usage_error("%s expects an integer, got '%s'", flag, text);
  *out = (int32_t)value;
  return 0;
}

static int parse_microbatching(const char *command, const char *text, int32_t *out) {
  if (strcmp(text, "adaptive") == 0) *out = PIPE_MICROBATCHING_ADAPTIVE;
  else if (strcmp(text, "fixed") == 0) *out = PIPE_MICROBATCHING_FIXED;
  else return usage_error("%s: --microbatching is adaptive or fixed, got '%s'", command, text);
  return 0;
}

/* The session options run and bench share: micro-batching, and the processes the stages are
 * spread over. */
typedef struct {
  pipe_session_options options;
  int32_t processes; /* --processes: 0 when not given */
  char store[64];    /* the store address chosen for local workers */
} session_args;

static void init_session_args(session_args *s) {
  pipe_session_options defaults = PIPE_SESSION_OPTIONS_INIT;
  memset(s, 0, sizeof *s);
  s->options = defaults;
}

/* Same protocol as parse_split_arg: 0 when argv[*i] is not one of them, 1 when it was consumed
 * (with its value), 2 after a usage error. */
static int parse_session_arg(int argc, char **argv, int *i, const char *command, session_args *s) {
  static const char *const flags[] = {"--microbatches", "--microbatching", "--processes", "--world-size",
                                      "--store", "--transport", "--comm-timeout-ms"};
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
      if (strcmp(v, "gloo") == 0) o->transport = PIPE_TRANSPORT_GLOO;
      else if (strcmp(v, "nccl") == 0) o->transport = PIPE_TRANSPORT_NCCL;
      else if (strcmp(v, "local") == 0) o->transport = PIPE_TRANSPORT_LOCAL;
      else return usage_error("%s: --transport is gloo, nccl or local, got '%s'", command, v);
      return 1;
    default:
      if (parse_int(a, v, &o->comm_timeout_ms)) return 2;
      if (o->comm_timeout_ms < 1) return usage_error("%s: --comm-timeout-ms must be positive, got %d", command, o->comm_timeout_ms);
      return 1;
  }
}

/* Checks the combination of process options and fills in what they imply. 2 after a usage
 * error. */
static int check_session_args(const char *cmd, session_args *s) {
  pipe_session_options *o = &s->options;
  if (s->processes > 0 && o->world_size != 1)
    return usage_error("%s: give either --processes N (local workers) or --world-size N (workers started elsewhere)", cmd);
  if (s->processes > 1) o->world_size = s->processes;
  if (o->world_size < 1) return usage_error("%s: --world-size must be at least 1, got %d", cmd, o->world_size);
  if (o->world_size > 1 && s->processes == 0 && !o->store)
    return usage_error("%s: --world-size needs --store HOST:PORT, the address its workers were given", cmd);
  if (o->world_size > 1 && o->transport == PIPE_TRANSPORT_LOCAL) o->transport = PIPE_TRANSPORT_GLOO;
  return 0;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int parse_split_arg(int argc, char **argv, int *i, split_args *s) {
  const char *a = argv[*i];
  if (strcmp(a, "--split-at") != 0 && strcmp(a, "--stages") != 0 && strcmp(a, "--policy") != 0 &&
      strcmp(a, "--weights") != 0 && strcmp(a, "--dtype") != 0)
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

/* Cuts `model` as SPLIT says; `examples` (may be NULL) are example inputs for timing. */
static int make_plan(pipe_model *model, const split_args *split, const DLManagedTensor *const *examples,
                     size_t num_examples, pipe_plan **plan) {
  pipe_plan_options *options = NULL;
  pipe_status st = pipe_plan_options_create(&options);
  for (int i = 0; i < split->num_points && st == PIPE_OK; ++i)
    st = pipe_plan_options_add_split_point(options, split->points[i]);
  if (st == PIPE_OK && (split->has_stages || split->policy))
    st = pipe_plan_options_set_stages(options, split->stages, split->policy ? split->policy : "uniform");
  if (st == PIPE_OK && examples) st = pipe_plan_options_set_example_inputs(options, examples, num_examples);
  if (st == PIPE_OK) st = pipe_plan_create(model, options, plan);
  pipe_plan_options_destroy(options);
  return st == PIPE_OK ? 0 : fail("cannot split model", st);
}

static int check_split_args(const char *cmd, const split_args *split) {
  if (split->policy && !split->has_stages) return usage_error("%s: --policy needs --stages N", cmd);
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

/* Reads IN and lines its tensors up with the model's forward arguments in `*args` (borrowed from
 * `*list`, which the caller destroys). Every tensor in the file must be a forward argument: a
 * misspelt name is an error, not a silently ignored tensor. */
static int read_inputs(const pipe_model *model, const char *path, pipe_tensor_list **list,
                       const DLManagedTensor ***args, size_t *num_args) {
  pipe_status st = pipe_safetensors_read(path, list);
  if (st != PIPE_OK) return fail("cannot read inputs", st);
  char names[1024];
  size_t num_inputs = 0, num_tensors = 0;
  pipe_model_num_inputs(model, &num_inputs);
  pipe_tensor_list_size(*list, &num_tensors);
  input_list(model, names, sizeof names);
  for (size_t t = 0; t < num_tensors; ++t) {
    const char *tensor_name = NULL;
    int known = 0;
    pipe_tensor_list_name(*list, t, &tensor_name);
    for (size_t i = 0; i < num_inputs && !known; ++i) {
      const char *input_name = NULL;
      pipe_model_input_name(model, i, &input_name);
      known = strcmp(input_name, tensor_name) == 0;
    }
    if (!known) {
      fprintf(stderr, "pipe: error: '%s' holds tensor '%s', which is not an input of the model (inputs: %s)\n",
              path, tensor_name, names);
      return 1;
    }
  }
  *args = calloc(num_inputs ? num_inputs : 1, sizeof **args);
  if (!*args) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < num_inputs; ++i) {
    const char *input_name = NULL;
    size_t index = 0;
    pipe_model_input_name(model, i, &input_name);
    if (pipe_tensor_list_find(*list, input_name, &index) != PIPE_OK) {
      fprintf(stderr, "pipe: error: '%s' has no tensor named '%s' (the model's inputs are: %s)\n", path,
              input_name, names);
      return 1;
    }
    pipe_tensor_list_get(*list, index, &(*args)[i]);
  }
  *num_args = num_inputs;
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

static void print_plan(const char *model_path, const pipe_plan *plan) {
  size_t stages = 0;
  pipe_plan_num_stages(plan, &stages);
  printf("%s: %zu stage%s\n", model_path, stages, stages == 1 ? "" : "s");
  double total = 0, slowest = 0;
  for (size_t s = 0; s < stages; ++s) {
    uint64_t bytes = 0;
    size_t params = 0, buffers = 0;
    double ms = -1;
    pipe_plan_stage_param_bytes(plan, s, &bytes);
    pipe_plan_stage_count_names(plan, s, PIPE_NAMES_PARAMETERS, &params);
    pipe_plan_stage_count_names(plan, s, PIPE_NAMES_BUFFERS, &buffers);
    pipe_plan_stage_estimated_ms(plan, s, &ms);
    printf("  stage %zu: %zu parameters, %zu buffers, %.2f MiB", s, params, buffers,
           (double)bytes / (1024.0 * 1024.0));
    if (ms >= 0) {
      printf(", %.3f ms", ms);
      total += ms;
      slowest = ms > slowest ? ms : slowest;
    }
    printf("\n");
    print_names(plan, s, PIPE_NAMES_PARAMETERS, "parameters");
    print_names(plan, s, PIPE_NAMES_BUFFERS, "buffers");
  }
  if (slowest > 0) printf("  balance: %.3f (sum of stage times / (stages x slowest))\n", total / ((double)stages * slowest));
}

static int cmd_inspect(int argc, char **argv) {
  if (argc != 1 || argv[0][0] == '-') return usage_error("inspect takes exactly one MODEL");
  pipe_model *model = NULL;
  pipe_status st = pipe_model_load(argv[0], &model);
  if (st != PIPE_OK) return fail("cannot load model", st);
  size_t count = 0;
  pipe_model_num_modules(model, &count);
  printf("%-48s %-24s %14s %12s\n", "module", "type", "parameters", "MiB");
  for (size_t i = 0; i < count; ++i) {
    const char *path = NULL, *type = NULL;
    int32_t depth = 0;
    uint64_t params = 0, bytes = 0;
    pipe_model_module(model, i, &path, &type, &depth, &params, &bytes);
    const char *leaf = strrchr(path, '.');
    leaf = depth == 0 ? "(model)" : leaf ? leaf + 1 : path;
    char label[256];
    snprintf(label, sizeof label, "%*s%s", 2 * depth, "", leaf);
    printf("%-48s %-24s %14llu %12.3f\n", label, type, (unsigned long long)params, (double)bytes / (1024.0 * 1024.0));
  }
  pipe_model_destroy(model);
  return 0;
}

static int cmd_split(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL, *save_dir = NULL;
  split_args split = SPLIT_ARGS_INIT;
  int json = 0;
  int32_t only_stage = -1;
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--input") == 0 || strcmp(a, "--save-stages") == 0) {
      if (i + 1 >= argc) return usage_error("split: %s needs a value", a);
      *(strcmp(a, "--input") == 0 ? &in_path : &save_dir) = argv[++i];
    } else if (strcmp(a, "--stage") == 0) {
      if (i + 1 >= argc) return usage_error("split: --stage needs a value");
      if (parse_int(a, argv[++i], &only_stage) != 0) return 2;
    } else if (a[0] == '-') {
      return usage_error("split: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("split: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("split: MODEL is required");
  if (check_split_args("split", &split)) return 2;

  int rc = 1;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_tensor_list *in = NULL;
  const DLManagedTensor **args = NULL;
  size_t num_args = 0;
  pipe_status st = pipe_model_load(model_path, &model);
  if (st != PIPE_OK) {
    fail("cannot load model", st);
    goto done;
  }
  if (in_path && read_inputs(model, in_path, &in, &args, &num_args) != 0) goto done;
  if (make_plan(model, &split, args, num_args, &plan) != 0) goto done;
  if (json) {
    const char *text = NULL;
    pipe_plan_describe(plan, &text);
    printf("%s\n", text);
  } else {
    print_plan(model_path, plan);
  }
  if (save_dir) {
    size_t stages = 0;
    pipe_plan_num_stages(plan, &stages);
    if (only_stage >= (int32_t)stages) {
      fprintf(stderr, "pipe: error: --stage %d but the plan has %zu stages\n", only_stage, stages);
      goto done;
    }
    size_t saved = 0;
    for (size_t s = 0; s < stages; ++s) {
      if (only_stage >= 0 && (size_t)only_stage != s) continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/stage%zu.pt", save_dir, s);
      if ((st = pipe_plan_save_stage(plan, s, &split.weights, path)) != PIPE_OK) {
        fail("cannot save stage", st);
        goto done;
      }
      ++saved;
    }
    fprintf(stderr, "pipe: saved %zu stage%s to %s/stage<i>.pt\n", saved, saved == 1 ? "" : "s", save_dir);
  }
  rc = 0;
done:
  free(args);
  pipe_tensor_list_destroy(in);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return rc;
}

/* A model loaded, its inputs read, cut as SPLIT says, and a session started: what run and bench
 * share. */
#define MAX_PROCESSES 256
typedef struct {
  pipe_model *model;
  pipe_plan *plan;
  pipe_session *session;
  pipe_tensor_list *in;
  const DLManagedTensor **args;
  size_t num_args;
  pid_t workers[MAX_PROCESSES]; /* local workers started for --processes */
  int num_workers;
  int32_t comm_timeout_ms;
} pipeline;

/* A free TCP port on the loopback interface for the store of local workers. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

/* Starts `pipe worker` for ranks 1..N-1 (this same executable). Each dies with this process
 * (PR_SET_PDEATHSIG), so no worker outlives a driver that crashed. Their stderr is discarded:
 * what goes wrong in a worker reaches the driver's calls, and this process reports it once. */
static int start_workers(pipeline *p, const session_args *s) {
  char rank[16], world[16], timeout[16];
  snprintf(world, sizeof world, "%d", s->processes);
  snprintf(timeout, sizeof timeout, "%d", s->options.comm_timeout_ms > 0 ? s->options.comm_timeout_ms : 60000);
  for (int r = 1; r < s->processes; ++r) {
    snprintf(rank, sizeof rank, "%d", r);
    char *argv[] = {"pipe", "worker", "--rank", rank, "--world-size", world, "--store", (char *)s->options.store,
                    "--comm-timeout-ms", timeout, NULL};
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "pipe: error: cannot start worker %d: %s\n", r, strerror(errno));
      return 1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      int devnull = open("/dev/null", O_WRONLY);
      if (devnull >= 0) dup2(devnull, STDERR_FILENO);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
    p->workers[p->num_workers++] = pid;
  }
  return 0;
}

/* Waits for the local workers to finish (a destroyed session ends them), and kills any that
 * are still there after the comm timeout. */
static void reap_workers(pipeline *p, int kill_now) {
  double deadline = now_ms() + (p->comm_timeout_ms > 0 ? p->comm_timeout_ms : 60000);
  for (int i = 0; i < p->num_workers; ++i) {
    if (kill_now) kill(p->workers[i], SIGKILL);
    while (waitpid(p->workers[i], NULL, WNOHANG) == 0) {
      if (now_ms() > deadline) {
        kill(p->workers[i], SIGKILL);
        waitpid(p->workers[i], NULL, 0);
        break;
      }
      usleep(10000);
    }
  }
  p->num_workers = 0;
}

static void close_pipeline(pipeline *p) {
  free(p->args);
  pipe_tensor_list_destroy(p->in);
  /* A session that works tells its workers to finish; a broken one cannot. */
  int broken = p->session && pipe_session_check(p->session) != PIPE_OK;
  pipe_session_destroy(p->session);
  reap_workers(p, broken || !p->session);
  pipe_plan_destroy(p->plan);
  pipe_model_destroy(p->model);
  memset(p, 0, sizeof *p);
}

/* Returns 0, or 1 after reporting the error (and closing what was opened). */
static int open_pipeline(pipeline *p, const char *model_path, const char *in_path, const split_args *split,
                         session_args *s) {
  memset(p, 0, sizeof *p);
  p->comm_timeout_ms = s->options.comm_timeout_ms;
  pipe_status st = pipe_model_load(model_path, &p->model);
  if (st != PIPE_OK) {
    fail("cannot load model", st);
    return 1;
  }
  if (read_inputs(p->model, in_path, &p->in, &p->args, &p->num_args) != 0) goto failed;
  /* Policy time measures the model on the inputs being run. */
  int timed = split->policy && strcmp(split->policy, "time") == 0;
  if (make_plan(p->model, split, timed ? p->args : NULL, p->num_args, &p->plan) != 0) goto failed;
  if (s->processes > 1) {
    size_t stages = 0;
    pipe_plan_num_stages(p->plan, &stages);
    if (stages < (size_t)s->processes) {
      fprintf(stderr, "pipe: error: --processes %d: the plan has only %zu stage%s and every process hosts at least "
              "one; use at most %zu processes or cut more stages\n", s->processes, stages, stages == 1 ? "" : "s", stages);
      goto failed;
    }
    if (!s->options.store) {
      int port = free_port();
      if (port < 0) {
        fprintf(stderr, "pipe: error: cannot find a free port for the workers' rendezvous: %s\n", strerror(errno));
        goto failed;
      }
      snprintf(s->store, sizeof s->store, "127.0.0.1:%d", port);
      s->options.store = s->store;
    }
    if (start_workers(p, s) != 0) goto failed;
  }
  pipe_session_options with_weights = s->options;
  with_weights.stage_options = &split->weights;
  if ((st = pipe_session_create(p->plan, &with_weights, &p->session)) != PIPE_OK) {
    fail("cannot create session", st);
    goto failed;
  }
  return 0;
failed:
  close_pipeline(p);
  return 1;
}

static int cmd_run(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL, *out_path = NULL, *trace_path = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args session;
  init_session_args(&session);
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "run", &session);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--input") == 0 || strcmp(a, "--output") == 0 || strcmp(a, "--trace") == 0) {
      if (i + 1 >= argc) return usage_error("run: %s needs a value", a);
      const char *v = argv[++i];
      if (strcmp(a, "--input") == 0) in_path = v;
      else if (strcmp(a, "--output") == 0) out_path = v;
      else trace_path = v;
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
  if (check_split_args("run", &split) || check_session_args("run", &session)) return 2;

  int rc = 1;
  pipeline p;
  pipe_tensor_list *out = NULL;
  pipe_status st;
  if (open_pipeline(&p, model_path, in_path, &split, &session) != 0) return 1;
  if (trace_path && (st = pipe_session_trace_start(p.session)) != PIPE_OK) {
    fail("cannot start the trace", st);
    goto done;
  }
  double start = now_ms();
  if ((st = pipe_session_run(p.session, p.args, p.num_args, NULL, &out)) != PIPE_OK) {
    fail("run failed", st);
    goto done;
  }
  double elapsed = now_ms() - start;
  if (trace_path && (st = pipe_session_trace_stop(p.session, trace_path)) != PIPE_OK) {
    fail("cannot write the trace", st);
    goto done;
  }
  if ((st = pipe_safetensors_write(out, out_path)) != PIPE_OK) {
    fail("cannot write outputs", st);
    goto done;
  }
  size_t num_outputs = 0, stages = 0;
  pipe_tensor_list_size(out, &num_outputs);
  pipe_plan_num_stages(p.plan, &stages);
  printf("pipe: ran %s as %zu stage%s in %.1f ms; wrote %zu output%s to %s\n", model_path, stages,
         stages == 1 ? "" : "s", elapsed, num_outputs, num_outputs == 1 ? "" : "s", out_path);
  rc = 0;

done:
  pipe_tensor_list_destroy(out);
  close_pipeline(&p);
  return rc;
}

/* ---- bench ---- */

typedef struct {
  pipe_session *session;
  const DLManagedTensor **args;
  size_t num_args;
  int total;          /* requests to run */
  int next;           /* next request index, under lock */
  double *latency_ms; /* per request */
  pthread_mutex_t lock;
  pipe_status failure;
  char message[512];
} bench_state;

static void *bench_worker(void *arg) {
  bench_state *b = arg;
  for (;;) {
    pthread_mutex_lock(&b->lock);
    int i = b->failure == PIPE_OK && b->next < b->total ? b->next++ : -1;
    pthread_mutex_unlock(&b->lock);
    if (i < 0) return NULL;
    pipe_tensor_list *out = NULL;
    double t0 = now_ms();
    pipe_status st = pipe_session_run(b->session, b->args, b->num_args, NULL, &out);
    b->latency_ms[i] = now_ms() - t0;
    pipe_tensor_list_destroy(out);
    if (st != PIPE_OK) {
      pthread_mutex_lock(&b->lock);
      if (b->failure == PIPE_OK) {
        b->failure = st;
        snprintf(b->message, sizeof b->message, "%s", pipe_last_error());
      }
      pthread_mutex_unlock(&b->lock);
    }
  }
}

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double percentile(const double *sorted, int n, double p) {
  int i = (int)(p / 100.0 * (n - 1) + 0.5);
  return sorted[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* Runs `count` requests from `threads` threads; fills latencies; returns wall ms or -1. */
static double bench_round(bench_state *b, int count, int threads) {
  b->total = count;
  b->next = 0;
  pthread_t *ids = calloc((size_t)threads, sizeof *ids);
  if (!ids) return -1;
  double start = now_ms();
  for (int t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, bench_worker, b);
  for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
  double wall = now_ms() - start;
  free(ids);
  return b->failure == PIPE_OK ? wall : -1;
}

static int cmd_bench(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args sargs;
  init_session_args(&sargs);
  pipe_session_options *options = &sargs.options;
  int32_t requests = 100, concurrency = 2;
  int json = 0;
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "bench", &sargs);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--input") == 0 || strcmp(a, "--requests") == 0 || strcmp(a, "--concurrency") == 0 ||
               strcmp(a, "--threads-per-stage") == 0) {
      if (i + 1 >= argc) return usage_error("bench: %s needs a value", a);
      const char *v = argv[++i];
      if (strcmp(a, "--input") == 0) in_path = v;
      else if (parse_int(a, v, strcmp(a, "--requests") == 0      ? &requests
                                 : strcmp(a, "--concurrency") == 0 ? &concurrency
                                                                   : &options->threads_per_stage) != 0)
        return 2;
    } else if (a[0] == '-') {
      return usage_error("bench: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("bench: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("bench: MODEL is required");
  if (!in_path) return usage_error("bench: --input IN.safetensors is required");
  if (requests < 1) return usage_error("bench: --requests must be at least 1");
  if (concurrency < 1) return usage_error("bench: --concurrency must be at least 1");
  if (check_split_args("bench", &split) || check_session_args("bench", &sargs)) return 2;

  int rc = 1;
  pipeline p;
  size_t stages = 0;
  bench_state b;
  memset(&b, 0, sizeof b);
  pthread_mutex_init(&b.lock, NULL);
  if (open_pipeline(&p, model_path, in_path, &split, &sargs) != 0) {
    pthread_mutex_destroy(&b.lock);
    return 1;
  }
  pipe_session *session = p.session;
  const DLManagedTensor **args = p.args;
  size_t num_args = p.num_args;
  pipe_plan_num_stages(p.plan, &stages);
  int64_t batch = num_args > 0 && args[0]->dl_tensor.ndim > 0 ? args[0]->dl_tensor.shape[0] : 1;
  b.session = session;
  b.args = args;
  b.num_args = num_args;
  b.latency_ms = calloc((size_t)requests + (size_t)concurrency * 2, sizeof(double));
  if (!b.latency_ms) goto done;
  /* Warm-up: TorchScript optimises each stage on its first calls. */
  if (bench_round(&b, concurrency * 2 > 4 ? concurrency * 2 : 4, concurrency) < 0) {
    fprintf(stderr, "pipe: error: warm-up failed: %s [%s]\n", b.message, pipe_status_string(b.failure));
    goto done;
  }
  pipe_stage_stats *before = calloc(stages, sizeof *before);
  if (!before) goto done;
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats init = PIPE_STAGE_STATS_INIT;
    before[s] = init;
    pipe_session_stage_stats(session, s, &before[s]);
  }
  double wall = bench_round(&b, requests, concurrency);
  if (wall < 0) {
    fprintf(stderr, "pipe: error: request failed: %s [%s]\n", b.message, pipe_status_string(b.failure));
    free(before);
    goto done;
  }
  qsort(b.latency_ms, (size_t)requests, sizeof(double), compare_double);
  double rps = requests / (wall / 1e3);
  if (json) {
    printf("{\"model\": \"%s\", \"stages\": %zu, \"microbatches\": %d, \"microbatching\": \"%s\", "
           "\"requests\": %d, \"concurrency\": %d, "
           "\"batch\": %lld, \"wall_ms\": %.3f, \"requests_per_s\": %.3f, \"samples_per_s\": %.3f, "
           "\"latency_ms\": {\"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f, \"max\": %.3f}, \"stage_busy\": [",
           model_path, stages, options->num_microbatches,
           options->microbatching == PIPE_MICROBATCHING_FIXED ? "fixed" : "adaptive", requests, concurrency,
           (long long)batch, wall, rps,
           rps * (double)batch, percentile(b.latency_ms, requests, 50), percentile(b.latency_ms, requests, 90),
           percentile(b.latency_ms, requests, 99), b.latency_ms[requests - 1]);
  } else {
    printf("%s: %zu stage%s, %d micro-batches (%s), batch %lld, %d requests from %d threads\n", model_path,
           stages, stages == 1 ? "" : "s", options->num_microbatches,
           options->microbatching == PIPE_MICROBATCHING_FIXED ? "fixed" : "adaptive", (long long)batch, requests,
           concurrency);
    printf("  throughput: %.1f requests/s, %.1f samples/s\n", rps, rps * (double)batch);
    printf("  latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", percentile(b.latency_ms, requests, 50),
           percentile(b.latency_ms, requests, 90), percentile(b.latency_ms, requests, 99), b.latency_ms[requests - 1]);
  }
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats now = PIPE_STAGE_STATS_INIT;
    pipe_session_stage_stats(session, s, &now);
    double busy = (now.busy_ms - before[s].busy_ms) / wall;
    before[s].microbatches = now.microbatches - before[s].microbatches; /* run during the bench */
    if (json) printf("%s%.4f", s ? ", " : "", busy);
    else printf("  stage %zu: busy %.1f%% of the run, %llu micro-batches\n", s, 100.0 * busy,
                (unsigned long long)before[s].microbatches);
  }
  if (json) {
    printf("], \"stage_microbatches\": [");
    for (size_t s = 0; s < stages; ++s) printf("%s%llu", s ? ", " : "", (unsigned long long)before[s].microbatches);
    printf("]}\n");
  }
  free(before);
  rc = 0;
done:
  free(b.latency_ms);
  pthread_mutex_destroy(&b.lock);
  close_pipeline(&p);
  return rc;
}

/* ---- worker ---- */

static int cmd_worker(int argc, char **argv) {
  pipe_worker_options options = PIPE_WORKER_OPTIONS_INIT;
  int has_rank = 0, has_world = 0;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--rank") != 0 && strcmp(a, "--world-size") != 0 && strcmp(a, "--store") != 0 &&
        strcmp(a, "--comm-timeout-ms") != 0 && strcmp(a, "--threads") != 0)
      return usage_error(a[0] == '-' ? "worker: unknown option '%s'" : "worker: unexpected argument '%s'", a);
    if (i + 1 >= argc) return usage_error("worker: %s needs a value", a);
    const char *v = argv[++i];
    if (strcmp(a, "--store") == 0) {
      options.store = v;
    } else if (parse_int(a, v, strcmp(a, "--rank") == 0             ? &options.rank
                               : strcmp(a, "--world-size") == 0     ? &options.world_size
                               : strcmp(a, "--comm-timeout-ms") == 0 ? &options.comm_timeout_ms
                                                                     : &options.threads_per_stage) != 0) {
      return 2;
    }
    has_rank |= strcmp(a, "--rank") == 0;
    has_world |= strcmp(a, "--world-size") == 0;
  }
  if (!has_rank || !has_world || !options.store)
    return usage_error("worker: --rank R, --world-size N and --store HOST:PORT are required");
  pipe_status st = pipe_worker_run(&options);
  return st == PIPE_OK ? 0 : fail("worker failed", st);
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
  if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
  if (strcmp(cmd, "split") == 0) return cmd_split(argc - 2, argv + 2);
  if (strcmp(cmd, "run") == 0) return cmd_run(argc - 2, argv + 2);
  if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 2, argv + 2);
  if (strcmp(cmd, "worker") == 0) return cmd_worker(argc - 2, argv + 2);
  return usage_error("unknown command '%s'", cmd);
}
