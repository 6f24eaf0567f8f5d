/* A driver for the distributed tests, written against the C ABI only (pipe/pipe.h).
 *
 * It creates a Gloo session whose store listens on 127.0.0.1:0 (a free port the store picks), learns
 * the port from libpipe's INFO log message "store listening on HOST:PORT" (pipe_set_log_callback),
 * and only then starts its worker processes with posix_spawn (the `pipe` CLI's `pipe worker`, or
 * this program's own `worker` mode, which calls pipe_worker_run), and runs one scenario.
 * tests/distributed/test_capi_distributed.py drives it and compares the outputs it writes with
 * eager PyTorch.
 *
 *   dist_driver [OPTIONS] run OUTDIR IN...
 *       One session: every IN (safetensors, one tensor per forward argument) runs in turn with
 *       pipe_session_run -> OUTDIR/seq.<i>.safetensors, then all are submitted at once (their
 *       micro-batches interleave) -> OUTDIR/async.<i>.safetensors. The session is destroyed and
 *       every worker must exit 0. Prints "store HOST:PORT", the address the store reported.
 *   dist_driver [OPTIONS] kill RANK STAGE IN OUTDIR
 *   dist_driver [OPTIONS] stop RANK STAGE IN OUTDIR
 *       The model is a gated one (tests/gate: inputs x and n, stage K waits at gate "stageK"), IN
 *       its inputs with n = 0, and STAGE the first stage that worker RANK hosts. One run
 *       (OUTDIR/before.safetensors); then calls with a gate key as n are submitted, the gates of
 *       the stages before STAGE are opened, and once a micro-batch is held in STAGE (the worker
 *       has work in hand) worker RANK gets SIGKILL (kill) or SIGSTOP (stop). Every held call must
 *       fail with PIPE_ERR_COMMUNICATION within comm_timeout_ms + margin; pipe_session_check then
 *       says PIPE_ERR_COMMUNICATION, later calls fail at once, pipe_session_destroy returns within
 *       comm_timeout_ms + margin and the surviving workers exit on their own. Then fresh workers
 *       and a new session run IN again (OUTDIR/after.safetensors).
 *   dist_driver [OPTIONS] badstore STORE STATUS
 *       pipe_session_create with store STORE (no workers) must fail with STATUS (a name such as
 *       PIPE_ERR_COMMUNICATION) within comm_timeout_ms + margin. Prints the message on stdout.
 *   dist_driver [OPTIONS] noworkers
 *       A session on 127.0.0.1:0 whose workers never come must fail with PIPE_ERR_COMMUNICATION
 *       within comm_timeout_ms + margin. Prints the message and the reported store on stdout.
 *   dist_driver worker --rank R --world-size N --store HOST:PORT [--comm-timeout-ms T]
 *       pipe_worker_run. Exit 0 on PIPE_OK; otherwise "worker: STATUS: message" on stderr, exit 1.
 *
 * OPTIONS: --pipe PATH (the `pipe` CLI for workers; "self" uses this program's worker mode)
 *          --model PATH  --split-at FQN:begin|end (repeatable)  --world-size N  --microbatches M
 *          --comm-timeout-ms T  --margin-ms T (default 10000)  --weights CKPT
 *
 * Exit status: 0 the scenario held, 1 it did not (the reason on stderr), 2 usage, 3 a call hung
 * (a watchdog noticed; every worker is killed before exiting). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <pipe/pipe.h>

#include "tests/gate/gate.h"

extern char **environ;

#define MAX_WORKERS 16
#define MAX_SPLITS 16
#define MAX_INPUTS 64
#define HELD_CALLS 2

/* ---- options ------------------------------------------------------------------------------- */

static const char *g_pipe = "self";
static const char *g_model;
static const char *g_splits[MAX_SPLITS];
static int g_num_splits;
static int g_world = 2;
static int g_microbatches = 2;
static int g_comm_timeout_ms = 4000;
static int g_margin_ms = 10000;
static const char *g_weights;
static char g_self[4096];

/* ---- workers ------------------------------------------------------------------------------- */

static pid_t g_workers[MAX_WORKERS]; /* index rank-1; 0 once reaped */
static int g_num_workers;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dist_driver: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
}

