/* Conformance tests of text in and out through the C ABI (pipe/pipe.h, "Text", 0.14), in C, against
 * libpipe.so: tokenizers in the styles of GPT-2, Qwen2, Llama and Mistral built by
 * tests/models/text_tokenizers.py, whose folder is argv[1]. Encoding and the chat template equal
 * transformers' (c-reference-ids.txt, c-reference-chat.txt, written by that script), text survives a
 * round trip, a decode stream hands out whole UTF-8 characters only and adds up to the decode, and
 * every failure returns its status and a message without touching outputs. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <pipe/pipe.h>

static const char *g_dir;
static const char *const STYLES[] = {"gpt2", "qwen2", "llama", "mistral"};
#define NUM_STYLES (sizeof STYLES / sizeof STYLES[0])

/* tests/models/text_tokenizers.py's C_TEXT and C_CHAT. */
static const char C_TEXT[] = "Hello, w\xc3\xb6rld! \xf0\x9f\x91\x8b \xe6\x97\xa5\xe6\x9c\xac";
static const char *const CHAT_ROLES[] = {"system", "user", "assistant", "user"};
static const char *const CHAT_CONTENTS[] = {"Be brief.", "Hi \xf0\x9f\x91\x8b", "Hello!", "Bye"};

static char *path_of(const char *style, const char *file) {
  static char buf[4096];
  snprintf(buf, sizeof buf, "%s/%s%s%s", g_dir, style, file ? "/" : "", file ? file : "");
  return buf;
}

static char *read_file(const char *path, size_t *length) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  char *data = malloc(1 << 20);
  assert_non_null(data);
  size_t n = fread(data, 1, (1 << 20) - 1, f);
  fclose(f);
  data[n] = '\0';
  if (length) *length = n;
  return data;
}

static pipe_tokenizer *load(const char *style) {
  pipe_tokenizer *t = NULL;
  pipe_status s = pipe_tokenizer_load(path_of(style, NULL), &t);
  if (s != PIPE_OK) fail_msg("pipe_tokenizer_load(%s): %s", style, pipe_last_error());
  return t;
}

/* Whether `n` bytes at `s` are whole UTF-8 characters (no sequence cut at either end). */
static int valid_utf8(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > n) return 0;
    for (size_t k = 1; k < len; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return 0;
    i += len;
  }
  return 1;
}

static void encode_equals_transformers(void **state) {
  (void)state;
  for (size_t k = 0; k < NUM_STYLES; ++k) {
    pipe_tokenizer *t = load(STYLES[k]);
    const int64_t *ids = NULL;
    size_t count = 0;
    assert_int_equal(pipe_tokenizer_encode(t, C_TEXT, strlen(C_TEXT), 1, &ids, &count), PIPE_OK);
    char *reference = read_file(path_of(STYLES[k], "c-reference-ids.txt"), NULL);
    char *p = reference;
    size_t i = 0;
    for (; *p && *p != '\n'; ++i) {
      char *end;
      long long id = strtoll(p, &end, 10);
      assert_true(end != p);
      assert_true(i < count);
      if (ids[i] != id) fail_msg("%s: id %zu is %lld, transformers says %lld", STYLES[k], i, (long long)ids[i], id);
      p = end;
      while (*p == ' ') ++p;
    }
    assert_int_equal(i, count);
    free(reference);
    pipe_tokenizer_destroy(t);
  }
}

static void text_round_trips(void **state) {
  (void)state;
  static const char *const texts[] = {C_TEXT, "", "two  spaces\tand\ttabs\n\nlines   ",
                                      "def f(x):\n    return x ** 2  # \xe2\x9c\x93",
                                      "\xce\x95\xce\xbb\xce\xbb\xce\xb7\xce\xbd\xce\xb9\xce\xba\xce\xac "
                                      "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb"};
  for (size_t k = 0; k < NUM_STYLES; ++k) {
    pipe_tokenizer *t = load(STYLES[k]);
    for (size_t j = 0; j < sizeof texts / sizeof texts[0]; ++j) {
      const int64_t *lent = NULL;
      size_t count = 0;
      assert_int_equal(pipe_tokenizer_encode(t, texts[j], strlen(texts[j]), 0, &lent, &count), PIPE_OK);
      int64_t *ids = malloc((count + 1) * sizeof *ids); /* lent until this thread's next call */
      memcpy(ids, lent, count * sizeof *ids);
      const char *text = NULL;
      size_t length = 99;
      assert_int_equal(pipe_tokenizer_decode(t, ids, count, 0, &text, &length), PIPE_OK);
      assert_int_equal(length, strlen(texts[j]));
      assert_memory_equal(text, texts[j], length);
      assert_int_equal(text[length], '\0');
      free(ids);
    }
    pipe_tokenizer_destroy(t);
  }
}

