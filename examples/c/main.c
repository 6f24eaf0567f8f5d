/* The smallest complete libpipe program: load a TorchScript model, cut it into 2 stages just
 * before module blocks.2, run inputs from a safetensors file through the pipeline with 4
 * micro-batches, and compare the result with the reference output the model generator wrote.
 *
 *   example_c MODEL.pt INPUTS.safetensors REFERENCE.safetensors
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <pipe/pipe.h>

#define CHECK(call)                                                                               \
  do {                                                                                            \
    pipe_status st_ = (call);                                                                     \
    if (st_ != PIPE_OK) {                                                                         \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, pipe_last_error(), pipe_status_string(st_)); \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s MODEL.pt INPUTS.safetensors REFERENCE.safetensors\n", argv[0]);
    return 2;
  }
  pipe_model *model = NULL;
  pipe_plan *plan = NULL;
  pipe_session *session = NULL;
  pipe_tensor_list *inputs = NULL, *outputs = NULL, *reference = NULL;

  CHECK(pipe_model_load(argv[1], &model));
  pipe_plan_options *cut = NULL;
  CHECK(pipe_plan_options_create(&cut));
  CHECK(pipe_plan_options_add_split_point(cut, "blocks.2:begin"));
  CHECK(pipe_plan_create(model, cut, &plan));
  pipe_plan_options_destroy(cut);
  size_t stages = 0;
  CHECK(pipe_plan_num_stages(plan, &stages));

  pipe_session_options options = PIPE_SESSION_OPTIONS_INIT;
  options.num_microbatches = 4;
  CHECK(pipe_session_create(plan, &options, &session));

  /* Forward arguments in order, looked up by name in the input file. */
  CHECK(pipe_safetensors_read(argv[2], &inputs));
  size_t num_inputs = 0;
  CHECK(pipe_model_num_inputs(model, &num_inputs));
  const DLManagedTensor *args[16];
  if (num_inputs > 16) return 1;
  for (size_t i = 0; i < num_inputs; ++i) {
    const char *name = NULL;
    size_t index = 0;
    CHECK(pipe_model_input_name(model, i, &name));
    CHECK(pipe_tensor_list_find(inputs, name, &index));
    CHECK(pipe_tensor_list_get(inputs, index, &args[i]));
  }
  CHECK(pipe_session_run(session, args, num_inputs, NULL, &outputs));

  /* Compare "output" with the reference (float32). */
  CHECK(pipe_safetensors_read(argv[3], &reference));
  size_t got_index = 0, want_index = 0;
  CHECK(pipe_tensor_list_find(outputs, "output", &got_index));
  CHECK(pipe_tensor_list_find(reference, "output", &want_index));
  const DLManagedTensor *got = NULL, *want = NULL;
  CHECK(pipe_tensor_list_get(outputs, got_index, &got));
  CHECK(pipe_tensor_list_get(reference, want_index, &want));
  int64_t n = 1;
  for (int d = 0; d < got->dl_tensor.ndim; ++d) n *= got->dl_tensor.shape[d];
  const float *a = (const float *)((const char *)got->dl_tensor.data + got->dl_tensor.byte_offset);
  const float *b = (const float *)((const char *)want->dl_tensor.data + want->dl_tensor.byte_offset);
  double max_diff = 0;
  for (int64_t i = 0; i < n; ++i) max_diff = fmax(max_diff, fabs((double)a[i] - (double)b[i]));

  printf("libpipe %s: %zu stages, 4 micro-batches, %lld values, max |diff| vs PyTorch = %.3g\n", pipe_version(), stages,
         (long long)n, max_diff);
  int ok = max_diff <= 1e-4;
  printf("%s\n", ok ? "output matches PyTorch" : "output DIFFERS from PyTorch");

  pipe_tensor_list_destroy(reference);
  pipe_tensor_list_destroy(outputs);
  pipe_tensor_list_destroy(inputs);
  pipe_session_destroy(session);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  return ok ? 0 : 1;
}
