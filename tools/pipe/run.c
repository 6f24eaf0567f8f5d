/* pipe run MODEL [SPLIT] --input IN --output OUT: one pipelined call, its outputs written to a
 * safetensors file, optionally traced. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int cmd_run(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL, *out_path = NULL, *trace_path = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args session;
  init_session_args(&session);
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "run", &session);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--input") == 0 || strcmp(a, "--output") == 0 || strcmp(a, "--trace") == 0) {
      if (i + 1 >= argc) return usage_error("run: %s needs a value", a);
      const char *v = argv[++i];
      if (strcmp(a, "--input") == 0) in_path = v;
      else if (strcmp(a, "--output") == 0) out_path = v;
      else trace_path = v;
    } else if (a[0] == '-') {
      return usage_error("run: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("run: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("run: MODEL is required");
  if (!in_path) return usage_error("run: --input IN.safetensors is required");
  if (!out_path) return usage_error("run: --output OUT.safetensors is required");
  if (check_split_args("run", &split) || check_session_args("run", &session)) return 2;
  if (session.launched && session.launch.rank != 0) return serve_launched_rank(&session);

  int rc = 1;
  pipeline p;
  pipe_tensor_list *out = NULL;
  pipe_status st;
  if (open_pipeline(&p, model_path, in_path, &split, &session) != 0) return 1;
  if (trace_path && (st = pipe_session_trace_start(p.session)) != PIPE_OK) {
    fail("cannot start the trace", st);
    goto done;
  }
  double start = now_ms();
  if ((st = pipe_session_run(p.session, p.args, p.num_args, NULL, &out)) != PIPE_OK) {
    fail("run failed", st);
    goto done;
  }
  double elapsed = now_ms() - start;
  if (trace_path && (st = pipe_session_trace_stop(p.session, trace_path)) != PIPE_OK) {
    fail("cannot write the trace", st);
    goto done;
  }
  if ((st = pipe_safetensors_write(out, out_path)) != PIPE_OK) {
    fail("cannot write outputs", st);
    goto done;
  }
  size_t num_outputs = 0, stages = 0;
  if ((st = pipe_tensor_list_size(out, &num_outputs)) != PIPE_OK ||
      (st = pipe_plan_num_stages(p.plan, &stages)) != PIPE_OK) {
    fail("cannot count the outputs and stages", st);
    goto done;
  }
  printf("pipe: ran %s as %zu stage%s in %.1f ms; wrote %zu output%s to %s\n", model_path, stages,
         stages == 1 ? "" : "s", elapsed, num_outputs, num_outputs == 1 ? "" : "s", out_path);
  rc = 0;

done:
  pipe_tensor_list_destroy(out);
  close_pipeline(&p);
  return rc;
}
