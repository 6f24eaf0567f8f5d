/* Create/destroy and run loops, built with AddressSanitizer: its leak checker, which sees every
 * allocation in the process (libpipe's and LibTorch's included), must find nothing left behind by
 * repeated models, plans, sessions, runs, asynchronous requests, tensor lists and failed calls.
 *   leak_loop MODELS_DIR ITERATIONS */
#include <stdio.h>
#include <stdlib.h>

#include <pipe/pipe.h>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    pipe_status st_ = (call);                                                              \
    if (st_ != PIPE_OK) {                                                                  \
      fprintf(stderr, "%s: %s (%s)\n", #call, pipe_last_error(), pipe_status_string(st_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  char model_path[4096], inputs_path[4096];
  snprintf(model_path, sizeof model_path, "%s/example_code.traced.pt", argv[1]);
  snprintf(inputs_path, sizeof inputs_path, "%s/example_code.inputs.safetensors", argv[1]);
  const int iterations = atoi(argv[2]);
  for (int i = 0; i < iterations; ++i) {
    pipe_model *model = NULL;
    pipe_plan *plan = NULL;
    pipe_plan_options *options = NULL;
    pipe_session *session = NULL;
    pipe_tensor_list *inputs = NULL, *out = NULL;
    pipe_request *request = NULL, *abandoned = NULL;
    CHECK(pipe_model_load(model_path, &model));
    CHECK(pipe_plan_options_create(&options));
    CHECK(pipe_plan_options_add_split_point(options, "lin1:end"));
    CHECK(pipe_plan_create(model, options, &plan));
    pipe_plan_options_destroy(options);
    pipe_plan_destroy(plan);
    CHECK(pipe_plan_create(model, NULL, &plan));
    pipe_session_options so = PIPE_SESSION_OPTIONS_INIT;
    so.num_microbatches = 2;
    CHECK(pipe_session_create(plan, &so, &session));
    CHECK(pipe_safetensors_read(inputs_path, &inputs));
    const DLManagedTensor *args[2];
    CHECK(pipe_tensor_list_get(inputs, 0, &args[0]));
    CHECK(pipe_tensor_list_get(inputs, 1, &args[1]));
    for (int r = 0; r < 5; ++r) {
      CHECK(pipe_session_run(session, args, 2, NULL, &out));
      DLManagedTensor *taken = NULL;
      CHECK(pipe_tensor_list_take(out, 0, &taken));
      taken->deleter(taken);
      pipe_tensor_list_destroy(out);
      out = NULL;
    }
    CHECK(pipe_session_submit(session, args, 2, NULL, &request));
    CHECK(pipe_request_wait(request, -1, &out));
    pipe_tensor_list_destroy(out);
    pipe_request_destroy(request);
    CHECK(pipe_session_submit(session, args, 2, NULL, &abandoned)); /* destroyed unwaited */
    pipe_request_destroy(abandoned);
    /* Failure paths allocate messages and partial state too. */
    pipe_model *missing = NULL;
    if (pipe_model_load("/nonexistent.pt", &missing) == PIPE_OK) return 1;
    if (pipe_session_run(session, args, 1, NULL, &out) == PIPE_OK) return 1;
    pipe_session_destroy(session);
    pipe_tensor_list_destroy(inputs);
    pipe_plan_destroy(plan);
    pipe_model_destroy(model);
  }
  printf("%d iterations, no leak reported\n", iterations);
  return 0;
}
