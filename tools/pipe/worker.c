/* pipe worker: host stages for a session driven from another process or machine. */
#include <string.h>

#include "cli.h"

int cmd_worker(int argc, char **argv) {
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
  if (!has_rank || !has_world || !options.store)
    return usage_error("worker: --rank R, --world-size N and --store HOST:PORT are required");
  pipe_status st = pipe_worker_run(&options);
  return st == PIPE_OK ? 0 : fail("worker failed", st);
}
