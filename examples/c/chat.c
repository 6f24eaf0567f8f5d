/* Chat with a language model from C: text in and out through libpipe alone. The model folder's
 * own tokenizer and chat template (libpipe reads tokenizer.json and tokenizer_config.json) turn
 * the question into token ids; the decoder, cut into 2 pipeline stages, generates greedily until
 * one of the model's stop ids; a decode stream prints the reply as its tokens arrive.
 *
 *   example_c_chat [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]
 *
 * MODEL_DIR is a Hugging Face model folder (tokenizer.json, tokenizer_config.json,
 * generation_config.json, model.safetensors) holding decoder.pt, which
 *   python -m libpipe.export_llm MODEL_DIR MODEL_DIR/decoder.pt --max-batch 1
 * writes. --prompt-ids first prints the prompt's token ids on a line of their own.
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pipe/pipe.h>

#define CHECK(call)                                                                               \
  do {                                                                                            \
    pipe_status st_ = (call);                                                                     \
    if (st_ != PIPE_OK) {                                                                         \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, pipe_last_error(), pipe_status_string(st_)); \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

static void usage(const char *argv0) {
  fprintf(stderr, "usage: %s [--max-new-tokens N] [--prompt-ids] MODEL_DIR [QUESTION]\n", argv0);
  exit(2);
}

int main(int argc, char **argv) {
  const char *dir = NULL, *question = "What is the capital of France?";
  long max_new_tokens = 64;
  int print_ids = 0, positional = 0;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--max-new-tokens") == 0 && i + 1 < argc) {
      max_new_tokens = strtol(argv[++i], NULL, 10);
      if (max_new_tokens < 1) usage(argv[0]);
    } else if (strcmp(argv[i], "--prompt-ids") == 0) {
      print_ids = 1;
    } else if (argv[i][0] == '-' || positional == 2) {
      usage(argv[0]);
    } else if (positional++ == 0) {
      dir = argv[i];
    } else {
      question = argv[i];
    }
  }
  if (dir == NULL) usage(argv[0]);

  /* The conversation through the model's chat template (SmolLM2's adds its default system turn),
   * then its ids. The template writes the special tokens as text, so encode adds none. Results
   * are lent until this thread's next libpipe call: the ids are copied before the next one. */
  pipe_tokenizer *tokenizer = NULL;
  CHECK(pipe_tokenizer_load(dir, &tokenizer));
  const char *roles[] = {"user"}, *contents[] = {question};
  const char *text = NULL;
  size_t text_length = 0;
  CHECK(pipe_tokenizer_apply_chat_template(tokenizer, roles, contents, 1, 1, &text, &text_length));
  const int64_t *lent_ids = NULL;
  size_t num_ids = 0;
  CHECK(pipe_tokenizer_encode(tokenizer, text, text_length, 0, &lent_ids, &num_ids));
  int64_t *prompt = malloc(num_ids * sizeof *prompt);
  if (prompt == NULL) return 1;
  memcpy(prompt, lent_ids, num_ids * sizeof *prompt);
  if (print_ids) {
    for (size_t i = 0; i < num_ids; ++i) printf("%s%lld", i ? " " : "", (long long)prompt[i]);
    printf("\n");
  }

  /* The decoder in 2 stages of equal layers; its weights are the checkpoint's, unchanged. */
  char path[4096];
  snprintf(path, sizeof path, "%s/decoder.pt", dir);
  pipe_model *model = NULL;
  CHECK(pipe_model_load(path, &model));
  pipe_plan_options *cut = NULL;
  CHECK(pipe_plan_options_create(&cut));
  CHECK(pipe_plan_options_set_stages(cut, 2, "uniform"));
  pipe_plan *plan = NULL;
  CHECK(pipe_plan_create(model, cut, &plan));
  pipe_plan_options_destroy(cut);
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  pipe_stage_options stage = PIPE_STAGE_OPTIONS_INIT;
  stage.weights = path;
  pipe_session_options session = PIPE_SESSION_OPTIONS_INIT;
  session.stage_options = &stage;
  pipe_generator *generator = NULL;
  CHECK(pipe_generator_create(plan, &session, NULL, &generator));

  /* Greedy (the default), ending at the model's stop ids (generation_config.json's eos). */
  pipe_generation_options options = PIPE_GENERATION_OPTIONS_INIT;
  options.max_new_tokens = max_new_tokens;
  CHECK(pipe_tokenizer_stop_ids(tokenizer, &options.stop_ids, &options.num_stop_ids));
  pipe_generation *generation = NULL;
  CHECK(pipe_generator_submit(generator, prompt, num_ids, &options, &generation));

  /* Tokens as they come: the generation's descriptor is readable while tokens wait. The decode
   * stream gives whole characters only (a token may end inside one) and skips <|im_end|>. */
  pipe_decode_stream *stream = NULL;
  CHECK(pipe_decode_stream_create(tokenizer, 1, &stream));
  struct pollfd ready = {.events = POLLIN};
  CHECK(pipe_generation_fd(generation, &ready.fd));
  for (int32_t finished = 0; !finished;) {
    int64_t tokens[64];
    size_t count = 0;
    if (poll(&ready, 1, -1) < 0) return 1;
    CHECK(pipe_generation_read(generation, tokens, 64, &count, &finished));
    for (size_t i = 0; i < count; ++i) {
      const char *piece = NULL;
      size_t piece_length = 0;
      CHECK(pipe_decode_stream_push(stream, tokens[i], &piece, &piece_length));
      fwrite(piece, 1, piece_length, stdout);
    }
    fflush(stdout);
  }
  printf("\n");
  CHECK(pipe_generation_wait(generation, 0)); /* how it ended: a stop id or its length is PIPE_OK */

  pipe_decode_stream_destroy(stream);
  pipe_generation_destroy(generation);
  pipe_generator_destroy(generator);
  pipe_plan_destroy(plan);
  pipe_model_destroy(model);
  pipe_tokenizer_destroy(tokenizer);
  free(prompt);
  return 0;
}
