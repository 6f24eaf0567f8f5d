/* Which threads a session started, and waiting until one of them has ended (C and C++ tests; Linux,
 * through /proc/self/task).
 *
 * Why: destroying a session waits for the micro-batch a stage is running, so a test that holds that
 * micro-batch at a gate (tests/gate) must open the gate from another thread once destroy has begun,
 * and not sooner: opened earlier, the stage would go on to the calls queued behind and run them.
 * Destroy closes every stage's queue before it waits, and an idle stage worker (one with an empty
 * queue) then ends at once. So "one of the session's threads has ended" is the observable sign that
 * destroy has begun, the queues are closed and whatever is still queued will be cancelled.
 *
 *   worker_threads before, after, workers;
 *   worker_threads_now(&before);
 *   ... create the session ...
 *   worker_threads_now(&after);
 *   worker_threads_started(&before, &after, &workers);
 *   ... destroy it in another thread ...
 *   worker_threads_wait_one_ended(&workers);
 */
#ifndef LIBPIPE_TEST_WORKER_THREADS_H
#define LIBPIPE_TEST_WORKER_THREADS_H

#include <dirent.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define WORKER_THREADS_MAX 1024
#define WORKER_THREADS_WAIT_LIMIT_S 300

typedef struct {
  size_t count;
  long ids[WORKER_THREADS_MAX];
} worker_threads;

/* The ids of this process's threads now. */
static void worker_threads_now(worker_threads *t) {
  t->count = 0;
  DIR *d = opendir("/proc/self/task");
  if (!d) return;
  for (struct dirent *e; (e = readdir(d)) && t->count < WORKER_THREADS_MAX;)
    if (e->d_name[0] != '.') t->ids[t->count++] = strtol(e->d_name, NULL, 10);
  closedir(d);
}

static int worker_threads_has(const worker_threads *t, long id) {
  for (size_t i = 0; i < t->count; ++i)
    if (t->ids[i] == id) return 1;
  return 0;
}

/* The threads in `after` that were not in `before`. */
static void worker_threads_started(const worker_threads *before, const worker_threads *after, worker_threads *started) {
  started->count = 0;
  for (size_t i = 0; i < after->count; ++i)
    if (!worker_threads_has(before, after->ids[i])) started->ids[started->count++] = after->ids[i];
}

/* Waits until one thread of `watched` has ended: 1 when one has, 0 (with a message) if none does
 * within WORKER_THREADS_WAIT_LIMIT_S (a bound that only ends a broken test). */
static int worker_threads_wait_one_ended(const worker_threads *watched) {
  const time_t give_up = time(NULL) + WORKER_THREADS_WAIT_LIMIT_S;
  for (;;) {
    worker_threads now;
    worker_threads_now(&now);
    for (size_t i = 0; i < watched->count; ++i)
      if (!worker_threads_has(&now, watched->ids[i])) return 1;
    if (time(NULL) > give_up) {
      fprintf(stderr, "worker_threads_wait_one_ended: none of the %zu threads ended\n", watched->count);
      return 0;
    }
    usleep(2000);
  }
}

#endif
