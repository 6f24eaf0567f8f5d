/* A driver for the distributed tests, written against the C ABI only (pipe/pipe.h).
 *
 * It starts its own worker processes with posix_spawn (the `pipe` CLI's `pipe worker`, or this
 * program's own `worker` mode, which calls pipe_worker_run), creates a Gloo session with them on a
 * free loopback port, and runs one scenario. tests/distributed/test_capi_distributed.py drives it
 * and compares the outputs it writes with eager PyTorch.
 *
 *   dist_driver [OPTIONS] run OUTDIR IN...
 *       One session: every IN (safetensors, one tensor per forward argument) runs in turn with
 *       pipe_session_run -> OUTDIR/seq.<i>.safetensors, then all are submitted at once (their
 *       micro-batches interleave) -> OUTDIR/async.<i>.safetensors. The session is destroyed and
 *       every worker must exit 0.
 *   dist_driver [OPTIONS] kill RANK IN OUTDIR
 *   dist_driver [OPTIONS] stop RANK IN OUTDIR
 *       One run (OUTDIR/before.safetensors), then two threads stream IN through the session; after
 *       a few calls worker RANK gets SIGKILL (kill) or SIGSTOP (stop). Every streaming call must
 *       fail with PIPE_ERR_COMMUNICATION within comm_timeout_ms + margin; pipe_session_check then
 *       says PIPE_ERR_COMMUNICATION, later calls fail at once, pipe_session_destroy returns within
 *       comm_timeout_ms + margin and the surviving workers exit on their own. Then fresh workers
 *       and a new session run IN again (OUTDIR/after.safetensors).
 *   dist_driver [OPTIONS] badstore STORE STATUS
 *       pipe_session_create with store STORE (no workers) must fail with STATUS (a name such as
 *       PIPE_ERR_COMMUNICATION) within comm_timeout_ms + margin. Prints the message on stdout.
 *   dist_driver [OPTIONS] noworkers
 *       A session on a free port whose workers never come must fail with PIPE_ERR_COMMUNICATION
 *       within comm_timeout_ms + margin. Prints the message on stdout.
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
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <pipe/pipe.h>

extern char **environ;

#define MAX_WORKERS 16
#define MAX_SPLITS 16
#define MAX_INPUTS 64
#define STREAM_THREADS 2

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
static char g_store[64];

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

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in addr;
  memset(&addr, 0, sizeof addr);
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = -1;
  if (bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0 && getsockname(fd, (struct sockaddr *)&addr, &len) == 0)
    port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

static int spawn_workers(void) {
  int port = free_port();
  if (port < 0) return fail("no free port: %s", strerror(errno));
  snprintf(g_store, sizeof g_store, "127.0.0.1:%d", port);
  const char *exe = strcmp(g_pipe, "self") == 0 ? g_self : g_pipe;
  char world[16], timeout[16];
  snprintf(world, sizeof world, "%d", g_world);
  snprintf(timeout, sizeof timeout, "%d", g_comm_timeout_ms);
  g_num_workers = g_world - 1;
  for (int rank = 1; rank < g_world; ++rank) {
    char rank_s[16];
    snprintf(rank_s, sizeof rank_s, "%d", rank);
    char *argv[] = {(char *)exe, "worker", "--rank", rank_s, "--world-size", world, "--store", g_store,
                    "--comm-timeout-ms", timeout, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, exe, NULL, NULL, argv, environ);
    if (rc != 0) return fail("posix_spawn %s: %s", exe, strerror(rc));
    g_workers[rank - 1] = pid;
  }
  say("started %d workers (%s) for store %s", g_num_workers, exe, g_store);
  return 0;
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
  pipe_model_num_inputs(model, &n);
  if (n > 16) return fail("too many inputs");
  for (size_t i = 0; i < n; ++i) {
    const char *name = NULL;
    size_t index = 0;
    pipe_model_input_name(model, i, &name);
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
  pipe_plan_options_create(&po);
  for (int i = 0; i < g_num_splits; ++i) {
    st = pipe_plan_options_add_split_point(po, g_splits[i]);
    if (st != PIPE_OK) return fail("split point %s: %s", g_splits[i], pipe_last_error());
  }
  st = pipe_plan_create(g_model_h, po, &g_plan);
  pipe_plan_options_destroy(po);
  if (st != PIPE_OK) return fail("pipe_plan_create: %s: %s", pipe_status_string(st), pipe_last_error());
  size_t stages = 0;
  pipe_plan_num_stages(g_plan, &stages);
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

/* Spawn workers and create a session with them. */
static int start_session(pipe_session **session) {
  if (spawn_workers()) return 1;
  pipe_session_options o = session_options(g_store);
  watchdog_arm(g_comm_timeout_ms + g_margin_ms + 30000.0, "pipe_session_create");
  double t0 = now_ms();
  pipe_status st = pipe_session_create(g_plan, &o, session);
  watchdog_disarm();
  if (st != PIPE_OK)
    return fail("pipe_session_create: %s: %s", pipe_status_string(st), pipe_last_error());
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
  pipe_session_num_stages(s, &stages);
  if (pipe_session_check(s) != PIPE_OK) return fail("pipe_session_check on a healthy session: %s", pipe_last_error());
  if (finish_session(s)) return 1;
  for (int i = 0; i < n; ++i) pipe_tensor_list_destroy(ins[i].list);
  pipe_plan_destroy(g_plan);
  pipe_model_destroy(g_model_h);
  printf("ok: %d inputs, %zu stages, %d processes\n", n, stages, g_world);
  return 0;
}

