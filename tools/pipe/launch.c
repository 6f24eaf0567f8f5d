/* The same command on every rank of a launch (torchrun, srun), and the session's secret: what run,
 * bench and generate do before they open a pipeline. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

int read_token_file(const char *command, const char *path, char *out, size_t capacity) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "pipe: error: %s: cannot read --token-file %s: %s\n", command, path, strerror(errno));
    return 1;
  }
  size_t n = fread(out, 1, capacity - 1, f);
  int more = fgetc(f) != EOF;
  fclose(f);
  if (more) {
    fprintf(stderr, "pipe: error: %s: --token-file %s holds more than %zu bytes; a token is a short secret\n", command,
            path, capacity - 1);
    return 1;
  }
  while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == '\r')) --n; /* `openssl rand -hex 32 > FILE` ends a line */
  out[n] = '\0';
  if (memchr(out, '\0', n)) {
    fprintf(stderr, "pipe: error: %s: --token-file %s holds a NUL byte; give a text token\n", command, path);
    return 1;
  }
  return 0;
}

int fresh_token(char *out, size_t capacity) {
  unsigned char bytes[32];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  ssize_t got = fd >= 0 ? read(fd, bytes, sizeof bytes) : -1;
  if (fd >= 0) close(fd);
  if (got != (ssize_t)sizeof bytes || capacity < 2 * sizeof bytes + 1) {
    fprintf(stderr, "pipe: error: cannot make a token for the local workers: no random bytes\n");
    return 1;
  }
  for (size_t i = 0; i < sizeof bytes; ++i) snprintf(out + 2 * i, 3, "%02x", bytes[i]);
  return 0;
}

int apply_launcher(const char *command, session_args *s) {
  (void)command;
  pipe_session_options *o = &s->options;
  /* Flags win: a process told its ranks on the command line ignores the environment. */
  if (s->processes > 0 || o->world_size != 1 || o->store) return 0;
  pipe_launch_info info = PIPE_LAUNCH_INFO_INIT;
  int32_t found = 0;
  pipe_status st = pipe_launch_from_environment(&info, &found);
  if (st != PIPE_OK) return fail("the launcher's environment is not usable", st);
  if (!found || info.world_size < 2) return 0;
  s->launch = info;
  s->launched = 1;
  o->world_size = info.world_size;
  o->store = s->launch.store;
  if (o->transport == PIPE_TRANSPORT_LOCAL) o->transport = PIPE_TRANSPORT_TCP;
  return 0;
}

int serve_launched_rank(const session_args *s) {
  pipe_worker_options w = PIPE_WORKER_OPTIONS_INIT;
  w.rank = s->launch.rank;
  w.world_size = s->launch.world_size;
  w.store = s->launch.store;
  w.token = s->options.token;
  w.comm_timeout_ms = s->options.comm_timeout_ms;
  pipe_status st = pipe_worker_run(&w);
  return st == PIPE_OK ? 0 : fail("this rank's worker failed", st);
}
