/* pipe_launch_from_environment: what torchrun and srun tell the processes they start, read as the
 * pipe tool and the bindings read it. Each case sets the environment a launcher would, in this
 * process, and clears it after. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <pipe/pipe.h>

static const char *const launcher_variables[] = {"RANK",
                                                 "WORLD_SIZE",
                                                 "MASTER_ADDR",
                                                 "MASTER_PORT",
                                                 "LOCAL_RANK",
                                                 "LOCAL_WORLD_SIZE",
                                                 "TORCHELASTIC_USE_AGENT_STORE",
                                                 "LIBPIPE_PORT",
                                                 "SLURM_PROCID",
                                                 "SLURM_NTASKS",
                                                 "SLURM_LOCALID",
                                                 "SLURM_TASKS_PER_NODE",
                                                 "SLURM_JOB_NODELIST",
                                                 "SLURM_NODELIST",
                                                 NULL};

static void clear_launcher(void) {
  for (const char *const *v = launcher_variables; *v; ++v) unsetenv(*v);
}

/* Sets NAME=VALUE pairs (NULL-terminated). */
static void launched(const char *first, ...) {
  clear_launcher();
  va_list args;
  va_start(args, first);
  for (const char *name = first; name; name = va_arg(args, const char *)) setenv(name, va_arg(args, const char *), 1);
  va_end(args);
}

static int32_t read_launch(pipe_launch_info *info) {
  int32_t found = -1;
  pipe_launch_info fresh = PIPE_LAUNCH_INFO_INIT;
  *info = fresh;
  assert_int_equal(pipe_launch_from_environment(info, &found), PIPE_OK);
  return found;
}

static void refused(const char *words) {
  pipe_launch_info info = PIPE_LAUNCH_INFO_INIT;
  int32_t found = -1;
  assert_int_equal(pipe_launch_from_environment(&info, &found), PIPE_ERR_INVALID_ARGUMENT);
  if (!strstr(pipe_last_error(), words)) fail_msg("'%s' does not say '%s'", pipe_last_error(), words);
  assert_int_equal(found, -1); /* nothing written on failure */
}

static void no_launcher(void **state) {
  (void)state;
  clear_launcher();
  pipe_launch_info info;
  assert_int_equal(read_launch(&info), 0);
  assert_int_equal(info.rank, 0);
  assert_string_equal(info.store, "");
}

static void torchrun(void **state) {
  (void)state;
  pipe_launch_info info;
  /* torchrun's agent holds MASTER_PORT (its default): rank 0 listens on the next port. */
  launched("RANK", "2", "WORLD_SIZE", "3", "MASTER_ADDR", "10.1.2.3", "MASTER_PORT", "29500", "LOCAL_RANK", "0",
           "LOCAL_WORLD_SIZE", "1", "TORCHELASTIC_USE_AGENT_STORE", "True", NULL);
  assert_int_equal(read_launch(&info), 1);
  assert_int_equal(info.rank, 2);
  assert_int_equal(info.world_size, 3);
  assert_int_equal(info.local_rank, 0);
  assert_int_equal(info.local_world_size, 1);
  assert_string_equal(info.launcher, "torchrun");
  assert_string_equal(info.store, "10.1.2.3:29501");
  /* Without the agent's store, MASTER_PORT itself; LIBPIPE_PORT wins over both. */
  unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "10.1.2.3:29500");
  setenv("LIBPIPE_PORT", "41000", 1);
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "10.1.2.3:41000");
  setenv("MASTER_ADDR", "::1", 1);
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "[::1]:41000");
  clear_launcher();
}

static void torchrun_half_set(void **state) {
  (void)state;
  launched("RANK", "1", NULL);
  refused("WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set");
  launched("RANK", "3", "WORLD_SIZE", "3", "MASTER_ADDR", "h", "MASTER_PORT", "1", NULL);
  refused("RANK=3 is not below WORLD_SIZE=3");
  launched("RANK", "one", "WORLD_SIZE", "3", "MASTER_ADDR", "h", "MASTER_PORT", "1", NULL);
  refused("RANK='one' is not a number");
  launched("RANK", "0", "WORLD_SIZE", "2", "MASTER_ADDR", "h", "MASTER_PORT", "65535", "TORCHELASTIC_USE_AGENT_STORE",
           "True", NULL);
  refused("LIBPIPE_PORT");
  clear_launcher();
}

static void slurm(void **state) {
  (void)state;
  pipe_launch_info info;
  launched("SLURM_PROCID", "5", "SLURM_NTASKS", "8", "SLURM_LOCALID", "1", "SLURM_TASKS_PER_NODE", "2(x4)",
           "SLURM_JOB_NODELIST", "gpu[007-009,012],login1", NULL);
  assert_int_equal(read_launch(&info), 1);
  assert_int_equal(info.rank, 5);
  assert_int_equal(info.world_size, 8);
  assert_int_equal(info.local_rank, 1);
  assert_int_equal(info.local_world_size, 2);
  assert_string_equal(info.launcher, "slurm");
  assert_string_equal(info.store, "gpu007:29500"); /* the first host, zeros kept; the default port */
  setenv("MASTER_PORT", "1234", 1);
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "gpu007:1234");
  setenv("SLURM_JOB_NODELIST", "rack[2-3]-node[10-11]", 1);
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "rack2-node10:1234");
  setenv("SLURM_JOB_NODELIST", "plainhost", 1);
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "plainhost:1234");
  setenv("MASTER_ADDR", "10.9.9.9", 1); /* set by the job script: rank 0's host */
  assert_int_equal(read_launch(&info), 1);
  assert_string_equal(info.store, "10.9.9.9:1234");
  unsetenv("MASTER_ADDR");
  setenv("SLURM_JOB_NODELIST", "gpu[", 1);
  refused("cannot read the SLURM node list 'gpu['");
  unsetenv("SLURM_JOB_NODELIST");
  refused("SLURM_JOB_NODELIST");
  clear_launcher();
}

static void arguments(void **state) {
  (void)state;
  int32_t found = 0;
  pipe_launch_info info = PIPE_LAUNCH_INFO_INIT;
  assert_int_equal(pipe_launch_from_environment(NULL, &found), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_launch_from_environment(&info, NULL), PIPE_ERR_INVALID_ARGUMENT);
  info.struct_size = 7;
  assert_int_equal(pipe_launch_from_environment(&info, &found), PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "PIPE_LAUNCH_INFO_INIT"));
  pipe_launch_info inited;
  assert_int_equal(pipe_launch_info_init(&inited, sizeof inited), PIPE_OK);
  assert_int_equal(inited.struct_size, sizeof inited);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(no_launcher), cmocka_unit_test(torchrun),  cmocka_unit_test(torchrun_half_set),
      cmocka_unit_test(slurm),       cmocka_unit_test(arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
