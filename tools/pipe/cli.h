/* The pipe tool's internals, shared by its command files: argument parsing (args.c), the
 * pipeline that run, bench and generate open (pipeline.c), local worker processes (workers.c), and one
 * cmd_* entry point per command. Everything here is written against the public C ABI only. */
#ifndef PIPE_CLI_H
#define PIPE_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include <pipe/pipe.h>

/* ---- commands (one file each); argv starts after the command name ---- */
int cmd_inspect(int argc, char **argv);
int cmd_split(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_worker(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_chat(int argc, char **argv);

/* ---- reporting (args.c) ---- */
/* Prints "pipe: error: <message> (run 'pipe --help' for usage)" and returns 2. */
int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Reports a failed libpipe call: its status name and message on one line (line breaks in the
 * message become spaces, so scripts can rely on a single line). Returns 1. */
int fail(const char *what, pipe_status status);

/* ---- argument parsing (args.c) ---- */
/* 0 and *out set, or 2 after a usage error naming `flag`. */
int parse_int(const char *flag, const char *text, int32_t *out);
/* The same for `command`'s 64-bit integer at least `min`, a finite number, and a seed (0 .. 2^64-1):
 * 0 and *out set, or 2 after a usage error naming the command and the flag. */
int parse_int64_at_least(const char *command, const char *flag, const char *text, int64_t min, int64_t *out);
int parse_number(const char *command, const char *flag, const char *text, double *out);
int parse_seed(const char *command, const char *text, uint64_t *out);

#define MAX_SPLIT_POINTS 256

/* The SPLIT arguments shared by split, run, bench and generate, with the stage weight options. */
typedef struct {
  const char *points[MAX_SPLIT_POINTS];
  int num_points;
  int32_t stages;
  int has_stages;
  const char *policy;
  pipe_stage_options weights; /* --weights, --dtype */
} split_args;

#define SPLIT_ARGS_INIT {{0}, 0, 0, 0, NULL, PIPE_STAGE_OPTIONS_INIT}

/* Consumes argv[*i] (and its value) if it is a SPLIT argument: returns 1 if consumed, 0 if not
 * a SPLIT argument, 2 after reporting a usage error. */
int parse_split_arg(int argc, char **argv, int *i, split_args *s);
/* 2 after a usage error for a combination SPLIT does not allow, else 0. */
int check_split_args(const char *cmd, const split_args *split);

/* The session options run, bench and generate share: micro-batching (not generate), and the processes the stages are
 * spread over. */
#define MAX_REPLICATED 64

#define MAX_TOKEN_BYTES 4096

typedef struct {
  pipe_session_options options;
  int32_t processes;           /* --processes: 0 when not given */
  char token[MAX_TOKEN_BYTES]; /* --token-file's content, or the token made for --processes */
  /* Started by a launcher (torchrun, srun) with no rank flags: this rank's place (launch.c). */
  int launched;
  pipe_launch_info launch;
  /* --replicate NAME[,NAME...] (run and bench): forward arguments every micro-batch gets whole, as given on the
   * command line; open_pipeline turns them into the options' input_specs. */
  const char *replicated[MAX_REPLICATED];
  int num_replicated;
  /* chat on a terminal: the local workers ignore SIGINT, which the terminal sends to the whole foreground
   * process group when Ctrl-C stops a reply (the driver cancels the reply; the workers go on serving). */
  int workers_ignore_interrupt;
} session_args;

void init_session_args(session_args *s);
/* Same protocol as parse_split_arg: 0 when argv[*i] is not one of them, 1 when it was consumed
 * (with its value), 2 after a usage error. */
int parse_session_arg(int argc, char **argv, int *i, const char *command, session_args *s);
/* Checks the combination of process options and fills in what they imply. 2 after a usage
 * error. */
int check_session_args(const char *cmd, session_args *s);

/* ---- launchers and the session's secret (launch.c) ---- */
/* Reads a token from `path` (a trailing newline dropped) into `out`. 0, or 1 after reporting. */
int read_token_file(const char *command, const char *path, char *out, size_t capacity);
/* 64 random hex digits into `out` (at least 65 bytes). 0, or 1 after reporting. */
int fresh_token(char *out, size_t capacity);
/* With no --processes, --world-size or --store: the launcher's environment (pipe_launch_from_environment)
 * decides this process's rank, the world size and the store. 0, or 1 after reporting. */
int apply_launcher(const char *command, session_args *s);
/* A launched rank other than 0: serves its stages for rank 0's session until it ends. The exit code. */
int serve_launched_rank(const session_args *s);

/* ---- local worker processes (workers.c) ---- */
#define MAX_PROCESSES 256
typedef struct {
  pid_t pids[MAX_PROCESSES]; /* `pipe worker` processes started for --processes */
  int count;
  int32_t comm_timeout_ms; /* how long a finished session's workers get to exit */
} local_workers;

/* Starts `pipe worker` for ranks 1..N-1 of `s` (this same executable), joining the store at
 * `store` (the address it reported). 0, or 1 after reporting. */
int start_workers(local_workers *w, const session_args *s, const char *store);
/* Waits for the workers to finish (a destroyed session ends them), killing any still there after
 * the comm timeout, or all of them at once with `kill_now`. */
void reap_workers(local_workers *w, int kill_now);

/* ---- the model, plan and session behind run, bench and generate (pipeline.c) ---- */
/* Cuts `model` as SPLIT says; `examples` (may be NULL) are example inputs for timing. 0, or 1
 * after reporting. */
int make_plan(pipe_model *model, const split_args *split, const DLManagedTensor *const *examples, size_t num_examples,
              pipe_plan **plan);
/* Reads IN and lines its tensors up with the model's forward arguments in `*args` (borrowed from
 * `*list`, which the caller destroys). Every tensor in the file must be a forward argument: a
 * misspelt name is an error, not a silently ignored tensor. 0, or 1 after reporting. */
int read_inputs(const pipe_model *model, const char *path, pipe_tensor_list **list, const DLManagedTensor ***args,
                size_t *num_args);

/* A model loaded, its inputs read, cut as SPLIT says, and a session started: what run and bench
 * share; generate has no inputs and a generator that owns the session. */
typedef struct {
  pipe_model *model;
  pipe_plan *plan;
  pipe_session *session;     /* generate: borrowed from `generator` */
  pipe_generator *generator; /* generate only */
  pipe_tensor_list *in;
  const DLManagedTensor **args;
  size_t num_args;
  local_workers workers;
  pipe_chunk_spec *input_specs; /* one per forward argument when --replicate was given, else NULL */
} pipeline;

/* Returns 0, or 1 after reporting the error (and closing what was opened). */
int open_pipeline(pipeline *p, const char *model_path, const char *in_path, const split_args *split, session_args *s);
/* For generate: the model loaded and cut, and a generator created with `options` (may be NULL).
 * Returns 0, or 1 after reporting the error (and closing what was opened). */
int open_generator(pipeline *p, const char *model_path, const split_args *split, session_args *s,
                   const pipe_generator_options *options);
void close_pipeline(pipeline *p);

static inline double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#endif