static void special_and_stop_ids(void **state) {
  (void)state;
  /* Qwen2's: no bos; eos <|im_end|>, pad <|endoftext|>; generation_config.json's eos_token_id is the
   * list [<|im_end|>, <|endoftext|>]. The ids come from encoding the tokens' text. */
  pipe_tokenizer *t = load("qwen2");
  const int64_t *ids = NULL;
  size_t count = 0;
  assert_int_equal(pipe_tokenizer_encode(t, "<|im_end|><|endoftext|>", 23, 1, &ids, &count), PIPE_OK);
  assert_int_equal(count, 2);
  int64_t im_end = ids[0], endoftext = ids[1];
  int64_t bos = 7, eos = 7, pad = 7;
  assert_int_equal(pipe_tokenizer_special_ids(t, &bos, &eos, &pad), PIPE_OK);
  assert_int_equal(bos, -1);
  assert_int_equal(eos, im_end);
  assert_int_equal(pad, endoftext);
  assert_int_equal(pipe_tokenizer_special_ids(t, NULL, &eos, NULL), PIPE_OK);
  const int64_t *stop = NULL;
  assert_int_equal(pipe_tokenizer_stop_ids(t, &stop, &count), PIPE_OK);
  assert_int_equal(count, 2);
  assert_int_equal(stop[0], im_end);
  assert_int_equal(stop[1], endoftext);
  pipe_tokenizer_destroy(t);

  /* Llama's: bos <s> added by the post-processor, eos </s>, one stop id. */
  t = load("llama");
  assert_int_equal(pipe_tokenizer_encode(t, "a", 1, 1, &ids, &count), PIPE_OK);
  assert_true(count >= 2);
  int64_t first = ids[0];
  assert_int_equal(pipe_tokenizer_special_ids(t, &bos, &eos, &pad), PIPE_OK);
  assert_int_equal(bos, first);
  assert_int_equal(pad, -1);
  assert_int_equal(pipe_tokenizer_stop_ids(t, &stop, &count), PIPE_OK);
  assert_int_equal(count, 1);
  assert_int_equal(stop[0], eos);
  /* The bare folder: a tokenizer.json alone names no special token. */
  pipe_tokenizer *bare = load("bare");
  assert_int_equal(pipe_tokenizer_special_ids(bare, &bos, &eos, &pad), PIPE_OK);
  assert_true(bos == -1 && eos == -1 && pad == -1);
  assert_int_equal(pipe_tokenizer_stop_ids(bare, &stop, &count), PIPE_OK);
  assert_int_equal(count, 0);
  pipe_tokenizer_destroy(bare);
  pipe_tokenizer_destroy(t);
}

static void chat_template_equals_transformers(void **state) {
  (void)state;
  for (size_t k = 0; k < NUM_STYLES; ++k) {
    pipe_tokenizer *t = load(STYLES[k]);
    const char *text = NULL;
    size_t length = 0;
    assert_int_equal(pipe_tokenizer_apply_chat_template(t, CHAT_ROLES, CHAT_CONTENTS, 4, 0, &text, &length), PIPE_OK);
    size_t ref_length = 0;
    char *reference = read_file(path_of(STYLES[k], "c-reference-chat.txt"), &ref_length);
    if (length != ref_length || memcmp(text, reference, length) != 0)
      fail_msg("%s: chat template gave\n%s\ntransformers gives\n%s", STYLES[k], text, reference);
    free(reference);
    pipe_tokenizer_destroy(t);
  }
}

static void chat_template_errors(void **state) {
  (void)state;
  const char *text = "untouched";
  size_t length = 99;
  /* No template in the folder. */
  pipe_tokenizer *bare = load("bare");
  assert_int_equal(pipe_tokenizer_apply_chat_template(bare, CHAT_ROLES, CHAT_CONTENTS, 4, 1, &text, &length),
                   PIPE_ERR_INVALID_FORMAT);
  assert_non_null(strstr(pipe_last_error(), "no chat template"));
  assert_string_equal(text, "untouched");
  assert_int_equal(length, 99);
  pipe_tokenizer_destroy(bare);
  /* The template raises for this conversation (Llama 2's roles must alternate). */
  pipe_tokenizer *t = load("llama");
  static const char *const roles[] = {"user", "user"};
  static const char *const contents[] = {"a", "b"};
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, roles, contents, 2, 1, &text, &length),
                   PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "Conversation roles must alternate"));
  /* NULL arrays, a NULL string, a bad flag, invalid UTF-8. */
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, NULL, contents, 2, 1, &text, &length),
                   PIPE_ERR_INVALID_ARGUMENT);
  static const char *const with_null[] = {"user", NULL};
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, roles, with_null, 2, 1, &text, &length),
                   PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "contents[1] is NULL"));
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, roles, contents, 1, 2, &text, &length),
                   PIPE_ERR_INVALID_ARGUMENT);
  static const char *const bad_utf8[] = {"caf\xc3"};
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, roles, bad_utf8, 1, 1, &text, &length),
                   PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "UTF-8"));
  assert_string_equal(text, "untouched");
  pipe_tokenizer_destroy(t);
  /* The empty conversation renders (ChatML gives nothing for it, or the assistant's opening). */
  t = load("gpt2");
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, NULL, NULL, 0, 0, &text, &length), PIPE_OK);
  assert_int_equal(length, 0);
  assert_int_equal(pipe_tokenizer_apply_chat_template(t, NULL, NULL, 0, 1, &text, &length), PIPE_OK);
  assert_string_equal(text, "<|im_start|>assistant\n");
  pipe_tokenizer_destroy(t);
}

