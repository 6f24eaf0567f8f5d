/* pipe bench MODEL [SPLIT] --input IN: throughput and latency of R requests from C threads at
 * once, and each stage's busy fraction. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

typedef struct {
  pipe_session *session;
  const DLManagedTensor **args;
  size_t num_args;
  int total;          /* requests to run */
  int next;           /* next request index, under lock */
  double *latency_ms; /* per request */
  pthread_mutex_t lock;
  pipe_status failure;
  char message[512];
} bench_state;

static void *bench_worker(void *arg) {
  bench_state *b = arg;
  for (;;) {
    pthread_mutex_lock(&b->lock);
    int i = b->failure == PIPE_OK && b->next < b->total ? b->next++ : -1;
    pthread_mutex_unlock(&b->lock);
    if (i < 0) return NULL;
    pipe_tensor_list *out = NULL;
    double t0 = now_ms();
    pipe_status st = pipe_session_run(b->session, b->args, b->num_args, NULL, &out);
    b->latency_ms[i] = now_ms() - t0;
    pipe_tensor_list_destroy(out);
    if (st != PIPE_OK) {
      pthread_mutex_lock(&b->lock);
      if (b->failure == PIPE_OK) {
        b->failure = st;
        snprintf(b->message, sizeof b->message, "%s", pipe_last_error());
      }
      pthread_mutex_unlock(&b->lock);
    }
  }
}

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double percentile(const double *sorted, int n, double p) {
  int i = (int)(p / 100.0 * (n - 1) + 0.5);
  return sorted[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* Runs `count` requests from `threads` threads; fills latencies; returns wall ms or -1. */
static double bench_round(bench_state *b, int count, int threads) {
  b->total = count;
  b->next = 0;
  pthread_t *ids = calloc((size_t)threads, sizeof *ids);
  if (!ids) return -1;
  double start = now_ms();
  for (int t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, bench_worker, b);
  for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
  double wall = now_ms() - start;
  free(ids);
  return b->failure == PIPE_OK ? wall : -1;
}

/* Every stage's statistics into stats[0..stages); 0, or 1 after reporting. */
static int read_stage_stats(pipe_session *session, size_t stages, pipe_stage_stats *stats) {
  for (size_t s = 0; s < stages; ++s) {
    pipe_stage_stats init = PIPE_STAGE_STATS_INIT;
    stats[s] = init;
    pipe_status st = pipe_session_stage_stats(session, s, &stats[s]);
    if (st != PIPE_OK) return fail("cannot read the stage statistics", st);
  }
  return 0;
}

int cmd_bench(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args sargs;
  init_session_args(&sargs);
  pipe_session_options *options = &sargs.options;
  int32_t requests = 100, concurrency = 2;
  int json = 0;
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "bench", &sargs);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--input") == 0 || strcmp(a, "--requests") == 0 || strcmp(a, "--concurrency") == 0 ||
               strcmp(a, "--threads-per-stage") == 0) {
      if (i + 1 >= argc) return usage_error("bench: %s needs a value", a);
      const char *v = argv[++i];
      if (strcmp(a, "--input") == 0) in_path = v;
      else if (parse_int(a, v,
                         strcmp(a, "--requests") == 0      ? &requests
                         : strcmp(a, "--concurrency") == 0 ? &concurrency
                                                           : &options->threads_per_stage) != 0)
        return 2;
    } else if (a[0] == '-') {
      return usage_error("bench: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("bench: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("bench: MODEL is required");
  if (!in_path) return usage_error("bench: --input IN.safetensors is required");
  if (requests < 1) return usage_error("bench: --requests must be at least 1");
  if (concurrency < 1) return usage_error("bench: --concurrency must be at least 1");
  if (check_split_args("bench", &split) || check_session_args("bench", &sargs)) return 2;
  if (sargs.launched && sargs.launch.rank != 0) return serve_launched_rank(&sargs);

  int rc = 1;
  pipeline p;
  size_t stages = 0;
  bench_state b;
  memset(&b, 0, sizeof b);
  pthread_mutex_init(&b.lock, NULL);
  if (open_pipeline(&p, model_path, in_path, &split, &sargs) != 0) {
    pthread_mutex_destroy(&b.lock);
    return 1;
  }
  pipe_session *session = p.session;
  const DLManagedTensor **args = p.args;
  size_t num_args = p.num_args;
  pipe_status st = pipe_plan_num_stages(p.plan, &stages);
  if (st != PIPE_OK) {
    fail("cannot count the plan's stages", st);
    goto done;
  }
  int64_t batch = num_args > 0 && args[0]->dl_tensor.ndim > 0 ? args[0]->dl_tensor.shape[0] : 1;
  b.session = session;
  b.args = args;
  b.num_args = num_args;
  b.latency_ms = calloc((size_t)requests + (size_t)concurrency * 2, sizeof(double));
  if (!b.latency_ms) goto done;
  /* Warm-up: TorchScript optimises each stage on its first calls. */
  if (bench_round(&b, concurrency * 2 > 4 ? concurrency * 2 : 4, concurrency) < 0) {
    fprintf(stderr, "pipe: error: warm-up failed: %s [%s]\n", b.message, pipe_status_string(b.failure));
    goto done;
  }
  /* Each stage's statistics before and after the measured round: the difference is the bench's. */
  pipe_stage_stats *before = calloc(2 * stages, sizeof *before);
  if (!before) goto done;
  pipe_stage_stats *after = before + stages;
  if (read_stage_stats(session, stages, before) != 0) {
    free(before);
    goto done;
  }
  double wall = bench_round(&b, requests, concurrency);
  if (wall < 0) {
    fprintf(stderr, "pipe: error: request failed: %s [%s]\n", b.message, pipe_status_string(b.failure));
    free(before);
    goto done;
  }
  if (read_stage_stats(session, stages, after) != 0) {
    free(before);
    goto done;
  }
  qsort(b.latency_ms, (size_t)requests, sizeof(double), compare_double);
  double rps = requests / (wall / 1e3);
  if (json) {
    printf(
        "{\"model\": \"%s\", \"stages\": %zu, \"microbatches\": %d, \"microbatching\": \"%s\", "
        "\"requests\": %d, \"concurrency\": %d, "
        "\"batch\": %lld, \"wall_ms\": %.3f, \"requests_per_s\": %.3f, \"samples_per_s\": %.3f, "
        "\"latency_ms\": {\"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f, \"max\": %.3f}, \"stage_busy\": [",
        model_path, stages, options->num_microbatches,
        options->microbatching == PIPE_MICROBATCHING_FIXED ? "fixed" : "adaptive", requests, concurrency,
        (long long)batch, wall, rps, rps * (double)batch, percentile(b.latency_ms, requests, 50),
        percentile(b.latency_ms, requests, 90), percentile(b.latency_ms, requests, 99), b.latency_ms[requests - 1]);
  } else {
    printf("%s: %zu stage%s, %d micro-batches (%s), batch %lld, %d requests from %d threads\n", model_path, stages,
           stages == 1 ? "" : "s", options->num_microbatches,
           options->microbatching == PIPE_MICROBATCHING_FIXED ? "fixed" : "adaptive", (long long)batch, requests,
           concurrency);
    printf("  throughput: %.1f requests/s, %.1f samples/s\n", rps, rps * (double)batch);
    printf("  latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", percentile(b.latency_ms, requests, 50),
           percentile(b.latency_ms, requests, 90), percentile(b.latency_ms, requests, 99), b.latency_ms[requests - 1]);
  }
  for (size_t s = 0; s < stages; ++s) {
    double busy = (after[s].busy_ms - before[s].busy_ms) / wall;
    if (json) printf("%s%.4f", s ? ", " : "", busy);
    else
      printf("  stage %zu: busy %.1f%% of the run, %llu micro-batches\n", s, 100.0 * busy,
             (unsigned long long)(after[s].microbatches - before[s].microbatches));
  }
  if (json) {
    printf("], \"stage_microbatches\": [");
    for (size_t s = 0; s < stages; ++s)
      printf("%s%llu", s ? ", " : "", (unsigned long long)(after[s].microbatches - before[s].microbatches));
    printf("]}\n");
  }
  free(before);
  rc = 0;
done:
  free(b.latency_ms);
  pthread_mutex_destroy(&b.lock);
  close_pipeline(&p);
  return rc;
}
