/* pipe split MODEL [SPLIT]: the plan, as text or JSON, optionally timed on inputs, and each
 * stage saved as a standalone TorchScript file. With --dtype, --quantize, --quantize-head or --quantize-embedding, each
 * stage's bytes as a CPU stage stores them too (pipe_plan_stage_weight_bytes). */
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

/* Whether the options change how the stages store their weights: then their bytes as stored are worth a report. */
static int stores_otherwise(const pipe_stage_options *o) {
  return o->dtype != PIPE_DTYPE_KEEP || o->quantize != PIPE_QUANTIZE_NONE ||
         o->quantize_head != PIPE_QUANTIZE_HEAD_DEFAULT || o->quantize_embedding != PIPE_QUANTIZE_EMBEDDING_NONE;
}

/* How the options store the weights, for the text output: "int4:64, head int8, embedding int8, bf16". */
static void describe_storage(const pipe_stage_options *o, char *out, size_t size) {
  static const char *const dtypes[] = {"", "fp32", "fp16", "bf16"};
  static const char *const heads[] = {"", "int8", "int4", "none"};
  char quantize[32] = "";
  if (o->quantize == PIPE_QUANTIZE_INT8) snprintf(quantize, sizeof quantize, "int8");
  if (o->quantize == PIPE_QUANTIZE_INT4)
    snprintf(quantize, sizeof quantize, o->quantize_group ? "int4:%lld" : "int4", (long long)o->quantize_group);
  const char *dtype = o->dtype > 0 && o->dtype < 4 ? dtypes[o->dtype] : "";
  const char *head = o->quantize_head > 0 && o->quantize_head < 4 ? heads[o->quantize_head] : "";
  const char *embedding = o->quantize_embedding == PIPE_QUANTIZE_EMBEDDING_INT8 ? "embedding int8" : "";
  snprintf(out, size, "%s%s%s%s%s%s%s%s", quantize, *head ? ", head " : "", head, *quantize && *embedding ? ", " : "",
           embedding, (*quantize || *embedding) && *dtype ? ", " : "", dtype,
           *quantize || *embedding || *dtype ? "" : "as they are");
}

/* `json` (pipe_plan_describe's) with "weight_bytes": bytes[i] added to each object of its "stages" array, written
 * to stdout. A small scan that knows strings and nesting: the key goes before the brace that closes each entry. */
static void print_json_with_weight_bytes(const char *json, const uint64_t *bytes, size_t num_stages) {
  int depth = 0, in_string = 0, escaped = 0, in_stages = 0;
  size_t entry = 0;
  const char *key_start = NULL;
  char last_key[64] = "";
  for (const char *c = json; *c; ++c) {
    if (in_string) {
      if (escaped) escaped = 0;
      else if (*c == '\\') escaped = 1;
      else if (*c == '"') {
        in_string = 0;
        if (depth == 1 && key_start) snprintf(last_key, sizeof last_key, "%.*s", (int)(c - key_start), key_start);
      }
      putchar(*c);
      continue;
    }
    if (*c == '"') {
      in_string = 1;
      key_start = c + 1;
    } else if (*c == '{' || *c == '[') {
      ++depth;
      if (depth == 2 && *c == '[' && strcmp(last_key, "stages") == 0) in_stages = 1;
    } else if (*c == '}' || *c == ']') {
      if (in_stages && depth == 3 && *c == '}' && entry < num_stages)
        printf(",\"weight_bytes\":%llu", (unsigned long long)bytes[entry++]);
      if (depth == 2) in_stages = 0;
      --depth;
    }
    putchar(*c);
  }
  putchar('\n');
}

/* The plan as text; the status of the first call that failed, else PIPE_OK. */
static pipe_status print_plan(const char *model_path, const pipe_plan *plan, const pipe_stage_options *storage,
                              const uint64_t *stored) {
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
    if (stored) {
      char how[96];
      describe_storage(storage, how, sizeof how);
      printf(", %.2f MiB as %s", (double)stored[s] / (1024.0 * 1024.0), how);
    }
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
  uint64_t *stored = NULL; /* each stage's bytes as stored, when the options change them */
  size_t num_stored = 0;
  pipe_status st = pipe_model_load(model_path, &model);
  if (st != PIPE_OK) {
    fail("cannot load model", st);
    goto done;
  }
  if (in_path && read_inputs(model, in_path, &in, &args, &num_args) != 0) goto done;
  if (make_plan(model, &split, args, num_args, &plan) != 0) goto done;
  if (stores_otherwise(&split.weights)) {
    size_t stages = 0;
    if ((st = pipe_plan_num_stages(plan, &stages)) != PIPE_OK) {
      fail("cannot count the plan's stages", st);
      goto done;
    }
    stored = calloc(stages ? stages : 1, sizeof *stored);
    if (!stored) {
      fprintf(stderr, "pipe: error: out of memory\n");
      goto done;
    }
    for (size_t s = 0; s < stages; ++s) {
      if ((st = pipe_plan_stage_weight_bytes(plan, s, &split.weights, &stored[s])) != PIPE_OK) {
        fail("cannot work out the stages' bytes as stored", st);
        goto done;
      }
    }
    num_stored = stages;
  }
  if (json) {
    const char *text = NULL;
    if ((st = pipe_plan_describe(plan, &text)) != PIPE_OK) {
      fail("cannot describe the plan", st);
      goto done;
    }
    if (stored) print_json_with_weight_bytes(text, stored, num_stored);
    else printf("%s\n", text);
  } else if ((st = print_plan(model_path, plan, &split.weights, stored)) != PIPE_OK) {
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
  free(stored);
  free(args);
  pipe_tensor_list_destroy(in);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return rc;
}
