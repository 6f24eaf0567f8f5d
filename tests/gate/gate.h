/* The test side of the gate protocol (see gate_op.cpp), for C and C++ tests.
 *
 *   gate_init();                          once per process, before loading a gated model
 *   int64_t key = gate_new_key();         one per call the test wants to hold
 *   ... submit a call with input n = key ...
 *   gate_wait(key, "stage0", "arrived", 1)   wait until a micro-batch is held in stage 0
 *   gate_open(key, "stage0")              let stage 0 go (NULL: every stage)
 *
 * gate_wait only waits for a state the test itself brings about; its bound (GATE_WAIT_LIMIT_S)
 * exists to end a broken test, never to decide a verdict. */
#ifndef LIBPIPE_TEST_GATE_H
#define LIBPIPE_TEST_GATE_H

#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define GATE_WAIT_LIMIT_S 300

static int64_t gate_next_key_ = 1;
static char gate_dir_[] = "/tmp/libpipe-gate-XXXXXX";

/* Removes the folder gate_init made (at exit: children that share it are gone by then). */
static void gate_remove_dir_(void) {
  DIR* d = opendir(gate_dir_);
  if (!d) return;
  char path[512];
  for (struct dirent* e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "%s/%s", gate_dir_, e->d_name);
    unlink(path);
  }
  closedir(d);
  rmdir(gate_dir_);
}

/* Creates this process's gate folder (children inherit it through the environment) and loads the
 * operator library named by LIBPIPE_TEST_GATE_LIB, so that TorchScript can resolve
 * libpipe_test::gate. Returns 0 on success, -1 with a message on stderr otherwise. */
static int gate_init(void) {
  const char* lib = getenv("LIBPIPE_TEST_GATE_LIB");
#ifdef LIBPIPE_TEST_GATE_LIB_PATH /* the build's own copy, for tests ctest cannot give the variable */
  if (!lib || !*lib) lib = LIBPIPE_TEST_GATE_LIB_PATH;
#endif
  if (!lib || !*lib) {
    fprintf(stderr, "gate_init: LIBPIPE_TEST_GATE_LIB is not set (ctest sets it)\n");
    return -1;
  }
  if (!dlopen(lib, RTLD_NOW | RTLD_GLOBAL)) {
    fprintf(stderr, "gate_init: %s\n", dlerror());
    return -1;
  }
  if (!getenv("LIBPIPE_TEST_GATE_DIR") || strcmp(getenv("LIBPIPE_TEST_GATE_DIR"), gate_dir_) != 0) {
    if (!mkdtemp(gate_dir_)) {
      perror("gate_init: mkdtemp");
      return -1;
    }
    setenv("LIBPIPE_TEST_GATE_DIR", gate_dir_, 1);
    atexit(gate_remove_dir_);
  }
  return 0;
}

static int64_t gate_new_key(void) { return gate_next_key_++; }

/* How many micro-batches have `what` ("arrived" or "left") the gate of `stage` for `key`. */
static int gate_count(int64_t key, const char* stage, const char* what) {
  char prefix[128];
  snprintf(prefix, sizeof prefix, "gate-%lld.%s.%s.", (long long)key, stage, what);
  DIR* d = opendir(getenv("LIBPIPE_TEST_GATE_DIR"));
  if (!d) return 0;
  int n = 0;
  for (struct dirent* e; (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return n;
}

/* Waits until at least `count` micro-batches have `what` the gate; 1 when they have, 0 (with a
 * message) if that never happens within GATE_WAIT_LIMIT_S. */
static int gate_wait(int64_t key, const char* stage, const char* what, int count) {
  const time_t give_up = time(NULL) + GATE_WAIT_LIMIT_S;
  while (gate_count(key, stage, what) < count) {
    if (time(NULL) > give_up) {
      fprintf(stderr, "gate_wait: gate %lld (%s): %d micro-batches %s, waited for %d\n", (long long)key, stage,
              gate_count(key, stage, what), what, count);
      return 0;
    }
    usleep(2000);
  }
  return 1;
}

/* The intra-op thread count a micro-batch of `key` ran `stage` with (what its "arrived" file holds; the first
 * one found when several arrived), or -1 if none has arrived. */
static inline int gate_arrived_threads(int64_t key, const char* stage) {
  char prefix[128], path[512];
  snprintf(prefix, sizeof prefix, "gate-%lld.%s.arrived.", (long long)key, stage);
  DIR* d = opendir(getenv("LIBPIPE_TEST_GATE_DIR"));
  if (!d) return -1;
  int threads = -1;
  for (struct dirent* e; threads < 0 && (e = readdir(d));) {
    if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
    snprintf(path, sizeof path, "%s/%s", getenv("LIBPIPE_TEST_GATE_DIR"), e->d_name);
    FILE* f = fopen(path, "r");
    if (f && fscanf(f, "%d", &threads) != 1) threads = -1;
    if (f) fclose(f);
  }
  closedir(d);
  return threads;
}

/* Opens the gate of `stage` for `key`, or of every stage when `stage` is NULL. */
static void gate_open(int64_t key, const char* stage) {
  char path[512];
  if (stage)
    snprintf(path, sizeof path, "%s/gate-%lld.%s.open", getenv("LIBPIPE_TEST_GATE_DIR"), (long long)key, stage);
  else snprintf(path, sizeof path, "%s/gate-%lld.open", getenv("LIBPIPE_TEST_GATE_DIR"), (long long)key);
  FILE* f = fopen(path, "w");
  if (f) fclose(f);
}

#endif
