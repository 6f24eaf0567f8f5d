/* pipe worker: host stages for a session driven from another process or machine. Under a launcher
 * (torchrun, srun) with no rank flags, launched rank i is the session's rank i + 1: the driver is
 * outside the launch (a long-running service), its store named by --store or LIBPIPE_STORE (pipe_worker_run
 * reads both). */
#include <string.h>

#include "cli.h"

int cmd_worker(int argc, char **argv) {
  pipe_worker_options options = PIPE_WORKER_OPTIONS_INIT;
  static char token[MAX_TOKEN_BYTES];
  int has_rank = 0, has_world = 0;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--rank") != 0 && strcmp(a, "--world-size") != 0 && strcmp(a, "--store") != 0 &&
        strcmp(a, "--comm-timeout-ms") != 0 && strcmp(a, "--threads") != 0 && strcmp(a, "--token-file") != 0)
      return usage_error(a[0] == '-' ? "worker: unknown option '%s'" : "worker: unexpected argument '%s'", a);
    if (i + 1 >= argc) return usage_error("worker: %s needs a value", a);
    const char *v = argv[++i];
    if (strcmp(a, "--store") == 0) {
      options.store = v;
    } else if (strcmp(a, "--token-file") == 0) {
      if (read_token_file("worker", v, token, sizeof token)) return 2;
      options.token = token;
    } else if (parse_int(a, v,
                         strcmp(a, "--rank") == 0              ? &options.rank
                         : strcmp(a, "--world-size") == 0      ? &options.world_size
                         : strcmp(a, "--comm-timeout-ms") == 0 ? &options.comm_timeout_ms
                                                               : &options.threads_per_stage) != 0) {
      return 2;
    }
    has_rank |= strcmp(a, "--rank") == 0;
    has_world |= strcmp(a, "--world-size") == 0;
  }
  /* Neither --rank nor --world-size: rank and world size 0, which pipe_worker_run takes from a launcher's
   * environment; no --store: LIBPIPE_STORE (libpipe says what is missing). */
  if (has_rank != has_world)
    return usage_error("worker: give both --rank R and --world-size N, or neither (torchrun, srun)");
  pipe_status st = pipe_worker_run(&options);
  return st == PIPE_OK ? 0 : fail("worker failed", st);
}
