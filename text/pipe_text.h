// The C interface of the pipe-text static library (text/src/lib.rs): Hugging Face tokenizers and chat
// templates, for capi/tokenizer.cpp only. Internal: never installed, and none of these names is
// exported from libpipe.so (they are not pipe_*, so the version script keeps them local).
//
// Functions returning int32_t return a libpipe status code (0: success). On failure they set *err to a
// message of *err_len bytes (UTF-8, no NUL) that the caller frees with ptxt_free_bytes, and write no
// other output. Bytes and ids they return are freed with ptxt_free_bytes / ptxt_free_ids. No panic
// crosses this interface.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ptxt_tokenizer ptxt_tokenizer;
typedef struct ptxt_stream ptxt_stream;

int32_t ptxt_tokenizer_load(const uint8_t *dir, size_t dir_len, ptxt_tokenizer **out, uint8_t **err, size_t *err_len);
void ptxt_tokenizer_free(ptxt_tokenizer *t);
// The stop ids are borrowed from the tokenizer.
void ptxt_tokenizer_info(const ptxt_tokenizer *t, int64_t *vocab, int64_t *bos, int64_t *eos, int64_t *pad,
                         const int64_t **stop_ids, size_t *num_stop_ids);
int32_t ptxt_encode(const ptxt_tokenizer *t, const uint8_t *text, size_t len, int32_t add_special, int64_t **ids,
                    size_t *count, uint8_t **err, size_t *err_len);
int32_t ptxt_decode(const ptxt_tokenizer *t, const int64_t *ids, size_t count, int32_t skip_special, uint8_t **text,
                    size_t *len, uint8_t **err, size_t *err_len);
int32_t ptxt_apply_chat_template(const ptxt_tokenizer *t, const char *const *roles, const char *const *contents,
                                 size_t count, int32_t add_generation_prompt, uint8_t **text, size_t *len,
                                 uint8_t **err, size_t *err_len);
// The stream holds its own reference to the tokenizer.
void ptxt_stream_new(const ptxt_tokenizer *t, int32_t skip_special, ptxt_stream **out);
int32_t ptxt_stream_step(ptxt_stream *s, int64_t id, uint8_t **text, size_t *len, uint8_t **err, size_t *err_len);
// What the stream holds back, decoded (U+FFFD for bytes that form no character); it then holds nothing.
int32_t ptxt_stream_flush(ptxt_stream *s, uint8_t **text, size_t *len, uint8_t **err, size_t *err_len);
void ptxt_stream_free(ptxt_stream *s);
void ptxt_free_bytes(uint8_t *ptr, size_t len);
void ptxt_free_ids(int64_t *ptr, size_t count);

#ifdef __cplusplus
}  // extern "C"
#endif