static void errors_leave_outputs_alone(void **state) {
  (void)state;
  pipe_tokenizer *t = (pipe_tokenizer *)0x1;
  assert_int_equal(pipe_tokenizer_load(NULL, &t), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_load(g_dir, NULL), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_load("/nonexistent/folder", &t), PIPE_ERR_NOT_FOUND);
  assert_non_null(strstr(pipe_last_error(), "/nonexistent/folder"));
  assert_int_equal(pipe_tokenizer_load(g_dir, &t), PIPE_ERR_NOT_FOUND); /* no tokenizer.json there */
  assert_non_null(strstr(pipe_last_error(), "tokenizer.json"));
  assert_ptr_equal(t, (pipe_tokenizer *)0x1);
  pipe_tokenizer_destroy(NULL);
  pipe_decode_stream_destroy(NULL);

  t = load("gpt2");
  const int64_t *ids = (const int64_t *)0x1;
  size_t count = 99;
  /* Invalid UTF-8: a lone continuation byte, a cut sequence, an overlong encoding. */
  static const char *const invalid[] = {"ok\x80", "caf\xc3", "\xc0\xaf"};
  for (size_t i = 0; i < 3; ++i) {
    assert_int_equal(pipe_tokenizer_encode(t, invalid[i], strlen(invalid[i]), 1, &ids, &count),
                     PIPE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(pipe_last_error(), "not valid UTF-8"));
  }
  assert_int_equal(pipe_tokenizer_encode(t, "ok", 2, 2, &ids, &count), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_encode(NULL, "ok", 2, 0, &ids, &count), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_encode(t, NULL, 2, 0, &ids, &count), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_encode(t, "ok", (size_t)1 << 40, 0, &ids, &count), PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "256 MiB"));
  assert_ptr_equal(ids, (const int64_t *)0x1);
  assert_int_equal(count, 99);
  /* NULL text of length 0 is the empty text. */
  assert_int_equal(pipe_tokenizer_encode(t, NULL, 0, 0, &ids, &count), PIPE_OK);
  assert_int_equal(count, 0);

  /* Ids outside the vocabulary. */
  int64_t vocab = 0;
  assert_int_equal(pipe_tokenizer_vocab_size(t, &vocab), PIPE_OK);
  assert_true(vocab > 256);
  const char *text = "untouched";
  size_t length = 99;
  int64_t bad[] = {5, vocab};
  assert_int_equal(pipe_tokenizer_decode(t, bad, 2, 0, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "at index 1"));
  int64_t negative[] = {-1};
  assert_int_equal(pipe_tokenizer_decode(t, negative, 1, 0, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_decode(t, NULL, 3, 0, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_decode(t, bad, (size_t)1 << 40, 0, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_decode(t, bad, 1, 3, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_string_equal(text, "untouched");
  assert_int_equal(length, 99);
  int64_t last[] = {vocab - 1};
  assert_int_equal(pipe_tokenizer_decode(t, last, 1, 0, &text, &length), PIPE_OK);
  assert_int_equal(pipe_tokenizer_vocab_size(t, NULL), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_tokenizer_stop_ids(t, NULL, &count), PIPE_ERR_INVALID_ARGUMENT);

  pipe_decode_stream *stream = (pipe_decode_stream *)0x1;
  assert_int_equal(pipe_decode_stream_create(NULL, 0, &stream), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_create(t, 5, &stream), PIPE_ERR_INVALID_ARGUMENT);
  assert_ptr_equal(stream, (pipe_decode_stream *)0x1);
  assert_int_equal(pipe_decode_stream_create(t, 0, &stream), PIPE_OK);
  text = "untouched";
  assert_int_equal(pipe_decode_stream_push(stream, vocab, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_push(NULL, 1, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_string_equal(text, "untouched");
  pipe_decode_stream_destroy(stream);
  pipe_tokenizer_destroy(t);
}

/* Every push returns whole characters; together they are the decode of all ids; a character cut
 * over several tokens (the emoji, in bytes) makes some pushes return nothing. The stream outlives
 * its tokenizer. */
static void stream_gives_whole_characters(void **state) {
  (void)state;
  /* U+1F980 U+1F389 and U+6F22 U+5B57 are not in the tokenizers' training text: they go as bytes. */
  static const char text_in[] = "a \xf0\x9f\xa6\x80\xf0\x9f\x8e\x89 \xe6\xbc\xa2\xe5\xad\x97 \xc3\xb6 end";
  for (size_t k = 0; k < NUM_STYLES; ++k) {
    pipe_tokenizer *t = load(STYLES[k]);
    const int64_t *lent = NULL;
    size_t count = 0;
    assert_int_equal(pipe_tokenizer_encode(t, text_in, strlen(text_in), 0, &lent, &count), PIPE_OK);
    int64_t ids[256];
    assert_true(count <= 256 && count > 4);
    memcpy(ids, lent, count * sizeof *ids);
    pipe_decode_stream *stream = NULL;
    assert_int_equal(pipe_decode_stream_create(t, 1, &stream), PIPE_OK);
    pipe_tokenizer_destroy(t); /* the stream keeps what it needs */
    char joined[1024] = "";
    size_t joined_len = 0, empty = 0;
    for (size_t i = 0; i < count; ++i) {
      const char *piece = NULL;
      size_t length = 0;
      assert_int_equal(pipe_decode_stream_push(stream, ids[i], &piece, &length), PIPE_OK);
      if (!valid_utf8((const unsigned char *)piece, length))
        fail_msg("%s: push %zu returned a cut character (%zu bytes)", STYLES[k], i, length);
      assert_int_equal(piece[length], '\0');
      if (length == 0) ++empty;
      assert_true(joined_len + length < sizeof joined);
      memcpy(joined + joined_len, piece, length);
      joined_len += length;
    }
    pipe_decode_stream_destroy(stream);
    joined[joined_len] = '\0';
    assert_string_equal(joined, text_in);
    if (empty == 0) fail_msg("%s: every id completed a character: the emoji were not cut into bytes", STYLES[k]);
  }
}

struct encode_job {
  pipe_tokenizer *t;
  const int64_t *reference;
  size_t count;
  int failures;
};

static void *encode_many(void *arg) {
  struct encode_job *job = arg;
  for (int i = 0; i < 200; ++i) {
    const int64_t *ids = NULL;
    size_t count = 0;
    if (pipe_tokenizer_encode(job->t, C_TEXT, strlen(C_TEXT), 1, &ids, &count) != PIPE_OK || count != job->count ||
        memcmp(ids, job->reference, count * sizeof *ids) != 0)
      ++job->failures;
    const char *text = NULL;
    size_t length = 0;
    if (pipe_tokenizer_decode(job->t, job->reference, job->count, 1, &text, &length) != PIPE_OK ||
        length != strlen(C_TEXT) || memcmp(text, C_TEXT, length) != 0)
      ++job->failures;
  }
  return NULL;
}

/* One tokenizer used by several threads at once; each thread's lent results are its own. */
static void threads_share_a_tokenizer(void **state) {
  (void)state;
  pipe_tokenizer *t = load("qwen2");
  const int64_t *lent = NULL;
  size_t count = 0;
  assert_int_equal(pipe_tokenizer_encode(t, C_TEXT, strlen(C_TEXT), 1, &lent, &count), PIPE_OK);
  int64_t reference[128];
  assert_true(count <= 128);
  memcpy(reference, lent, count * sizeof *reference);
  pthread_t threads[4];
  struct encode_job jobs[4];
  for (int i = 0; i < 4; ++i) {
    jobs[i] = (struct encode_job){t, reference, count, 0};
    assert_int_equal(pthread_create(&threads[i], NULL, encode_many, &jobs[i]), 0);
  }
  for (int i = 0; i < 4; ++i) {
    pthread_join(threads[i], NULL);
    assert_int_equal(jobs[i].failures, 0);
  }
  pipe_tokenizer_destroy(t);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s TOKENIZERS_DIR (tests/models/text_tokenizers.py's output)\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(encode_equals_transformers),    cmocka_unit_test(text_round_trips),
      cmocka_unit_test(special_and_stop_ids),          cmocka_unit_test(chat_template_equals_transformers),
      cmocka_unit_test(chat_template_errors),          cmocka_unit_test(errors_leave_outputs_alone),
      cmocka_unit_test(stream_gives_whole_characters), cmocka_unit_test(threads_share_a_tokenizer),
  };
  return cmocka_run_group_tests_name("text", tests, NULL, NULL);
}
