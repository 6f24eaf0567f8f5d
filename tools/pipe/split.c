/* pipe split MODEL [SPLIT]: the plan, as text or JSON, optionally timed on inputs, and each
 * stage saved as a standalone TorchScript file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Prints the names of `kind` (PIPE_NAMES_*) in stage `stage`; the status of the first call that
 * failed, else PIPE_OK. */
static pipe_status print_names(const pipe_plan *plan, size_t stage, int32_t kind, const char *label) {
  size_t n = 0;
  pipe_status st = pipe_plan_stage_count_names(plan, stage, kind, &n);
  if (st != PIPE_OK || n == 0) return st;
  printf("    %s:", label);
  for (size_t i = 0; i < n; ++i) {
    const char *name = NULL;
    if ((st = pipe_plan_stage_name(plan, stage, kind, i, &name)) != PIPE_OK) return st;
    printf(" %s", name);
  }
  printf("\n");
  return PIPE_OK;
}

/* The plan as text; the status of the first call that failed, else PIPE_OK. */
static pipe_status print_plan(const char *model_path, const pipe_plan *plan) {
  size_t stages = 0;
  pipe_status st = pipe_plan_num_stages(plan, &stages);
  if (st != PIPE_OK) return st;
  printf("%s: %zu stage%s\n", model_path, stages, stages == 1 ? "" : "s");
  double total = 0, slowest = 0;
  for (size_t s = 0; s < stages; ++s) {
    uint64_t bytes = 0;
    size_t params = 0, buffers = 0;
    double ms = -1;
    if ((st = pipe_plan_stage_param_bytes(plan, s, &bytes)) != PIPE_OK ||
        (st = pipe_plan_stage_count_names(plan, s, PIPE_NAMES_PARAMETERS, &params)) != PIPE_OK ||
        (st = pipe_plan_stage_count_names(plan, s, PIPE_NAMES_BUFFERS, &buffers)) != PIPE_OK ||
        (st = pipe_plan_stage_estimated_ms(plan, s, &ms)) != PIPE_OK)
      return st;
    printf("  stage %zu: %zu parameters, %zu buffers, %.2f MiB", s, params, buffers, (double)bytes / (1024.0 * 1024.0));
    if (ms >= 0) {
      printf(", %.3f ms", ms);
      total += ms;
      slowest = ms > slowest ? ms : slowest;
    }
    printf("\n");
    if ((st = print_names(plan, s, PIPE_NAMES_PARAMETERS, "parameters")) != PIPE_OK ||
        (st = print_names(plan, s, PIPE_NAMES_BUFFERS, "buffers")) != PIPE_OK)
      return st;
  }
  if (slowest > 0)
    printf("  balance: %.3f (sum of stage times / (stages x slowest))\n", total / ((double)stages * slowest));
  return PIPE_OK;
}

int cmd_split(int argc, char **argv) {
  const char *model_path = NULL, *in_path = NULL, *save_dir = NULL;
  split_args split = SPLIT_ARGS_INIT;
  int json = 0;
  int32_t only_stage = -1;
  for (int i = 0; i < argc; ++i) {
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 2) return 2;
    if (r == 1) continue;
    const char *a = argv[i];
    if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--input") == 0 || strcmp(a, "--save-stages") == 0) {
      if (i + 1 >= argc) return usage_error("split: %s needs a value", a);
      *(strcmp(a, "--input") == 0 ? &in_path : &save_dir) = argv[++i];
    } else if (strcmp(a, "--stage") == 0) {
      if (i + 1 >= argc) return usage_error("split: --stage needs a value");
      if (parse_int(a, argv[++i], &only_stage) != 0) return 2;
    } else if (a[0] == '-') {
      return usage_error("split: unknown option '%s'", a);
    } else if (!model_path) {
      model_path = a;
    } else {
      return usage_error("split: unexpected argument '%s'", a);
    }
  }
  if (!model_path) return usage_error("split: MODEL is required");
  if (check_split_args("split", &split)) return 2;

  int rc = 1;
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_tensor_list *in = NULL;
  const DLManagedTensor **args = NULL;
  size_t num_args = 0;
  pipe_status st = pipe_model_load(model_path, &model);
  if (st != PIPE_OK) {
    fail("cannot load model", st);
    goto done;
  }
  if (in_path && read_inputs(model, in_path, &in, &args, &num_args) != 0) goto done;
  if (make_plan(model, &split, args, num_args, &plan) != 0) goto done;
  if (json) {
    const char *text = NULL;
    if ((st = pipe_plan_describe(plan, &text)) != PIPE_OK) {
      fail("cannot describe the plan", st);
      goto done;
    }
    printf("%s\n", text);
  } else if ((st = print_plan(model_path, plan)) != PIPE_OK) {
    fail("cannot describe the plan", st);
    goto done;
  }
  if (save_dir) {
    size_t stages = 0;
    if ((st = pipe_plan_num_stages(plan, &stages)) != PIPE_OK) {
      fail("cannot count the plan's stages", st);
      goto done;
    }
    if (only_stage >= (int32_t)stages) {
      fprintf(stderr, "pipe: error: --stage %d but the plan has %zu stages\n", only_stage, stages);
      goto done;
    }
    /* A stage is saved in the model's own format: TorchScript (.pt) or an exported program (.pt2). */
    int32_t format = PIPE_MODEL_TORCHSCRIPT;
    if ((st = pipe_model_format(model, &format)) != PIPE_OK) {
      fail("cannot read the model's format", st);
      goto done;
    }
    const char *ext = format == PIPE_MODEL_EXPORTED ? "pt2" : "pt";
    size_t saved = 0;
    for (size_t s = 0; s < stages; ++s) {
      if (only_stage >= 0 && (size_t)only_stage != s) continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/stage%zu.%s", save_dir, s, ext);
      if ((st = pipe_plan_save_stage(plan, s, &split.weights, path)) != PIPE_OK) {
        fail("cannot save stage", st);
        goto done;
      }
      ++saved;
    }
    fprintf(stderr, "pipe: saved %zu stage%s to %s/stage<i>.%s\n", saved, saved == 1 ? "" : "s", save_dir, ext);
  }
  rc = 0;
done:
  free(args);
  pipe_tensor_list_destroy(in);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return rc;
}