/* ---- kill / stop: a worker fails while calls stream through ----------------------------------- */

typedef struct streamer {
  pipe_session *session;
  const inputs *in;
  pthread_t thread;
  pipe_status status; /* of the call that failed */
  double failed_at;
  char message[1024];
  int done;
} streamer;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_completed; /* successful streaming calls */
static int g_stop_streaming;

static void *stream_main(void *arg) {
  streamer *s = arg;
  for (;;) {
    pthread_mutex_lock(&g_mu);
    int stop = g_stop_streaming;
    pthread_mutex_unlock(&g_mu);
    if (stop) {
      s->status = PIPE_OK;
      break;
    }
    pipe_tensor_list *out = NULL;
    pipe_status st = pipe_session_run(s->session, s->in->tensors, s->in->count, NULL, &out);
    if (st == PIPE_OK) {
      pipe_tensor_list_destroy(out);
      pthread_mutex_lock(&g_mu);
      ++g_completed;
      pthread_cond_broadcast(&g_cv);
      pthread_mutex_unlock(&g_mu);
      continue;
    }
    s->status = st;
    s->failed_at = now_ms();
    snprintf(s->message, sizeof s->message, "%s", pipe_last_error());
    break;
  }
  pthread_mutex_lock(&g_mu);
  s->done = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return NULL;
}

static int mode_fault(int sig, int argc, char **argv) {
  if (argc != 3) return fail("kill/stop need RANK IN OUTDIR");
  int rank = atoi(argv[0]);
  const char *in_path = argv[1], *dir = argv[2];
  if (rank < 1 || rank >= g_world) return fail("RANK must be 1 .. world_size-1");
  const char *what = sig == SIGKILL ? "killed" : "stopped";
  if (load_plan()) return 1;
  inputs in;
  if (read_inputs(g_model_h, in_path, &in)) return 1;
  pipe_session *s = NULL;
  if (start_session(&s)) return 1;
  if (run_once(s, &in, dir, "before.safetensors")) return 1;

  streamer st[STREAM_THREADS];
  memset(st, 0, sizeof st);
  g_completed = 0;
  g_stop_streaming = 0;
  for (int i = 0; i < STREAM_THREADS; ++i) {
    st[i].session = s;
    st[i].in = &in;
    pthread_create(&st[i].thread, NULL, stream_main, &st[i]);
  }
  /* Let a few calls complete, so that the fault lands in a stream of requests. */
  watchdog_arm(120000.0, "the first streaming calls");
  pthread_mutex_lock(&g_mu);
  int early_fail = 0;
  while (g_completed < 6) {
    for (int i = 0; i < STREAM_THREADS; ++i) early_fail |= st[i].done;
    if (early_fail) break;
    pthread_cond_wait(&g_cv, &g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  watchdog_disarm();
  if (early_fail) {
    for (int i = 0; i < STREAM_THREADS; ++i)
      if (st[i].done) return fail("a streaming call failed before the fault: %s: %s", pipe_status_string(st[i].status), st[i].message);
  }
  pid_t victim = g_workers[rank - 1];
  double t_fault = now_ms();
  kill(victim, sig);
  say("worker rank %d (pid %d) %s after %d calls", rank, (int)victim, what, g_completed);
  if (sig == SIGKILL) {
    waitpid(victim, NULL, 0);
    g_workers[rank - 1] = 0;
  }

  /* Every streaming call must fail with PIPE_ERR_COMMUNICATION within comm_timeout + margin. */
  double limit = g_comm_timeout_ms + g_margin_ms;
  watchdog_arm(limit, "pipe_session_run after the worker was stopped/killed");
  for (int i = 0; i < STREAM_THREADS; ++i) pthread_join(st[i].thread, NULL);
  watchdog_disarm();
  double worst = 0;
  for (int i = 0; i < STREAM_THREADS; ++i) {
    if (st[i].status != PIPE_ERR_COMMUNICATION)
      return fail("a call streaming when the worker was %s returned %s (%s), not PIPE_ERR_COMMUNICATION", what,
                  pipe_status_string(st[i].status), st[i].message);
    if (!st[i].message[0]) return fail("PIPE_ERR_COMMUNICATION without a message");
    if (st[i].failed_at - t_fault > worst) worst = st[i].failed_at - t_fault;
  }
  say("calls failed with PIPE_ERR_COMMUNICATION %.0f ms after the worker was %s: %s", worst, what, st[0].message);
  printf("failed_after_ms %.0f\n", worst);
  printf("message %s\n", st[0].message);

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
    return fail("pipe_session_run on a broken session returned %s, not PIPE_ERR_COMMUNICATION", pipe_status_string(again));
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
  fputs("usage: dist_driver [OPTIONS] run OUTDIR IN... | kill RANK IN OUTDIR | stop RANK IN OUTDIR |\n"
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
    int port = free_port();
    char store[64];
    snprintf(store, sizeof store, "127.0.0.1:%d", port);
    rc = expect_create_failure(store, "PIPE_ERR_COMMUNICATION");
  } else rc = usage();
  if (rc != 0) reap_all_killed();
  return rc;
}