/* Kill every worker still running (SIGCONT too, in case one is stopped). Async-signal-safe. */
static void kill_workers(void) {
  for (int i = 0; i < g_num_workers; ++i) {
    if (g_workers[i] > 0) {
      kill(g_workers[i], SIGKILL);
      kill(g_workers[i], SIGCONT);
    }
  }
}

static void reap_all_killed(void) {
  kill_workers();
  for (int i = 0; i < g_num_workers; ++i) {
    if (g_workers[i] > 0) {
      waitpid(g_workers[i], NULL, 0);
      g_workers[i] = 0;
    }
  }
}

static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dist_driver: FAIL: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
  reap_all_killed();
  return 1;
}

/* ---- watchdog: a blocking step that overruns its deadline ends the process ------------------- */

static pthread_mutex_t g_wd_mu = PTHREAD_MUTEX_INITIALIZER;
static double g_wd_deadline; /* 0: disarmed */
static char g_wd_what[256];

static void watchdog_arm(double ms_from_now, const char *what) {
  pthread_mutex_lock(&g_wd_mu);
  g_wd_deadline = now_ms() + ms_from_now;
  snprintf(g_wd_what, sizeof g_wd_what, "%s", what);
  pthread_mutex_unlock(&g_wd_mu);
}

static void watchdog_disarm(void) {
  pthread_mutex_lock(&g_wd_mu);
  g_wd_deadline = 0;
  pthread_mutex_unlock(&g_wd_mu);
}

static void *watchdog_main(void *arg) {
  (void)arg;
  for (;;) {
    usleep(50 * 1000);
    pthread_mutex_lock(&g_wd_mu);
    int fired = g_wd_deadline > 0 && now_ms() > g_wd_deadline;
    pthread_mutex_unlock(&g_wd_mu);
    if (fired) {
      fprintf(stderr, "dist_driver: HANG: %s did not return in time\n", g_wd_what);
      fflush(stderr);
      kill_workers();
      _exit(3);
    }
  }
  return NULL;
}

