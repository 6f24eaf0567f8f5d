/* Soak: many requests from many threads on a small model. Every answer is checked (the model is
 * row-independent, so a request of the first b rows of the reference input must give the first b
 * rows of the reference output), and resident memory is sampled as the run goes: after warm-up
 * it must stay flat.
 *
 *   soak MODEL INPUTS EXPECTED REQUESTS THREADS */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <pipe/pipe.h>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    pipe_status st_ = (call);                                                              \
    if (st_ != PIPE_OK) {                                                                  \
      fprintf(stderr, "%s: %s (%s)\n", #call, pipe_last_error(), pipe_status_string(st_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static pipe_session *session;
static const DLManagedTensor *x_full, *y_full, *want_full;
static atomic_long next_request, wrong, failed;
static long total_requests;

static double rss_mib(void) {
  long pages = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f || fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  if (f) fclose(f);
  return (double)resident * (double)sysconf(_SC_PAGESIZE) / 1048576.0;
}

/* The first `rows` rows of a row-major 2-d float tensor, as a borrowed DLPack view. */
static DLManagedTensor rows_of(const DLManagedTensor *t, int64_t *shape, int64_t rows) {
  DLManagedTensor v = *t;
  shape[0] = rows;
  shape[1] = t->dl_tensor.shape[1];
  v.dl_tensor.shape = shape;
  v.dl_tensor.strides = NULL;
  v.deleter = NULL;
  return v;
}

static void *worker(void *arg) {
  unsigned seed = (unsigned)(size_t)arg;
  for (;;) {
    long i = atomic_fetch_add(&next_request, 1);
    if (i >= total_requests) return NULL;
    int64_t rows = 1 + rand_r(&seed) % x_full->dl_tensor.shape[0];
    int64_t sx[2], sy[2];
    DLManagedTensor x = rows_of(x_full, sx, rows), y = rows_of(y_full, sy, rows);
    const DLManagedTensor *args[2] = {&x, &y};
    pipe_tensor_list *out = NULL;
    if (pipe_session_run(session, args, 2, NULL, &out) != PIPE_OK) {
      atomic_fetch_add(&failed, 1);
      continue;
    }
    const DLManagedTensor *got = NULL;
    if (pipe_tensor_list_get(out, 0, &got) != PIPE_OK) { /* a run that gave no output 0 */
      atomic_fetch_add(&wrong, 1);
      pipe_tensor_list_destroy(out);
      continue;
    }
    const float *a = got->dl_tensor.data, *b = want_full->dl_tensor.data;
    int64_t n = rows * got->dl_tensor.shape[1];
    for (int64_t k = 0; k < n; ++k)
      if (fabsf(a[k] - b[k]) > 1e-4f + 1e-4f * fabsf(b[k])) {
        atomic_fetch_add(&wrong, 1);
        break;
      }
    pipe_tensor_list_destroy(out);
  }
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: soak MODEL INPUTS EXPECTED REQUESTS THREADS\n");
    return 2;
  }
  total_requests = atol(argv[4]);
  int threads = atoi(argv[5]);
  /* Random batch sizes are often below the micro-batch count; that warning is expected here. */
  CHECK(pipe_set_log_callback(NULL, NULL, PIPE_LOG_ERROR));
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_tensor_list *inputs = NULL, *expected = NULL;
  CHECK(pipe_model_load(argv[1], &model));
  CHECK(pipe_plan_create(model, NULL, &plan));
  pipe_session_options so = PIPE_SESSION_OPTIONS_INIT;
  so.num_microbatches = 4;
  CHECK(pipe_session_create(plan, &so, &session));
  CHECK(pipe_safetensors_read(argv[2], &inputs));
  CHECK(pipe_safetensors_read(argv[3], &expected));
  size_t ix = 0, iy = 0, io = 0;
  CHECK(pipe_tensor_list_find(inputs, "x", &ix));
  CHECK(pipe_tensor_list_find(inputs, "y", &iy));
  CHECK(pipe_tensor_list_find(expected, "output", &io));
  CHECK(pipe_tensor_list_get(inputs, ix, &x_full));
  CHECK(pipe_tensor_list_get(inputs, iy, &y_full));
  CHECK(pipe_tensor_list_get(expected, io, &want_full));

  /* Run in tenths; the first tenth is warm-up (TorchScript optimises, allocator pools fill). */
  const long step = total_requests / 10;
  double rss[11];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long goal = total_requests;
  rss[0] = rss_mib();
  printf("| requests | RSS MiB |\n| --- | --- |\n");
  for (int tenth = 1; tenth <= 10; ++tenth) {
    total_requests = tenth == 10 ? goal : step * tenth;
    pthread_t ids[64];
    for (int t = 0; t < threads && t < 64; ++t)
      pthread_create(&ids[t], NULL, worker, (void *)(size_t)(t + 1 + tenth * 100));
    for (int t = 0; t < threads && t < 64; ++t) pthread_join(ids[t], NULL);
    rss[tenth] = rss_mib();
    printf("| %ld | %.1f |\n", total_requests, rss[tenth]);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  double growth = (rss[10] - rss[1]) / rss[1] * 100.0;
  printf(
      "\n%ld requests from %d threads in %.1f s (%.0f requests/s): %ld wrong, %ld failed; "
      "RSS after warm-up %.1f MiB, at the end %.1f MiB (%+.2f%%)\n",
      goal, threads, secs, (double)goal / secs, atomic_load(&wrong), atomic_load(&failed), rss[1], rss[10], growth);
  pipe_tensor_list_destroy(expected);
  pipe_tensor_list_destroy(inputs);
  pipe_session_destroy(session);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return atomic_load(&wrong) == 0 && atomic_load(&failed) == 0 && growth < 1.0 ? 0 : 1;
}
