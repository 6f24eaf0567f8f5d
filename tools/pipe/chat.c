/* pipe chat MODEL_DIR_OR_DECODER [SPLIT] [options]: a conversation with a decoder, through the model
 * folder's tokenizer and chat template (pipe.h, "Text") and the C ABI's generator ("Generation").
 *
 * Each message is appended to the conversation, the whole conversation is rendered with the chat
 * template and submitted; the generator finds the earlier turns in the cache slot the previous reply
 * left (prefix reuse), so only the new message is prefilled. The reply streams as it comes
 * (pipe_generation_fd, pipe_decode_stream_push: whole UTF-8 characters) and joins the conversation.
 *
 * On a terminal (stdin a tty): a "> " prompt, Ctrl-C stops the reply being written (the generation is
 * cancelled; what was shown stays in the conversation) or, at the prompt, drops the line typed, and
 * Ctrl-D ends the chat. Otherwise: one message per line of stdin (empty lines skipped), each reply
 * on one line of stdout (a reply's own line breaks kept), nothing else on stdout; the end of input
 * ends the chat. Notes (a reply cut short, --stats) go to stderr. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

/* The messages so far, each role and content owned here. */
typedef struct {
  char **roles;
  char **contents;
  size_t count;
  size_t capacity;
} conversation;

typedef struct {
  int has_max_new_tokens;
  int greedy;
  const char *sampling_flag;
  int stats;
  const char *system;
  const char *tokenizer_flag;
  pipe_generation_options generation;
  pipe_generator_options generator;
  /* what MODEL_DIR_OR_DECODER resolved to */
  char decoder[PATH_MAX];
  char weights[PATH_MAX];
  char tokenizer_dir[PATH_MAX];
  pipe_tokenizer *tokenizer;
  const int64_t *stop_ids; /* owned by the tokenizer */
  size_t num_stop_ids;
  int64_t max_len; /* the decoder's tokens per sequence */
  int terminal;    /* stdin is a terminal */
} chat_args;

/* ---- Ctrl-C: the handler writes a byte to a pipe that the prompt and the reply's loop poll ---- */

static int interrupt_pipe[2] = {-1, -1};

static void on_interrupt(int signal_number) {
  (void)signal_number;
  int saved = errno;
  char byte = 1;
  ssize_t ignored = write(interrupt_pipe[1], &byte, 1); /* full pipe: a Ctrl-C is pending already */
  (void)ignored;
  errno = saved;
}

/* 1 if Ctrl-C was pressed since the last call (the pipe drained), else 0. */
static int take_interrupt(void) {
  if (interrupt_pipe[0] < 0) return 0;
  char bytes[64];
  int any = 0;
  while (read(interrupt_pipe[0], bytes, sizeof bytes) > 0) any = 1;
  return any;
}

static int setup_interrupts(void) {
  if (pipe(interrupt_pipe) != 0) {
    fprintf(stderr, "pipe: error: chat: cannot make a pipe for Ctrl-C: %s\n", strerror(errno));
    return 1;
  }
  for (int k = 0; k < 2; ++k) {
    fcntl(interrupt_pipe[k], F_SETFL, fcntl(interrupt_pipe[k], F_GETFL) | O_NONBLOCK);
    fcntl(interrupt_pipe[k], F_SETFD, FD_CLOEXEC);
  }
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART; /* libpipe's threads never see EINTR; poll() here wakes through the pipe */
  if (sigaction(SIGINT, &action, NULL) != 0) {
    fprintf(stderr, "pipe: error: chat: cannot handle Ctrl-C: %s\n", strerror(errno));
    return 1;
  }
  return 0;
}

/* SIGINT blocked (1) or not (0) on this thread: blocked while libpipe starts its threads, which inherit the
 * mask, so that the handler only ever runs on this one. */
static void block_interrupts(int block) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  pthread_sigmask(block ? SIG_BLOCK : SIG_UNBLOCK, &set, NULL);
}

/* ---- reading messages ---- */

typedef struct {
  char *data;
  size_t length, capacity;
  int eof;
} line_reader;

#define READ_LINE_OK 0
#define READ_LINE_EOF 1
#define READ_LINE_INTERRUPTED 2
#define READ_LINE_ERROR 3

