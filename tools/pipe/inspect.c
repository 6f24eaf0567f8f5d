/* pipe inspect MODEL: the module tree with parameter counts and bytes. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int cmd_inspect(int argc, char **argv) {
  if (argc != 1 || argv[0][0] == '-') return usage_error("inspect takes exactly one MODEL");
  pipe_model *model = NULL;
  pipe_status st = pipe_model_load(argv[0], &model);
  if (st != PIPE_OK) return fail("cannot load model", st);
  size_t count = 0;
  if ((st = pipe_model_num_modules(model, &count)) != PIPE_OK) {
    fail("cannot list the model's modules", st); /* before the next call replaces the message */
    pipe_model_destroy(model);
    return 1;
  }
  printf("%-48s %-24s %14s %12s\n", "module", "type", "parameters", "MiB");
  for (size_t i = 0; i < count; ++i) {
    const char *path = NULL, *type = NULL;
    int32_t depth = 0;
    uint64_t params = 0, bytes = 0;
    if ((st = pipe_model_module(model, i, &path, &type, &depth, &params, &bytes)) != PIPE_OK) {
      fail("cannot list the model's modules", st);
      pipe_model_destroy(model);
      return 1;
    }
    const char *leaf = strrchr(path, '.');
    leaf = depth == 0 ? "(model)" : leaf ? leaf + 1 : path;
    char label[256];
    snprintf(label, sizeof label, "%*s%s", 2 * depth, "", leaf);
    printf("%-48s %-24s %14llu %12.3f\n", label, type, (unsigned long long)params, (double)bytes / (1024.0 * 1024.0));
  }
  pipe_model_destroy(model);
  return 0;
}
