/* Local worker processes for --processes: `pipe worker` started from this same executable, tied
 * to this process's life, and reaped when the session ends. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"

extern char **environ;

/* This process's environment with LIBPIPE_TOKEN=token (replacing any), built before fork: a forked child of a
 * process with threads may only call async-signal-safe functions until it execs. NULL token: environ itself. */
static char **environment_with_token(const char *token, char *entry, size_t capacity) {
  if (!token) return environ;
  size_t n = 0;
  while (environ[n]) ++n;
  char **envp = calloc(n + 2, sizeof *envp);
  if (!envp) return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i)
    if (strncmp(environ[i], "LIBPIPE_TOKEN=", 14) != 0) envp[k++] = environ[i];
  snprintf(entry, capacity, "LIBPIPE_TOKEN=%s", token);
  envp[k++] = entry;
  envp[k] = NULL;
  return envp;
}

/* Starts `pipe worker` for ranks 1..N-1 (this same executable). Each dies with this process
 * (PR_SET_PDEATHSIG), so no worker outlives a driver that crashed. Their stderr is discarded:
 * what goes wrong in a worker reaches the driver's calls, and this process reports it once. */
int start_workers(local_workers *w, const session_args *s, const char *store) {
  char rank[16], world[16], timeout[16];
  static char token_entry[MAX_TOKEN_BYTES + 32];
  char **envp = environment_with_token(s->options.token, token_entry, sizeof token_entry);
  if (!envp) {
    fprintf(stderr, "pipe: error: cannot start the workers: out of memory\n");
    return 1;
  }
  snprintf(world, sizeof world, "%d", s->processes);
  snprintf(timeout, sizeof timeout, "%d", s->options.comm_timeout_ms > 0 ? s->options.comm_timeout_ms : 60000);
  for (int r = 1; r < s->processes; ++r) {
    snprintf(rank, sizeof rank, "%d", r);
    char *argv[] = {
        "pipe",  "worker", "--rank", rank, "--world-size", world, "--store", (char *)store, "--comm-timeout-ms",
        timeout, NULL};
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "pipe: error: cannot start worker %d: %s\n", r, strerror(errno));
      if (envp != environ) free(envp);
      return 1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      int devnull = open("/dev/null", O_WRONLY);
      if (devnull >= 0) dup2(devnull, STDERR_FILENO);
      if (s->workers_ignore_interrupt) signal(SIGINT, SIG_IGN); /* async-signal-safe, and kept across execve */
      execve("/proc/self/exe", argv, envp);
      _exit(127);
    }
    w->pids[w->count++] = pid;
  }
  if (envp != environ) free(envp);
  return 0;
}

void reap_workers(local_workers *w, int kill_now) {
  double deadline = now_ms() + (w->comm_timeout_ms > 0 ? w->comm_timeout_ms : 60000);
  for (int i = 0; i < w->count; ++i) {
    if (kill_now) kill(w->pids[i], SIGKILL);
    while (waitpid(w->pids[i], NULL, WNOHANG) == 0) {
      if (now_ms() > deadline) {
        kill(w->pids[i], SIGKILL);
        waitpid(w->pids[i], NULL, 0);
        break;
      }
      usleep(10000);
    }
  }
  w->count = 0;
}
