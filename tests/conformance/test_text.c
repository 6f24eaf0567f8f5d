/* Conformance tests of text in and out through the C ABI (pipe/pipe.h, "Text", 0.14), in C, against
 * libpipe.so: tokenizers in the styles of GPT-2, Qwen2, Llama and Mistral built by
 * tests/models/text_tokenizers.py, whose folder is argv[1]. Encoding and the chat template equal
 * transformers' (c-reference-ids.txt, c-reference-chat.txt, written by that script), text survives a
 * round trip, a decode stream hands out whole UTF-8 characters only and, with its flush, adds up to
 * the decode (ids cut inside a character, clean_up_tokenization_spaces and decoders that look at
 * neighbouring tokens included), and every failure returns its status and a message without
 * touching outputs. With a second argument, SmolLM2's model folder (tests/models/smollm2.py), the
 * stream is checked on its tokenizer too. */
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
static const char *g_smollm2; /* NULL: not given */
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

static pipe_tokenizer *load_folder(const char *dir) {
  pipe_tokenizer *t = NULL;
  pipe_status s = pipe_tokenizer_load(dir, &t);
  if (s != PIPE_OK) fail_msg("pipe_tokenizer_load(%s): %s", dir, pipe_last_error());
  return t;
}

static pipe_tokenizer *load(const char *style) { return load_folder(path_of(style, NULL)); }

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
  length = 99;
  assert_int_equal(pipe_decode_stream_push(stream, vocab, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_push(NULL, 1, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_flush(NULL, &text, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_flush(stream, NULL, &length), PIPE_ERR_INVALID_ARGUMENT);
  assert_int_equal(pipe_decode_stream_flush(stream, &text, NULL), PIPE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(pipe_last_error(), "pipe_decode_stream_flush"));
  assert_string_equal(text, "untouched");
  assert_int_equal(length, 99);
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
    const char *tail = NULL;
    size_t tail_length = 99;
    assert_int_equal(pipe_decode_stream_flush(stream, &tail, &tail_length), PIPE_OK);
    assert_int_equal(tail_length, 0); /* the text ends with a whole character: nothing held back */
    assert_string_equal(tail, "");
    pipe_decode_stream_destroy(stream);
    joined[joined_len] = '\0';
    assert_string_equal(joined, text_in);
    if (empty == 0) fail_msg("%s: every id completed a character: the emoji were not cut into bytes", STYLES[k]);
  }
}

/* ---- flush: pieces and the flush put together are the decode -------------------------------- */

#define FFFD "\xef\xbf\xbd"

/* A growing byte string. */
struct text {
  char *data;
  size_t length, capacity;
};

static void text_append(struct text *t, const char *bytes, size_t n) {
  if (n > ((size_t)1 << 30)) abort(); /* never: a test's texts are small (and the bound keeps GCC's checks quiet) */
  if (t->length + n + 1 > t->capacity) {
    t->capacity = 2 * (t->length + n + 1);
    t->data = realloc(t->data, t->capacity);
    assert_non_null(t->data);
  }
  memcpy(t->data + t->length, bytes, n);
  t->length += n;
  t->data[t->length] = '\0';
}

static int ends_with(const char *s, size_t n, const char *suffix) {
  size_t k = strlen(suffix);
  return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

/* pipe_tokenizer_decode of ids, copied. */
static struct text decoded(pipe_tokenizer *t, const int64_t *ids, size_t count, int32_t skip) {
  const char *lent = NULL;
  size_t length = 0;
  if (pipe_tokenizer_decode(t, ids, count, skip, &lent, &length) != PIPE_OK)
    fail_msg("pipe_tokenizer_decode: %s", pipe_last_error());
  struct text out = {0};
  text_append(&out, lent, length);
  return out;
}

/* What a fresh stream's pushes give for ids (*pushed, copied) and then its flush (*tail). A second
 * flush gives nothing; every push gives whole characters. */
static void stream_ids(pipe_tokenizer *t, const int64_t *ids, size_t count, int32_t skip, struct text *pushed,
                       struct text *tail) {
  pipe_decode_stream *stream = NULL;
  assert_int_equal(pipe_decode_stream_create(t, skip, &stream), PIPE_OK);
  *pushed = (struct text){0};
  *tail = (struct text){0};
  text_append(pushed, "", 0);
  for (size_t i = 0; i < count; ++i) {
    const char *piece = NULL;
    size_t length = 0;
    if (pipe_decode_stream_push(stream, ids[i], &piece, &length) != PIPE_OK)
      fail_msg("pipe_decode_stream_push: %s", pipe_last_error());
    if (!valid_utf8((const unsigned char *)piece, length)) fail_msg("push %zu returned a cut character", i);
    text_append(pushed, piece, length);
  }
  const char *lent = NULL;
  size_t length = 99;
  assert_int_equal(pipe_decode_stream_flush(stream, &lent, &length), PIPE_OK);
  assert_int_equal(lent[length], '\0');
  text_append(tail, lent, length);
  assert_int_equal(pipe_decode_stream_flush(stream, &lent, &length), PIPE_OK);
  assert_int_equal(length, 0);
  pipe_decode_stream_destroy(stream);
}

/* What pipe.h says a stream's pushes and flush give for ids: their decode, unless it does not begin
 * with the text of the ids up to the last one that gave text (a text ending with a whole character,
 * longer than the text given before); a byte-fallback decoder makes U+FFFD of every byte of a run
 * of byte tokens that ends inside a character, characters whole before included. Then: that text,
 * and the ids after it decoded alone. */
static struct text expected_stream_text(pipe_tokenizer *t, const int64_t *ids, size_t count, int32_t skip) {
  struct text all = decoded(t, ids, count, skip);
  size_t m = 0; /* the ids that gave text last */
  struct text given = decoded(t, ids, 0, skip);
  for (size_t k = 1; k < count; ++k) {
    struct text now = decoded(t, ids, k, skip);
    if (!ends_with(now.data, now.length, FFFD) && now.length > given.length) {
      m = k;
      free(given.data);
      given = now;
    } else {
      free(now.data);
    }
  }
  free(given.data);
  struct text upto = decoded(t, ids, m, skip);
  if (all.length >= upto.length && memcmp(all.data, upto.data, upto.length) == 0) {
    free(upto.data);
    return all;
  }
  free(all.data);
  struct text rest = decoded(t, ids + m, count - m, skip);
  text_append(&upto, rest.data, rest.length);
  free(rest.data);
  return upto;
}

/* Streams `text`'s ids, whole and cut after every id that ends inside a character, and checks
 * pushes and flush against pipe.h's rule (byte_level: the decode itself). Returns the cuts inside a
 * character. */
static size_t check_stream_on(pipe_tokenizer *t, const char *name, const char *text, int byte_level) {
  const int64_t *lent = NULL;
  size_t count = 0;
  assert_int_equal(pipe_tokenizer_encode(t, text, strlen(text), 1, &lent, &count), PIPE_OK);
  int64_t *ids = malloc((count + 1) * sizeof *ids);
  memcpy(ids, lent, count * sizeof *ids);
  size_t cuts = 0;
  for (int32_t skip = 0; skip <= 1; ++skip) {
    for (size_t n = 1; n <= count; ++n) {
      struct text prefix = decoded(t, ids, n, skip);
      int inside = ends_with(prefix.data, prefix.length, FFFD);
      if (n < count && !inside) {
        free(prefix.data);
        continue;
      }
      struct text pushed, tail;
      stream_ids(t, ids, n, skip, &pushed, &tail);
      struct text want = expected_stream_text(t, ids, n, skip);
      if (byte_level || n == count) assert_string_equal(want.data, prefix.data);
      text_append(&pushed, tail.data, tail.length);
      if (pushed.length != want.length || memcmp(pushed.data, want.data, want.length) != 0)
        fail_msg("%s: %zu ids of \"%s\" (skip %d): pushes and flush gave \"%s\", want \"%s\"", name, n, text, skip,
                 pushed.data, want.data);
      if (inside) {
        ++cuts;
        if (!ends_with(tail.data, tail.length, FFFD))
          fail_msg("%s: %zu ids of \"%s\": the flush gave \"%s\", not the cut character as U+FFFD", name, n, text,
                   tail.data);
      } else if (tail.length != 0) {
        fail_msg("%s: \"%s\" ends with a whole character, yet the flush gave \"%s\"", name, text, tail.data);
      }
      free(pushed.data);
      free(tail.data);
      free(want.data);
      free(prefix.data);
    }
  }
  free(ids);
  return cuts;
}

/* The texts the tests above stream, encode and round-trip, and a few with characters cut into bytes
 * (U+1F980, U+1F389 and U+6F22 U+5B57 are not in the tokenizers' training text). */
static const char *const STREAM_TEXTS[] = {
    C_TEXT,
    "two  spaces\tand\ttabs\n\nlines   ",
    "def f(x):\n    return x ** 2  # \xe2\x9c\x93",
    "\xce\x95\xce\xbb\xce\xbb\xce\xb7\xce\xbd\xce\xb9\xce\xba\xce\xac \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb",
    "a \xf0\x9f\xa6\x80\xf0\x9f\x8e\x89 \xe6\xbc\xa2\xe5\xad\x97 \xc3\xb6 end",
    "\xf0\x9f\xa6\x80",
    "x\xe6\xbc\xa2\xf0\x9f\x8e\x89\xe5\xad\x97y",
};
#define NUM_STREAM_TEXTS (sizeof STREAM_TEXTS / sizeof STREAM_TEXTS[0])

static void stream_and_flush_equal_decode(void **state) {
  (void)state;
  for (size_t k = 0; k < NUM_STYLES + 1; ++k) {
    if (k == NUM_STYLES && !g_smollm2) break;
    const char *name = k < NUM_STYLES ? STYLES[k] : "smollm2";
    pipe_tokenizer *t = k < NUM_STYLES ? load(STYLES[k]) : load_folder(g_smollm2);
    int byte_level = k == NUM_STYLES || strcmp(name, "gpt2") == 0 || strcmp(name, "qwen2") == 0;
    size_t cuts = 0;
    for (size_t j = 0; j < NUM_STREAM_TEXTS; ++j) cuts += check_stream_on(t, name, STREAM_TEXTS[j], byte_level);
    if (cuts == 0) fail_msg("%s: no cut falls inside a character: the test tests nothing", name);
    pipe_tokenizer_destroy(t);
  }
}

/* A flush with nothing held back gives ""; a flush after a cut character gives it as U+FFFD; the
 * stream goes on after it: the character's other bytes read as U+FFFD too, then the text continues. */
static void flush_gives_what_is_held_back(void **state) {
  (void)state;
  for (size_t k = 0; k < NUM_STYLES; ++k) {
    pipe_tokenizer *t = load(STYLES[k]);
    pipe_decode_stream *stream = NULL;
    assert_int_equal(pipe_decode_stream_create(t, 0, &stream), PIPE_OK);
    const char *text = NULL;
    size_t length = 99;
    assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
    assert_int_equal(length, 0);
    assert_string_equal(text, "");
    /* U+1F980 is not in the tokenizers' training text: its bytes are cut over several tokens. */
    static const char input[] = "a \xf0\x9f\xa6\x80 b";
    const int64_t *lent = NULL;
    size_t count = 0;
    assert_int_equal(pipe_tokenizer_encode(t, input, strlen(input), 0, &lent, &count), PIPE_OK);
    int64_t ids[16];
    assert_true(count >= 3 && count <= 16);
    memcpy(ids, lent, count * sizeof *ids);
    size_t cut = 0; /* the ids up to the emoji's last byte, without it */
    for (size_t n = count; n > 0 && !cut; --n) {
      struct text d = decoded(t, ids, n, 0);
      if (ends_with(d.data, d.length, FFFD)) cut = n;
      free(d.data);
    }
    if (!cut) fail_msg("%s: no prefix of the ids ends inside U+1F980", STYLES[k]);
    struct text out = {0};
    text_append(&out, "", 0);
    for (size_t i = 0; i < cut; ++i) {
      assert_int_equal(pipe_decode_stream_push(stream, ids[i], &text, &length), PIPE_OK);
      text_append(&out, text, length);
    }
    assert_false(ends_with(out.data, out.length, FFFD)); /* the cut character's bytes are held back */
    assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
    assert_true(ends_with(text, length, FFFD)); /* the cut character, as decode gives it */
    text_append(&out, text, length);
    struct text want = decoded(t, ids, cut, 0);
    assert_string_equal(out.data, want.data);
    free(want.data);
    assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
    assert_int_equal(length, 0);
    /* The stream goes on: the other bytes have no character to complete any more (U+FFFD), then
     * the text continues. */
    out.length = 0;
    out.data[0] = '\0';
    for (size_t i = cut; i < count; ++i) {
      assert_int_equal(pipe_decode_stream_push(stream, ids[i], &text, &length), PIPE_OK);
      text_append(&out, text, length);
    }
    assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
    text_append(&out, text, length);
    struct text rest = decoded(t, ids + cut, count - cut, 0);
    assert_string_equal(out.data, rest.data);
    assert_true(ends_with(out.data, out.length, FFFD " b"));
    free(rest.data);
    free(out.data);
    pipe_decode_stream_destroy(stream);
    pipe_tokenizer_destroy(t);
  }
}

/* When the window's text stops beginning with what the stream gave out, the ids it held back go out
 * decoded together (before 0.15 only the last id's text went out: the others' was lost). */
static void stream_restarts_at_ids_not_given_out(void **state) {
  (void)state;
  /* Byte fallback (Llama's style): 15 skipped <s> and the first byte of U+1F980 are 16 ids that
   * complete no character, so U+FFFD goes out; the other 3 bytes complete the character, which the
   * window then decodes to: it does not begin with that U+FFFD. */
  pipe_tokenizer *t = load("llama");
  int64_t bos = -1;
  assert_int_equal(pipe_tokenizer_special_ids(t, &bos, NULL, NULL), PIPE_OK);
  int64_t ids[19];
  for (size_t i = 0; i < 15; ++i) ids[i] = bos;
  static const unsigned char crab[] = {0xF0, 0x9F, 0xA6, 0x80};
  /* The byte tokens follow <unk> <s> </s> in the vocabulary (tests/models/text_tokenizers.py). */
  for (size_t i = 0; i < 4; ++i) ids[15 + i] = 3 + crab[i];
  struct text check = decoded(t, ids + 15, 4, 1);
  assert_string_equal(check.data, "\xf0\x9f\xa6\x80");
  free(check.data);
  pipe_decode_stream *stream = NULL;
  assert_int_equal(pipe_decode_stream_create(t, 1, &stream), PIPE_OK);
  struct text pieces[19];
  for (size_t i = 0; i < 19; ++i) {
    const char *text = NULL;
    size_t length = 0;
    assert_int_equal(pipe_decode_stream_push(stream, ids[i], &text, &length), PIPE_OK);
    pieces[i] = (struct text){0};
    text_append(&pieces[i], text, length);
  }
  struct text first = decoded(t, ids, 16, 1), rest = decoded(t, ids + 16, 3, 1);
  assert_string_equal(first.data, FFFD);
  assert_string_equal(rest.data, FFFD FFFD FFFD);
  for (size_t i = 0; i < 15; ++i) assert_string_equal(pieces[i].data, "");
  assert_string_equal(pieces[15].data, first.data);
  assert_string_equal(pieces[16].data, "");
  assert_string_equal(pieces[17].data, "");
  assert_string_equal(pieces[18].data, rest.data);
  for (size_t i = 0; i < 19; ++i) free(pieces[i].data);
  free(first.data);
  free(rest.data);
  const char *text = NULL;
  size_t length = 99;
  assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
  assert_int_equal(length, 0);
  pipe_decode_stream_destroy(stream);
  pipe_tokenizer_destroy(t);

  /* A decoder that looks at neighbours (neighbours/: "a" then "b" decode to "X"): "a" goes out,
   * "b" waits (no text beyond "a"), "c" makes the window "Xc": "b" and "c" go out together. */
  t = load("neighbours");
  const int64_t a = 0, b = 1, c = 2;
  int64_t abc[] = {a, b, c};
  struct text all = decoded(t, abc, 3, 0);
  assert_string_equal(all.data, "Xc");
  free(all.data);
  assert_int_equal(pipe_decode_stream_create(t, 0, &stream), PIPE_OK);
  assert_int_equal(pipe_decode_stream_push(stream, a, &text, &length), PIPE_OK);
  assert_string_equal(text, "a");
  assert_int_equal(pipe_decode_stream_push(stream, b, &text, &length), PIPE_OK);
  assert_string_equal(text, "");
  assert_int_equal(pipe_decode_stream_push(stream, c, &text, &length), PIPE_OK);
  struct text bc = decoded(t, abc + 1, 2, 0);
  assert_string_equal(bc.data, "bc");
  assert_string_equal(text, bc.data);
  free(bc.data);
  pipe_decode_stream_destroy(stream);
  /* The flush restarts the same way. */
  assert_int_equal(pipe_decode_stream_create(t, 0, &stream), PIPE_OK);
  assert_int_equal(pipe_decode_stream_push(stream, a, &text, &length), PIPE_OK);
  assert_int_equal(pipe_decode_stream_push(stream, b, &text, &length), PIPE_OK);
  assert_int_equal(pipe_decode_stream_flush(stream, &text, &length), PIPE_OK);
  assert_string_equal(text, "b");
  pipe_decode_stream_destroy(stream);
  pipe_tokenizer_destroy(t);
}

/* clean_up_tokenization_spaces (wordpiece/, whose decode applies it as transformers' does): the
 * stream's text with its flush is the decode, clean-up included, whatever ids follow one another. */
static void stream_cleans_up_as_decode(void **state) {
  (void)state;
  pipe_tokenizer *t = load("wordpiece");
  static const char sentence[] =
      "Hello , world ! It 's a test ; is n't it ? I 'm here . They 've , we 're ' ' n't , really ?";
  const int64_t *lent = NULL;
  size_t count = 0;
  assert_int_equal(pipe_tokenizer_encode(t, sentence, strlen(sentence), 0, &lent, &count), PIPE_OK);
  int64_t pool[128];
  assert_true(count > 20 && count <= 128);
  memcpy(pool, lent, count * sizeof *pool);
  struct text pushed, tail, want = decoded(t, pool, count, 0);
  assert_null(strstr(want.data, " ."));
  assert_non_null(strstr(want.data, "it's"));
  stream_ids(t, pool, count, 0, &pushed, &tail);
  text_append(&pushed, tail.data, tail.length);
  assert_string_equal(pushed.data, want.data);
  assert_true(tail.length < 8); /* the stream gave the text as it came, not all at the end */
  free(pushed.data);
  free(tail.data);
  free(want.data);
  /* Ids of the sentence in any order (a fixed pseudo-random sequence). */
  uint64_t seed = 1;
  for (int round = 0; round < 400; ++round) {
    int64_t ids[24];
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    size_t n = 1 + (size_t)(seed >> 33) % 24;
    for (size_t i = 0; i < n; ++i) {
      seed = seed * 6364136223846793005u + 1442695040888963407u;
      ids[i] = pool[(seed >> 33) % count];
    }
    want = decoded(t, ids, n, 0);
    stream_ids(t, ids, n, 0, &pushed, &tail);
    text_append(&pushed, tail.data, tail.length);
    if (strcmp(pushed.data, want.data) != 0)
      fail_msg("round %d: pushes and flush gave \"%s\"; decode gives \"%s\"", round, pushed.data, want.data);
    free(pushed.data);
    free(tail.data);
    free(want.data);
  }
  pipe_tokenizer_destroy(t);
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
  if (argc != 2 && argc != 3) {
    fprintf(stderr,
            "usage: %s TOKENIZERS_DIR [SMOLLM2_DIR] (tests/models/text_tokenizers.py's output; "
            "tests/models/smollm2.py's folder)\n",
            argv[0]);
    return 2;
  }
  g_dir = argv[1];
  g_smollm2 = argc == 3 ? argv[2] : NULL;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(encode_equals_transformers),
      cmocka_unit_test(text_round_trips),
      cmocka_unit_test(special_and_stop_ids),
      cmocka_unit_test(chat_template_equals_transformers),
      cmocka_unit_test(chat_template_errors),
      cmocka_unit_test(errors_leave_outputs_alone),
      cmocka_unit_test(stream_gives_whole_characters),
      cmocka_unit_test(threads_share_a_tokenizer),
      cmocka_unit_test(stream_and_flush_equal_decode),
      cmocka_unit_test(flush_gives_what_is_held_back),
      cmocka_unit_test(stream_restarts_at_ids_not_given_out),
      cmocka_unit_test(stream_cleans_up_as_decode),
  };
  return cmocka_run_group_tests_name("text", tests, NULL, NULL);
}