static void on_fatal_signal(int sig) {
  kill_workers();
  signal(sig, SIG_DFL);
  raise(sig);
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* Starts the workers for the store at `store` (as libpipe reported it). */
static int spawn_workers(const char *store) {
  const char *exe = strcmp(g_pipe, "self") == 0 ? g_self : g_pipe;
  char world[16], timeout[16];
  snprintf(world, sizeof world, "%d", g_world);
  snprintf(timeout, sizeof timeout, "%d", g_comm_timeout_ms);
  g_num_workers = g_world - 1;
  for (int rank = 1; rank < g_world; ++rank) {
    char rank_s[16];
    snprintf(rank_s, sizeof rank_s, "%d", rank);
    char *argv[] = {(char *)exe,         "worker", "--rank", rank_s, "--world-size", world, "--store", (char *)store,
                    "--comm-timeout-ms", timeout,  NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, exe, NULL, NULL, argv, environ);
    if (rc != 0) {
      say("posix_spawn %s: %s", exe, strerror(rc));
      return 1;
    }
    g_workers[rank - 1] = pid;
  }
  say("started %d workers (%s) for store %s", g_num_workers, exe, store);
  return 0;
}

/* ---- the store's address, from libpipe's log ---------------------------------------------------- */

/* pipe.h (the store option): as soon as the store listens, before waiting for workers, libpipe logs
 * at PIPE_LOG_INFO exactly "store listening on HOST:PORT" with the port it got. The workers are
 * started from there, on the thread creating the session (it does not call back into libpipe). */
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_spawn_on_listen; /* start_session waits for the address */
static int g_spawn_failed;
static char g_store[128]; /* the address the last store reported */

static void on_log(void *user_data, int32_t level, const char *message) {
  (void)user_data;
  static const char listening[] = "store listening on ";
  fprintf(stderr, "dist_driver: libpipe log %d: %s\n", (int)level, message);
  if (strncmp(message, listening, sizeof listening - 1) != 0) return;
  pthread_mutex_lock(&g_log_mu);
  if (level != PIPE_LOG_INFO) say("FAIL: the store's address came at log level %d, not PIPE_LOG_INFO", (int)level);
  snprintf(g_store, sizeof g_store, "%s", message + sizeof listening - 1);
  if (g_spawn_on_listen) {
    g_spawn_on_listen = 0;
    g_spawn_failed = level != PIPE_LOG_INFO || spawn_workers(g_store) != 0;
  }
  pthread_mutex_unlock(&g_log_mu);
}

/* 1 when `store` is 127.0.0.1:PORT with a port the store got (not 0). */
static int picked_port(const char *store) {
  static const char host[] = "127.0.0.1:";
  if (strncmp(store, host, sizeof host - 1) != 0) return 0;
  char *end = NULL;
  long port = strtol(store + sizeof host - 1, &end, 10);
  return end && *end == '\0' && port >= 1 && port <= 65535;
}

/* Wait until every worker but `skip_rank` has exited by itself, at most `ms`. Returns 0 when all
 * did and, if `want_zero`, all exited 0. Workers still running afterwards are killed (a failure). */
static int wait_workers(double ms, int want_zero, int skip_rank, const char *when) {
  double deadline = now_ms() + ms;
  int bad = 0;
  for (int i = 0; i < g_num_workers; ++i) {
    if (g_workers[i] <= 0 || i + 1 == skip_rank) continue;
    int status = 0;
    pid_t r;
    while ((r = waitpid(g_workers[i], &status, WNOHANG)) == 0 && now_ms() < deadline) usleep(20 * 1000);
    if (r == 0) {
      say("worker rank %d (pid %d) still running %.0f ms %s", i + 1, (int)g_workers[i], ms, when);
      bad = 1;
      continue;
    }
    g_workers[i] = 0;
    if (WIFEXITED(status)) {
      say("worker rank %d exited with %d %s", i + 1, WEXITSTATUS(status), when);
      if (want_zero && WEXITSTATUS(status) != 0) bad = 1;
    } else {
      say("worker rank %d died of signal %d %s", i + 1, WIFSIGNALED(status) ? WTERMSIG(status) : -1, when);
      bad = 1;
    }
  }
  return bad;
}

typedef struct inputs {
  pipe_tensor_list *list;
  const DLManagedTensor *tensors[16];
  size_t count;
} inputs;

/* Reads IN and orders its tensors as the model's forward arguments. */
static int read_inputs(const pipe_model *model, const char *path, inputs *in) {
  memset(in, 0, sizeof *in);
  pipe_status st = pipe_safetensors_read(path, &in->list);
  if (st != PIPE_OK) return fail("reading %s: %s: %s", path, pipe_status_string(st), pipe_last_error());
  size_t n = 0;
  if (pipe_model_num_inputs(model, &n) != PIPE_OK) return fail("pipe_model_num_inputs: %s", pipe_last_error());
  if (n > 16) return fail("too many inputs");
  for (size_t i = 0; i < n; ++i) {
    const char *name = NULL;
    size_t index = 0;
    if (pipe_model_input_name(model, i, &name) != PIPE_OK) return fail("pipe_model_input_name: %s", pipe_last_error());
    if (pipe_tensor_list_find(in->list, name, &index) != PIPE_OK) return fail("%s has no tensor '%s'", path, name);
    if (pipe_tensor_list_get(in->list, index, &in->tensors[i]) != PIPE_OK)
      return fail("%s: %s", path, pipe_last_error());
  }
  in->count = n;
  return 0;
}

static int write_outputs(pipe_tensor_list *out, const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  pipe_status st = pipe_safetensors_write(out, path);
  if (st != PIPE_OK) return fail("writing %s: %s: %s", path, pipe_status_string(st), pipe_last_error());
  return 0;
}

static pipe_model *g_model_h;
static pipe_plan *g_plan;
static pipe_stage_options g_stage_opts = PIPE_STAGE_OPTIONS_INIT;

static int load_plan(void) {
  if (!g_model) return fail("--model is required");
  pipe_status st = pipe_model_load(g_model, &g_model_h);
  if (st != PIPE_OK) return fail("pipe_model_load: %s: %s", pipe_status_string(st), pipe_last_error());
  pipe_plan_options *po = NULL;
  if (pipe_plan_options_create(&po) != PIPE_OK) return fail("pipe_plan_options_create: %s", pipe_last_error());
  for (int i = 0; i < g_num_splits; ++i) {
    st = pipe_plan_options_add_split_point(po, g_splits[i]);
    if (st != PIPE_OK) return fail("split point %s: %s", g_splits[i], pipe_last_error());
  }
  st = pipe_plan_create(g_model_h, po, &g_plan);
  pipe_plan_options_destroy(po);
  if (st != PIPE_OK) return fail("pipe_plan_create: %s: %s", pipe_status_string(st), pipe_last_error());
  size_t stages = 0;
  if (pipe_plan_num_stages(g_plan, &stages) != PIPE_OK) return fail("pipe_plan_num_stages: %s", pipe_last_error());
  say("%s: %zu stages over %d processes", g_model, stages, g_world);
  return 0;
}

static pipe_session_options session_options(const char *store) {
  pipe_session_options o = PIPE_SESSION_OPTIONS_INIT;
  o.num_microbatches = g_microbatches;
  o.transport = PIPE_TRANSPORT_GLOO;
  o.world_size = g_world;
  o.store = store;
  o.comm_timeout_ms = g_comm_timeout_ms;
  if (g_weights) {
    g_stage_opts.weights = g_weights;
    o.stage_options = &g_stage_opts;
  }
  return o;
}

/* Create a session on a free port; its workers start once its store reports the port it got. */
static int start_session(pipe_session **session) {
  pthread_mutex_lock(&g_log_mu);
  g_spawn_on_listen = 1;
  g_spawn_failed = 0;
  g_store[0] = '\0';
  pthread_mutex_unlock(&g_log_mu);
  pipe_session_options o = session_options("127.0.0.1:0");
  watchdog_arm(g_comm_timeout_ms + g_margin_ms + 30000.0, "pipe_session_create");
  double t0 = now_ms();
  pipe_status st = pipe_session_create(g_plan, &o, session);
  watchdog_disarm();
  pthread_mutex_lock(&g_log_mu);
  int never_listened = g_spawn_on_listen, spawn_failed = g_spawn_failed;
  g_spawn_on_listen = 0;
  pthread_mutex_unlock(&g_log_mu);
  if (never_listened) return fail("the store never reported its address (\"store listening on HOST:PORT\")");
  if (spawn_failed) return fail("the workers could not be started for the store %s", g_store);
  if (!picked_port(g_store)) return fail("the store reported '%s', not 127.0.0.1 with the port it got", g_store);
  if (st != PIPE_OK) return fail("pipe_session_create: %s: %s", pipe_status_string(st), pipe_last_error());
  say("session created in %.0f ms", now_ms() - t0);
  return 0;
}

static int run_once(pipe_session *s, const inputs *in, const char *dir, const char *name) {
  pipe_tensor_list *out = NULL;
  watchdog_arm(120000.0, "pipe_session_run");
  pipe_status st = pipe_session_run(s, in->tensors, in->count, NULL, &out);
  watchdog_disarm();
  if (st != PIPE_OK) return fail("pipe_session_run (%s): %s: %s", name, pipe_status_string(st), pipe_last_error());
  int rc = write_outputs(out, dir, name);
  pipe_tensor_list_destroy(out);
  return rc;
}

/* Destroy a healthy session; every worker must then exit 0. */
static int finish_session(pipe_session *s) {
  watchdog_arm(g_comm_timeout_ms + g_margin_ms, "pipe_session_destroy");
  pipe_session_destroy(s);
  watchdog_disarm();
  if (wait_workers(g_comm_timeout_ms + g_margin_ms, 1, 0, "after pipe_session_destroy"))
    return fail("workers did not all exit 0 after the session was destroyed");
  return 0;
}

/* ---- run: several inputs (batch sizes, sequence lengths) through one session ------------------ */

static int mode_run(int argc, char **argv) {
  if (argc < 2) return fail("run needs OUTDIR IN...");
  const char *dir = argv[0];
  int n = argc - 1;
  if (n > MAX_INPUTS) return fail("too many inputs");
  if (load_plan()) return 1;
  static inputs ins[MAX_INPUTS];
  for (int i = 0; i < n; ++i)
    if (read_inputs(g_model_h, argv[1 + i], &ins[i])) return 1;
  pipe_session *s = NULL;
  if (start_session(&s)) return 1;
  char name[64];
  for (int i = 0; i < n; ++i) {
    snprintf(name, sizeof name, "seq.%d.safetensors", i);
    if (run_once(s, &ins[i], dir, name)) return 1;
  }
  /* All at once: different shapes in flight together. */
  static pipe_request *reqs[MAX_INPUTS];
  for (int i = 0; i < n; ++i) {
    pipe_status st = pipe_session_submit(s, ins[i].tensors, ins[i].count, NULL, &reqs[i]);
    if (st != PIPE_OK) return fail("pipe_session_submit %d: %s: %s", i, pipe_status_string(st), pipe_last_error());
  }
  for (int i = 0; i < n; ++i) {
    pipe_tensor_list *out = NULL;
    pipe_status st = pipe_request_wait(reqs[i], 120000, &out);
    if (st != PIPE_OK) return fail("pipe_request_wait %d: %s: %s", i, pipe_status_string(st), pipe_last_error());
    snprintf(name, sizeof name, "async.%d.safetensors", i);
    if (write_outputs(out, dir, name)) return 1;
    pipe_tensor_list_destroy(out);
    pipe_request_destroy(reqs[i]);
  }
  size_t stages = 0;
  if (pipe_session_num_stages(s, &stages) != PIPE_OK) return fail("pipe_session_num_stages: %s", pipe_last_error());
  if (pipe_session_check(s) != PIPE_OK) return fail("pipe_session_check on a healthy session: %s", pipe_last_error());
  char store[sizeof g_store];
  snprintf(store, sizeof store, "%s", g_store);
  if (finish_session(s)) return 1;
  for (int i = 0; i < n; ++i) pipe_tensor_list_destroy(ins[i].list);
  pipe_plan_destroy(g_plan);
  pipe_model_destroy(g_model_h);
  printf("store %s\n", store);
  printf("ok: %d inputs, %zu stages, %d processes\n", n, stages, g_world);
  return 0;
}

/* ---- kill / stop: a worker fails while it holds work ------------------------------------------ */

/* The gate folder gate_init made for this process (and its workers), removed on the way out. */
static void remove_gate_dir(void) {
  const char *dir = getenv("LIBPIPE_TEST_GATE_DIR");
  DIR *d = dir ? opendir(dir) : NULL;
  if (!d) return;
  char path[4096];
  for (struct dirent *e; (e = readdir(d));) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

/* The scheduler state of process `pid` ('T' once a SIGSTOP took effect), or 0 if it is gone. */
static char process_state(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  char *close = strrchr(buf, ')');
  return close && close[1] == ' ' ? close[2] : 0;
}

static int mode_fault(int sig, int argc, char **argv) {
  if (argc != 4) return fail("kill/stop need RANK STAGE IN OUTDIR");
  int rank = atoi(argv[0]), stage = atoi(argv[1]);
  const char *in_path = argv[2], *dir = argv[3];
  if (rank < 1 || rank >= g_world) return fail("RANK must be 1 .. world_size-1");
  const char *what = sig == SIGKILL ? "killed" : "stopped";
  if (load_plan()) return 1;
  inputs in;
  if (read_inputs(g_model_h, in_path, &in)) return 1;
  size_t n_index = 0, num_inputs = 0;
  if (pipe_model_num_inputs(g_model_h, &num_inputs) != PIPE_OK)
    return fail("pipe_model_num_inputs: %s", pipe_last_error());
  for (const char *name = NULL; n_index < num_inputs; ++n_index) {
    if (pipe_model_input_name(g_model_h, n_index, &name) != PIPE_OK) return fail("%s", pipe_last_error());
    if (strcmp(name, "n") == 0) break;
  }
  if (n_index == num_inputs) return fail("%s is not a gated model: it has no input n", g_model);
  pipe_session *s = NULL;
  if (start_session(&s)) return 1;
  if (run_once(s, &in, dir, "before.safetensors")) return 1;

  /* Calls whose gate key is n: held in every stage until the gate opens. */
  int64_t key = gate_new_key();
  int64_t shape_none = 0;
  DLManagedTensor key_tensor;
  memset(&key_tensor, 0, sizeof key_tensor);
  key_tensor.dl_tensor.data = &key;
  key_tensor.dl_tensor.device.device_type = kDLCPU;
  key_tensor.dl_tensor.ndim = 0;
  key_tensor.dl_tensor.shape = &shape_none;
  key_tensor.dl_tensor.dtype.code = kDLInt;
  key_tensor.dl_tensor.dtype.bits = 64;
  key_tensor.dl_tensor.dtype.lanes = 1;
  inputs held = in;
  held.tensors[n_index] = &key_tensor;
  pipe_request *reqs[HELD_CALLS];
  for (int i = 0; i < HELD_CALLS; ++i) {
    pipe_status st = pipe_session_submit(s, held.tensors, held.count, NULL, &reqs[i]);
    if (st != PIPE_OK) return fail("pipe_session_submit: %s: %s", pipe_status_string(st), pipe_last_error());
  }
  char gate_name[32];
  for (int k = 0; k < stage; ++k) {
    snprintf(gate_name, sizeof gate_name, "stage%d", k);
    gate_open(key, gate_name);
  }
  snprintf(gate_name, sizeof gate_name, "stage%d", stage);
  if (!gate_wait(key, gate_name, "arrived", 1)) return fail("no call reached %s of worker rank %d", gate_name, rank);

  pid_t victim = g_workers[rank - 1];
  double t_fault = now_ms();
  kill(victim, sig);
  say("worker rank %d (pid %d) %s while it holds a call in %s", rank, (int)victim, what, gate_name);
  if (sig == SIGKILL) {
    waitpid(victim, NULL, 0);
    g_workers[rank - 1] = 0;
  } else {
    watchdog_arm(g_margin_ms, "the worker's stop");
    while (process_state(victim) != 'T') usleep(1000);
    watchdog_disarm();
  }
  /* The fault has landed: the survivors may finish what they hold (the victim cannot). */
  gate_open(key, NULL);

  /* Every held call must fail with PIPE_ERR_COMMUNICATION within comm_timeout + margin. */
  double limit = g_comm_timeout_ms + g_margin_ms;
  double worst = 0;
  char message[1024] = "";
  for (int i = 0; i < HELD_CALLS; ++i) {
    pipe_tensor_list *out = NULL;
    watchdog_arm(limit + 1000.0, "pipe_request_wait after the worker was stopped/killed");
    pipe_status st = pipe_request_wait(reqs[i], (int64_t)limit, &out);
    watchdog_disarm();
    if (st != PIPE_ERR_COMMUNICATION)
      return fail("a call held when the worker was %s returned %s (%s), not PIPE_ERR_COMMUNICATION", what,
                  pipe_status_string(st), pipe_last_error());
    if (!pipe_last_error()[0]) return fail("PIPE_ERR_COMMUNICATION without a message");
    if (!message[0]) snprintf(message, sizeof message, "%s", pipe_last_error());
    if (now_ms() - t_fault > worst) worst = now_ms() - t_fault;
    pipe_request_destroy(reqs[i]);
  }
  say("calls failed with PIPE_ERR_COMMUNICATION %.0f ms after the worker was %s: %s", worst, what, message);
  printf("failed_after_ms %.0f\n", worst);
  printf("message %s\n", message);

  /* The session says it is broken, and stays so. */
  pipe_status chk = pipe_session_check(s);
  if (chk != PIPE_ERR_COMMUNICATION)
    return fail("pipe_session_check returned %s, not PIPE_ERR_COMMUNICATION", pipe_status_string(chk));
  if (!pipe_last_error()[0]) return fail("pipe_session_check: no message");
  say("pipe_session_check: %s", pipe_last_error());
  watchdog_arm(g_margin_ms, "pipe_session_run on a broken session");
  pipe_tensor_list *out = NULL;
  pipe_status again = pipe_session_run(s, in.tensors, in.count, NULL, &out);
  watchdog_disarm();
  if (again != PIPE_ERR_COMMUNICATION)
    return fail("pipe_session_run on a broken session returned %s, not PIPE_ERR_COMMUNICATION",
                pipe_status_string(again));
  pipe_request *req = NULL;
  pipe_status sub = pipe_session_submit(s, in.tensors, in.count, NULL, &req);
  if (sub == PIPE_OK) {
    sub = pipe_request_wait(req, g_margin_ms, &out);
    pipe_request_destroy(req);
    if (sub == PIPE_ERR_TIMEOUT) return fail("a call submitted to a broken session is still running");
  }
  if (sub != PIPE_ERR_COMMUNICATION)
    return fail("pipe_session_submit on a broken session gave %s, not PIPE_ERR_COMMUNICATION", pipe_status_string(sub));

  /* Destroy returns promptly, even with a stopped worker. */
  double t0 = now_ms();
  watchdog_arm(limit, "pipe_session_destroy of a broken session");
  pipe_session_destroy(s);
  watchdog_disarm();
  say("broken session destroyed in %.0f ms", now_ms() - t0);
  printf("destroy_ms %.0f\n", now_ms() - t0);

  /* The other workers notice and exit by themselves (non-zero is expected). */
  if (wait_workers(limit, 0, sig == SIGSTOP ? rank : 0, "after the broken session was destroyed"))
    return fail("surviving workers did not exit after the broken session was destroyed");
  if (sig == SIGSTOP) { /* now the stopped one */
    kill(victim, SIGKILL);
    kill(victim, SIGCONT);
    waitpid(victim, NULL, 0);
    g_workers[rank - 1] = 0;
  }

  /* Fresh workers, a new session, and it works. */
  if (start_session(&s)) return 1;
  if (pipe_session_check(s) != PIPE_OK) return fail("pipe_session_check on the new session: %s", pipe_last_error());
  if (run_once(s, &in, dir, "after.safetensors")) return 1;
  if (finish_session(s)) return 1;
  pipe_tensor_list_destroy(in.list);
  pipe_plan_destroy(g_plan);
  pipe_model_destroy(g_model_h);
  printf("ok\n");
  return 0;
}

/* ---- session creation that must fail ------------------------------------------------------------- */

static int expect_create_failure(const char *store, const char *want) {
  if (load_plan()) return 1;
  pipe_session_options o = session_options(store);
  pipe_session *s = NULL;
  double t0 = now_ms();
  watchdog_arm(g_comm_timeout_ms + g_margin_ms, "pipe_session_create");
  pipe_status st = pipe_session_create(g_plan, &o, &s);
  watchdog_disarm();
  double took = now_ms() - t0;
  if (st == PIPE_OK) {
    pipe_session_destroy(s);
    return fail("pipe_session_create with store '%s' succeeded", store);
  }
  if (s != NULL) return fail("pipe_session_create wrote *session on failure");
  printf("status %s\n", pipe_status_string(st));
  printf("message %s\n", pipe_last_error());
  printf("took_ms %.0f\n", took);
  if (g_store[0]) printf("store %s\n", g_store);
  if (strcmp(pipe_status_string(st), want) != 0)
    return fail("pipe_session_create with store '%s' returned %s (%s), not %s", store, pipe_status_string(st),
                pipe_last_error(), want);
  if (!pipe_last_error()[0]) return fail("no message");
  pipe_plan_destroy(g_plan);
  pipe_model_destroy(g_model_h);
  return 0;
}

static int mode_worker(int argc, char **argv) {
  pipe_worker_options o = PIPE_WORKER_OPTIONS_INIT;
  for (int i = 0; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--rank") == 0) o.rank = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--world-size") == 0) o.world_size = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--store") == 0) o.store = argv[i + 1];
    else if (strcmp(argv[i], "--comm-timeout-ms") == 0) o.comm_timeout_ms = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--threads") == 0) o.threads_per_stage = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "worker: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  pipe_status st = pipe_worker_run(&o);
  if (st == PIPE_OK) return 0;
  fprintf(stderr, "worker: %s: %s\n", pipe_status_string(st), pipe_last_error());
  return 1;
}

static int usage(void) {
  fputs(
      "usage: dist_driver [OPTIONS] run OUTDIR IN... | kill RANK STAGE IN OUTDIR | stop RANK STAGE IN OUTDIR |\n"
      "       badstore STORE STATUS | noworkers | worker --rank R --world-size N --store S\n",
      stderr);
  return 2;
}

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
  if (n <= 0) snprintf(g_self, sizeof g_self, "%s", argv[0]);
  else g_self[n] = '\0';
  int i = 1;
  for (; i < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
    if (i + 1 >= argc) return usage();
    const char *a = argv[i], *v = argv[i + 1];
    if (strcmp(a, "--pipe") == 0) g_pipe = v;
    else if (strcmp(a, "--model") == 0) g_model = v;
    else if (strcmp(a, "--split-at") == 0 && g_num_splits < MAX_SPLITS) g_splits[g_num_splits++] = v;
    else if (strcmp(a, "--world-size") == 0) g_world = atoi(v);
    else if (strcmp(a, "--microbatches") == 0) g_microbatches = atoi(v);
    else if (strcmp(a, "--comm-timeout-ms") == 0) g_comm_timeout_ms = atoi(v);
    else if (strcmp(a, "--margin-ms") == 0) g_margin_ms = atoi(v);
    else if (strcmp(a, "--weights") == 0) g_weights = v;
    else return usage();
  }
  if (i >= argc) return usage();
  const char *mode = argv[i++];
  if (strcmp(mode, "worker") == 0) return mode_worker(argc - i, argv + i);
  if (g_world < 2 || g_world > MAX_WORKERS + 1) return usage();

  /* The fault modes hold calls at the test gate: this process loads its operator before the model,
   * and the workers (children) get it preloaded, with the gate folder in their environment. Set up
   * before any thread starts, as it changes the environment. */
  if (strcmp(mode, "kill") == 0 || strcmp(mode, "stop") == 0) {
    if (gate_init() != 0) return 1;
    atexit(remove_gate_dir);
    const char *lib = getenv("LIBPIPE_TEST_GATE_LIB");
    const char *preload = getenv("LD_PRELOAD"), *asan = getenv("ASAN_OPTIONS");
    char value[8192];
    snprintf(value, sizeof value, "%s%s%s", preload && *preload ? preload : "", preload && *preload ? " " : "", lib);
    setenv("LD_PRELOAD", value, 1);
    /* Sanitizer builds: the preloaded library comes before the sanitizer's runtime. */
    snprintf(value, sizeof value, "%s%sverify_asan_link_order=0", asan && *asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", value, 1);
  }
  if (pipe_set_log_callback(on_log, NULL, PIPE_LOG_INFO) != PIPE_OK) {
    fprintf(stderr, "dist_driver: pipe_set_log_callback: %s\n", pipe_last_error());
    return 1;
  }

  /* No worker outlives this process: a crash or a test-level kill takes them along. */
  signal(SIGTERM, on_fatal_signal);
  signal(SIGINT, on_fatal_signal);
  signal(SIGSEGV, on_fatal_signal);
  signal(SIGABRT, on_fatal_signal);
  signal(SIGPIPE, SIG_IGN);
  pthread_t wd;
  pthread_create(&wd, NULL, watchdog_main, NULL);
  pthread_detach(wd);

  setvbuf(stdout, NULL, _IOLBF, 0);
  int rc;
  if (strcmp(mode, "run") == 0) rc = mode_run(argc - i, argv + i);
  else if (strcmp(mode, "kill") == 0) rc = mode_fault(SIGKILL, argc - i, argv + i);
  else if (strcmp(mode, "stop") == 0) rc = mode_fault(SIGSTOP, argc - i, argv + i);
  else if (strcmp(mode, "badstore") == 0 && argc - i == 2) rc = expect_create_failure(argv[i], argv[i + 1]);
  else if (strcmp(mode, "noworkers") == 0) {
    rc = expect_create_failure("127.0.0.1:0", "PIPE_ERR_COMMUNICATION");
    if (rc == 0 && !picked_port(g_store)) rc = fail("the store reported '%s', not the port it got", g_store);
  } else rc = usage();
  if (rc != 0) reap_all_killed();
  return rc;
}