/* The next line of stdin into *line (NUL-terminated, without its line break; owned by the reader until
 * the next call). Waits on stdin and on Ctrl-C at once. */
static int read_line(line_reader *r, char **line, size_t *consumed) {
  for (;;) {
    if (*consumed) { /* the line handed out last time */
      memmove(r->data, r->data + *consumed, r->length - *consumed);
      r->length -= *consumed;
      *consumed = 0;
    }
    char *newline = r->length ? memchr(r->data, '\n', r->length) : NULL;
    if (newline || (r->eof && r->length)) {
      size_t n = newline ? (size_t)(newline - r->data) : r->length;
      *consumed = newline ? n + 1 : n;
      if (n && r->data[n - 1] == '\r') --n;
      r->data[n] = '\0'; /* the '\n', or room kept below */
      *line = r->data;
      return READ_LINE_OK;
    }
    if (r->eof) return READ_LINE_EOF;
    struct pollfd fds[2] = {{STDIN_FILENO, POLLIN, 0}, {interrupt_pipe[0], POLLIN, 0}};
    int n = poll(fds, interrupt_pipe[0] >= 0 ? 2 : 1, -1);
    if (n < 0 && errno != EINTR) return READ_LINE_ERROR;
    if (take_interrupt()) {
      r->length = 0; /* the terminal dropped the line being typed; so does this */
      return READ_LINE_INTERRUPTED;
    }
    if (n <= 0 || !(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    if (r->capacity - r->length < 4096 + 1) {
      size_t grown = r->capacity ? 2 * r->capacity : 8192;
      char *data = realloc(r->data, grown);
      if (!data) return READ_LINE_ERROR;
      r->data = data;
      r->capacity = grown;
    }
    ssize_t got = read(STDIN_FILENO, r->data + r->length, r->capacity - r->length - 1);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got < 0) return READ_LINE_ERROR;
    if (got == 0) r->eof = 1;
    r->length += (size_t)got;
  }
}

/* ---- the conversation ---- */

static char *copy_string(const char *s, size_t length) {
  char *copy = malloc(length + 1);
  if (!copy) return NULL;
  memcpy(copy, s, length);
  copy[length] = '\0';
  return copy;
}

/* 0, or 1 when out of memory (reported). */
static int add_message(conversation *c, const char *role, const char *content, size_t length) {
  if (c->count == c->capacity) {
    size_t grown = c->capacity ? 2 * c->capacity : 16;
    char **roles = realloc(c->roles, grown * sizeof *roles);
    if (roles) c->roles = roles;
    char **contents = roles ? realloc(c->contents, grown * sizeof *contents) : NULL;
    if (!contents) {
      fprintf(stderr, "pipe: error: out of memory\n");
      return 1;
    }
    c->contents = contents;
    c->capacity = grown;
  }
  c->roles[c->count] = copy_string(role, strlen(role));
  c->contents[c->count] = copy_string(content, length);
  if (!c->roles[c->count] || !c->contents[c->count]) {
    free(c->roles[c->count]);
    free(c->contents[c->count]);
    fprintf(stderr, "pipe: error: out of memory\n");
    return 1;
  }
  ++c->count;
  return 0;
}

static void drop_last_message(conversation *c) {
  if (!c->count) return;
  --c->count;
  free(c->roles[c->count]);
  free(c->contents[c->count]);
}

static void free_conversation(conversation *c) {
  while (c->count) drop_last_message(c);
  free(c->roles);
  free(c->contents);
}

/* ---- arguments ---- */

/* Consumes argv[*i] (and its value) if it is one of chat's own flags: 1 if consumed, 0 if not one of
 * them, 2 after a usage error. */
static int parse_chat_arg(int argc, char **argv, int *i, chat_args *c, session_args *s) {
  static const char *const flags[] = {
      "--max-new-tokens", "--temperature",       "--top-k", "--top-p", "--seed", "--system", "--tokenizer",
      "--prefill-chunk",  "--threads-per-stage", "--stats"};
  const char *a = argv[*i];
  size_t k = 0;
  while (k < sizeof flags / sizeof *flags && strcmp(a, flags[k]) != 0) ++k;
  if (k == sizeof flags / sizeof *flags) return 0;
  if (strcmp(a, "--stats") == 0) {
    c->stats = 1;
    return 1;
  }
  if (*i + 1 >= argc) return usage_error("chat: %s needs a value", a);
  const char *v = argv[++*i];
  pipe_generation_options *o = &c->generation;
  switch (k) {
    case 0: c->has_max_new_tokens = 1; return parse_int64_at_least("chat", a, v, 1, &o->max_new_tokens) ? 2 : 1;
    case 1:
      if (parse_number("chat", a, v, &o->temperature)) return 2;
      if (o->temperature < 0) return usage_error("chat: --temperature must be 0 (greedy) or more, got %s", v);
      c->greedy = o->temperature == 0;
      return 1;
    case 2: c->sampling_flag = a; return parse_int64_at_least("chat", a, v, 0, &o->top_k) ? 2 : 1;
    case 3:
      c->sampling_flag = a;
      if (parse_number("chat", a, v, &o->top_p)) return 2;
      if (!(o->top_p > 0 && o->top_p <= 1)) return usage_error("chat: --top-p must be in (0, 1], got %s", v);
      return 1;
    case 4: return parse_seed("chat", v, &o->seed) ? 2 : 1;
    case 5: c->system = v; return 1;
    case 6: c->tokenizer_flag = v; return 1;
    case 7: return parse_int64_at_least("chat", a, v, 1, &c->generator.prefill_chunk) ? 2 : 1;
    default:
      if (parse_int(a, v, &s->options.threads_per_stage)) return 2;
      if (s->options.threads_per_stage < 0)
        return usage_error("chat: --threads-per-stage must be 0 (libpipe decides) or more, got %s", v);
      return 1;
  }
}

static int is_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* MODEL_DIR_OR_DECODER: a Hugging Face model folder holding a decoder exported into it (decoder.pt, else
 * decoder.pt2; the weights model.safetensors.index.json or model.safetensors, the tokenizer the folder's),
 * or a decoder file (the tokenizer from --tokenizer, else the folder of --weights). --weights and
 * --tokenizer override what the folder gives. 0, 1 after reporting, 2 after a usage error. */
static int resolve_model(const char *arg, chat_args *c, split_args *split) {
  struct stat st;
  if (stat(arg, &st) != 0) {
    fprintf(stderr,
            "pipe: error: chat: %s: %s; give a Hugging Face model folder with a decoder exported into it, or a "
            "decoder file (.pt or .pt2) with --weights\n",
            arg, strerror(errno));
    return 1;
  }
  if (S_ISDIR(st.st_mode)) {
    static const char *const decoders[] = {"decoder.pt", "decoder.pt2"};
    c->decoder[0] = '\0';
    for (size_t k = 0; k < 2 && !c->decoder[0]; ++k) {
      snprintf(c->decoder, sizeof c->decoder, "%s/%s", arg, decoders[k]);
      if (!is_file(c->decoder)) c->decoder[0] = '\0';
    }
    if (!c->decoder[0]) {
      fprintf(stderr,
              "pipe: error: chat: %s holds no decoder (decoder.pt or decoder.pt2); export one into it once with "
              "'python -m libpipe.export_llm %s %s/decoder.pt --max-seq-len 4096 --max-batch 1' (libpipe's Python "
              "package), or give a decoder file: pipe chat DECODER.pt --weights %s/model.safetensors\n",
              arg, arg, arg, arg);
      return 1;
    }
    if (!split->weights.weights) {
      static const char *const checkpoints[] = {"model.safetensors.index.json", "model.safetensors"};
      for (size_t k = 0; k < 2 && !split->weights.weights; ++k) {
        snprintf(c->weights, sizeof c->weights, "%s/%s", arg, checkpoints[k]);
        if (is_file(c->weights)) split->weights.weights = c->weights;
      }
    }
    snprintf(c->tokenizer_dir, sizeof c->tokenizer_dir, "%s", c->tokenizer_flag ? c->tokenizer_flag : arg);
    return 0;
  }
  snprintf(c->decoder, sizeof c->decoder, "%s", arg);
  if (c->tokenizer_flag) {
    snprintf(c->tokenizer_dir, sizeof c->tokenizer_dir, "%s", c->tokenizer_flag);
  } else if (split->weights.weights) {
    snprintf(c->tokenizer_dir, sizeof c->tokenizer_dir, "%s", split->weights.weights);
    if (!is_dir(c->tokenizer_dir)) {
      char *slash = strrchr(c->tokenizer_dir, '/');
      if (slash) *slash = '\0';
      else snprintf(c->tokenizer_dir, sizeof c->tokenizer_dir, ".");
    }
  } else {
    return usage_error(
        "chat: %s is a decoder file; chat needs the model's tokenizer: give --tokenizer DIR (a Hugging Face "
        "model folder) or --weights from that folder, or give the folder itself with the decoder exported into it",
        arg);
  }
  return 0;
}

/* Loads the tokenizer and checks that its folder has a chat template. 0, or 1 after reporting. */
static int load_tokenizer(chat_args *c) {
  pipe_status st = pipe_tokenizer_load(c->tokenizer_dir, &c->tokenizer);
  if (st != PIPE_OK) return fail("chat: cannot load the tokenizer", st);
  const char *role = "user", *content = "Hello", *text = NULL;
  size_t length = 0;
  st = pipe_tokenizer_apply_chat_template(c->tokenizer, &role, &content, 1, 1, &text, &length);
  if (st == PIPE_ERR_INVALID_FORMAT && strstr(pipe_last_error(), "no chat template")) {
    fprintf(stderr,
            "pipe: error: chat: %s has no chat template (tokenizer_config.json's chat_template or "
            "chat_template.jinja), which chat needs to put a conversation together; for text in and out without "
            "one, use pipe generate --prompt TEXT\n",
            c->tokenizer_dir);
    return 1;
  }
  if (st != PIPE_OK) return fail("chat: cannot apply the chat template", st);
  st = pipe_tokenizer_stop_ids(c->tokenizer, &c->stop_ids, &c->num_stop_ids);
  if (st != PIPE_OK) return fail("chat: cannot read the tokenizer's stop ids", st);
  return 0;
}

/* ---- one turn ---- */

typedef struct {
  char *text; /* the reply as shown, NUL-terminated */
  size_t length, capacity;
} text_buffer;

static int append_text(text_buffer *b, const char *text, size_t length) {
  if (b->length + length + 1 > b->capacity) {
    size_t grown = b->capacity ? b->capacity : 256;
    while (grown < b->length + length + 1) grown *= 2;
    char *data = realloc(b->text, grown);
    if (!data) {
      fprintf(stderr, "pipe: error: out of memory\n");
      return 1;
    }
    b->text = data;
    b->capacity = grown;
  }
  memcpy(b->text + b->length, text, length);
  b->length += length;
  b->text[b->length] = '\0';
  return 0;
}

static int is_stop_id(const chat_args *c, int64_t id) {
  for (size_t k = 0; k < c->num_stop_ids; ++k)
    if (c->stop_ids[k] == id) return 1;
  return 0;
}

#define TURN_OK 0
#define TURN_FAILED 1  /* reported; the chat cannot go on */
#define TURN_REFUSED 2 /* reported; this message was not sent (on a terminal the chat goes on) */

/* The whole conversation rendered and encoded into *ids (a fresh array). */
static int encode_conversation(const chat_args *c, const conversation *conv, int64_t **ids, size_t *count) {
  const char *text = NULL;
  size_t length = 0;
  pipe_status st =
      pipe_tokenizer_apply_chat_template(c->tokenizer, (const char *const *)conv->roles,
                                         (const char *const *)conv->contents, conv->count, 1, &text, &length);
  if (st != PIPE_OK) {
    fail("chat: cannot apply the chat template to this message", st);
    return TURN_REFUSED; /* e.g. a message that is not UTF-8 */
  }
  char *rendered = copy_string(text, length); /* lent until the next call, which encode is */
  if (!rendered) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return TURN_FAILED;
  }
  const int64_t *encoded = NULL;
  st = pipe_tokenizer_encode(c->tokenizer, rendered, length, 0, &encoded, count);
  free(rendered);
  if (st != PIPE_OK) {
    fail("chat: cannot encode the conversation", st);
    return TURN_REFUSED;
  }
  *ids = malloc((*count ? *count : 1) * sizeof **ids);
  if (!*ids) {
    fprintf(stderr, "pipe: error: out of memory\n");
    return TURN_FAILED;
  }
  memcpy(*ids, encoded, *count * sizeof **ids);
  return TURN_OK;
}

static void print_stats(const pipe_generation_info *info) {
  double per_s = info->mean_inter_token_ms > 0 ? 1000.0 / info->mean_inter_token_ms : 0.0;
  fprintf(stderr, "[%lld tokens, %.1f tokens/s, first token after %.0f ms, %lld of %lld prompt tokens cached]\n",
          (long long)info->generated_tokens, per_s,
          info->time_to_first_token_ms > 0 ? info->time_to_first_token_ms : 0.0, (long long)info->cached_tokens,
          (long long)info->prompt_tokens);
}

/* Streams the reply of `generation` to stdout, token by token, until it finishes or Ctrl-C stops it.
 * The reply as shown goes into `reply`; *stopped says whether Ctrl-C stopped it. */
static int stream_reply(chat_args *c, pipe_generation *generation, text_buffer *reply, int *stopped) {
  int fd = -1;
  pipe_status st = pipe_generation_fd(generation, &fd);
  if (st != PIPE_OK) return fail("chat: cannot watch the reply", st);
  pipe_decode_stream *stream = NULL;
  if ((st = pipe_decode_stream_create(c->tokenizer, 1, &stream)) != PIPE_OK)
    return fail("chat: cannot decode the reply", st);
  int64_t tokens[256];
  int rc = TURN_OK;
  *stopped = 0;
  for (int32_t finished = 0; !finished && rc == TURN_OK;) {
    struct pollfd fds[2] = {{fd, POLLIN, 0}, {interrupt_pipe[0], POLLIN, 0}};
    int n = poll(fds, interrupt_pipe[0] >= 0 ? 2 : 1, -1);
    if (n < 0 && errno != EINTR) {
      fprintf(stderr, "pipe: error: chat: cannot wait for the reply: %s\n", strerror(errno));
      rc = TURN_FAILED;
      break;
    }
    if (take_interrupt() && !*stopped) {
      *stopped = 1; /* the rest is not shown; the generation ends at once or when its step returns */
      if ((st = pipe_generation_cancel(generation)) != PIPE_OK) rc = fail("chat: cannot stop the reply", st);
      fflush(stdout);
      fputs(c->terminal ? "\n[reply stopped]" : "[reply stopped]\n", stderr);
      fflush(stderr);
    }
    size_t count = 0;
    if ((st = pipe_generation_read(generation, tokens, sizeof tokens / sizeof *tokens, &count, &finished)) != PIPE_OK) {
      rc = fail("chat: cannot read the reply", st);
      break;
    }
    for (size_t k = 0; k < count && !*stopped && rc == TURN_OK; ++k) {
      if (is_stop_id(c, tokens[k])) continue; /* the last token; never shown or kept */
      const char *text = NULL;
      size_t length = 0;
      if ((st = pipe_decode_stream_push(stream, tokens[k], &text, &length)) != PIPE_OK) {
        rc = fail("chat: cannot decode the reply", st);
        break;
      }
      fwrite(text, 1, length, stdout);
      if (append_text(reply, text, length)) rc = TURN_FAILED;
    }
    fflush(stdout);
  }
  /* What the stream still holds (a character never completed, as U+FFFD) ends the reply. */
  if (rc == TURN_OK && !*stopped) {
    const char *text = NULL;
    size_t length = 0;
    if ((st = pipe_decode_stream_flush(stream, &text, &length)) != PIPE_OK) {
      rc = fail("chat: cannot decode the reply", st);
    } else {
      fwrite(text, 1, length, stdout);
      rc = append_text(reply, text, length) ? TURN_FAILED : TURN_OK;
    }
  }
  pipe_decode_stream_destroy(stream);
  return rc;
}

/* Sends the conversation (its last message the user's) and streams the reply, which joins it. */
static int take_turn(chat_args *c, pipe_generator *generator, conversation *conv, uint64_t turn) {
  int64_t *ids = NULL;
  size_t count = 0;
  int rc = encode_conversation(c, conv, &ids, &count);
  if (rc != TURN_OK) return rc;
  if ((int64_t)count >= c->max_len) {
    free(ids);
    fprintf(stderr,
            "pipe: error: chat: the conversation no longer fits the decoder: with this message it is %zu tokens "
            "and the decoder holds %lld per sequence, a reply included (its --max-seq-len); the message was not "
            "sent. Start a new chat, or export the decoder again with a larger --max-seq-len\n",
            count, (long long)c->max_len);
    return TURN_REFUSED;
  }
  pipe_generation_options o = c->generation;
  o.seed = c->generation.seed + turn;
  o.stop_ids = c->stop_ids;
  o.num_stop_ids = c->num_stop_ids;
  if (!c->has_max_new_tokens) o.max_new_tokens = c->max_len; /* no limit: the sequence ends when the cache is full */
  pipe_generation *generation = NULL;
  pipe_status st = pipe_generator_submit(generator, ids, count, &o, &generation);
  free(ids);
  if (st != PIPE_OK) {
    fail("chat: cannot submit the conversation", st);
    return TURN_FAILED;
  }
  text_buffer reply = {NULL, 0, 0};
  int stopped = 0;
  rc = stream_reply(c, generation, &reply, &stopped);
  if (rc == TURN_OK) {
    st = pipe_generation_wait(generation, -1); /* finished already, or its step returns soon */
    if (st != PIPE_OK && !(stopped && st == PIPE_ERR_CANCELLED)) rc = fail("chat: the reply failed", st);
  }
  pipe_generation_info info = PIPE_GENERATION_INFO_INIT;
  if (rc == TURN_OK && (st = pipe_generation_get_info(generation, &info)) != PIPE_OK)
    rc = fail("chat: cannot read the reply's progress", st);
  pipe_generation_destroy(generation);
  if (rc == TURN_OK) {
    fputc('\n', stdout);
    fflush(stdout);
    if (info.finish_reason == PIPE_FINISH_LENGTH && !stopped) {
      if (info.prompt_tokens + info.generated_tokens >= c->max_len)
        fprintf(stderr,
                "[reply cut: the conversation filled the decoder's %lld tokens per sequence (its --max-seq-len)]\n",
                (long long)c->max_len);
      else fprintf(stderr, "[reply cut at %lld tokens (--max-new-tokens)]\n", (long long)info.generated_tokens);
    }
    if (c->stats) print_stats(&info);
    fflush(stderr);
    if (c->terminal) fputc('\n', stdout); /* a blank line before the next prompt */
    rc = add_message(conv, "assistant", reply.text ? reply.text : "", reply.length) ? TURN_FAILED : TURN_OK;
  }
  free(reply.text);
  return rc;
}

/* Reads messages and answers them until the end of input (or Ctrl-D). The exit code. */
static int converse(chat_args *c, pipe_generator *generator) {
  conversation conv = {NULL, NULL, 0, 0};
  line_reader reader = {NULL, 0, 0, 0};
  size_t consumed = 0;
  int rc = 0;
  if (c->system && add_message(&conv, "system", c->system, strlen(c->system))) rc = 1;
  for (uint64_t turn = 0; rc == 0;) {
    if (c->terminal) {
      fputs("> ", stdout);
      fflush(stdout);
    }
    char *line = NULL;
    int got = read_line(&reader, &line, &consumed);
    if (got == READ_LINE_EOF) {
      if (c->terminal) fputc('\n', stdout); /* the shell's prompt on a line of its own */
      break;
    }
    if (got == READ_LINE_INTERRUPTED) {
      fputs("\n(Ctrl-D ends the chat)\n", stderr);
      continue;
    }
    if (got == READ_LINE_ERROR) {
      fprintf(stderr, "pipe: error: chat: cannot read the next message: %s\n", strerror(errno));
      rc = 1;
      break;
    }
    if (line[strspn(line, " \t\r\f\v")] == '\0') continue; /* empty lines are skipped */
    if (add_message(&conv, "user", line, strlen(line))) {
      rc = 1;
      break;
    }
    int turn_rc = take_turn(c, generator, &conv, turn);
    if (turn_rc == TURN_OK) {
      ++turn;
    } else {
      drop_last_message(&conv); /* the user's, not answered */
      /* On a terminal the user may go on; a script's next lines would answer the wrong messages. */
      if (turn_rc == TURN_FAILED || !c->terminal) rc = 1;
    }
  }
  free(reader.data);
  free_conversation(&conv);
  return rc;
}

int cmd_chat(int argc, char **argv) {
  const char *model_arg = NULL;
  split_args split = SPLIT_ARGS_INIT;
  session_args session;
  init_session_args(&session);
  chat_args c;
  memset(&c, 0, sizeof c);
  pipe_generation_options generation = PIPE_GENERATION_OPTIONS_INIT;
  pipe_generator_options generator = PIPE_GENERATOR_OPTIONS_INIT;
  c.generation = generation;
  c.generator = generator;
  c.greedy = 1;
  for (int i = 0; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--microbatches") == 0 || strcmp(a, "--microbatching") == 0)
      return usage_error("chat: %s does not apply: each generation step is one micro-batch", a);
    int r = parse_split_arg(argc, argv, &i, &split);
    if (r == 0) r = parse_session_arg(argc, argv, &i, "chat", &session);
    if (r == 0) r = parse_chat_arg(argc, argv, &i, &c, &session);
    if (r == 2) return 2;
    if (r == 1) continue;
    if (a[0] == '-') return usage_error("chat: unknown option '%s'", a);
    if (model_arg) return usage_error("chat: unexpected argument '%s' (one message per line comes on stdin)", a);
    model_arg = a;
  }
  if (!model_arg)
    return usage_error(
        "chat: MODEL_DIR_OR_DECODER is required (a model folder with a decoder exported into it, or a "
        "decoder file with --weights)");
  if (c.greedy && c.sampling_flag)
    return usage_error("chat: %s samples, which needs --temperature T above 0 (without it, replies are greedy)",
                       c.sampling_flag);
  if (split.policy && strcmp(split.policy, "time") == 0)
    return usage_error(
        "chat: --policy time measures the model on inputs, which chat does not take; use uniform or params, or "
        "--split-at between decoder layers");
  if (check_split_args("chat", &split) || check_session_args("chat", &session)) return 2;
  if (session.launched && session.launch.rank != 0) return serve_launched_rank(&session);

  int rc = resolve_model(model_arg, &c, &split);
  if (rc != 0) return rc;
  if (load_tokenizer(&c) != 0) {
    pipe_tokenizer_destroy(c.tokenizer);
    return 1;
  }
  c.terminal = isatty(STDIN_FILENO);
  if (c.terminal) {
    /* While loading, Ctrl-C ends the command as usual; this thread (and the threads libpipe starts now, which
     * inherit its mask) leaves it to the others until the handler is in place. */
    session.workers_ignore_interrupt = 1;
    block_interrupts(1);
    fprintf(stderr, "pipe chat: loading %s ...\n", c.decoder);
  }
  rc = 1;
  pipeline p;
  if (open_generator(&p, c.decoder, &split, &session, &c.generator) == 0) {
    pipe_generator_info info = PIPE_GENERATOR_INFO_INIT;
    pipe_status st = pipe_generator_get_info(p.generator, &info);
    if (st != PIPE_OK) {
      fail("chat: cannot read what the decoder offers", st);
    } else if (c.terminal && setup_interrupts() != 0) {
      /* reported */
    } else if (c.terminal && (block_interrupts(0), take_interrupt())) {
      fputc('\n', stderr); /* Ctrl-C while the model loaded, held back until now: the user is leaving */
      rc = 130;
    } else {
      c.max_len = info.max_len;
      if (c.terminal)
        fprintf(stderr,
                "pipe chat: ready (%lld tokens per conversation). Type a message and press Enter; Ctrl-C stops a "
                "reply, Ctrl-D ends the chat.\n",
                (long long)c.max_len);
      rc = converse(&c, p.generator);
      if (rc == 0 && c.stats) {
        pipe_generator_stats stats = PIPE_GENERATOR_STATS_INIT;
        if ((st = pipe_generator_get_stats(p.generator, &stats)) != PIPE_OK) {
          rc = fail("chat: cannot read the generator's statistics", st);
        } else {
          fprintf(stderr, "[chat: %llu replies, %llu tokens, %.1f tokens/s, %llu prompt tokens cached of %llu]\n",
                  (unsigned long long)stats.sequences_finished, (unsigned long long)stats.generated_tokens,
                  stats.tokens_per_s, (unsigned long long)stats.cached_prompt_tokens,
                  (unsigned long long)(stats.prompt_tokens + stats.cached_prompt_tokens));
        }
      }
    }
    close_pipeline(&p);
  }
  block_interrupts(0);
  pipe_tokenizer_destroy(c.tokenizer);
  return rc;
}
