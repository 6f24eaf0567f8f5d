// The C ABI of text in and out (pipe.h, "Text"): a model folder's tokenizer, its special and stop
// ids, its chat template, and streaming decoders. The work is the pipe-text Rust library's
// (text/src/lib.rs: Hugging Face's tokenizers crate and minijinja); this file checks arguments and
// sizes, turns its failures into statuses, and lends results in this thread's buffers.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "capi/boundary.h"
#include "text/pipe_text.h"

using namespace libpipe::capi;
using libpipe::Error;
using libpipe::Status;

namespace libpipe::capi {

// The objects behind pipe_tokenizer and pipe_decode_stream (boundary.h says why handles are casts).
// Both own a reference in the Rust library; a tokenizer is immutable once loaded, so any number of
// threads may use it at once without a lock.
struct TokenizerHandle {
  ptxt_tokenizer* impl = nullptr;
  int64_t vocab = 0, bos = -1, eos = -1, pad = -1;
  const int64_t* stop_ids = nullptr;  // borrowed from impl
  size_t num_stop_ids = 0;
  ~TokenizerHandle() { ptxt_tokenizer_free(impl); }
};

struct DecodeStreamHandle {
  ptxt_stream* impl = nullptr;
  ~DecodeStreamHandle() { ptxt_stream_free(impl); }
};

inline TokenizerHandle* get(pipe_tokenizer* h) { return reinterpret_cast<TokenizerHandle*>(h); }
inline const TokenizerHandle* get(const pipe_tokenizer* h) { return reinterpret_cast<const TokenizerHandle*>(h); }
inline pipe_tokenizer* handle(TokenizerHandle* o) { return reinterpret_cast<pipe_tokenizer*>(o); }
inline DecodeStreamHandle* get(pipe_decode_stream* h) { return reinterpret_cast<DecodeStreamHandle*>(h); }
inline pipe_decode_stream* handle(DecodeStreamHandle* o) { return reinterpret_cast<pipe_decode_stream*>(o); }

}  // namespace libpipe::capi

namespace {

// pipe.h's bounds on what callers pass: checked before the Rust library allocates anything.
constexpr size_t kMaxTextBytes = size_t{1} << 28;  // 256 MiB
constexpr size_t kMaxIds = size_t{1} << 26;

// This thread's lent results (pipe.h: valid until the thread's next libpipe call).
std::vector<int64_t>& lent_ids() {
  thread_local std::vector<int64_t> ids;
  return ids;
}
std::string& lent_text() {
  thread_local std::string text;
  return text;
}

// Bytes or ids the Rust library handed over, freed when this goes out of scope.
struct RustBytes {
  uint8_t* ptr = nullptr;
  size_t len = 0;
  ~RustBytes() { ptxt_free_bytes(ptr, len); }
  std::string str() const { return std::string(reinterpret_cast<const char*>(ptr), len); }
};
struct RustIds {
  int64_t* ptr = nullptr;
  size_t count = 0;
  ~RustIds() { ptxt_free_ids(ptr, count); }
};

// A status from the Rust library: throws its failure as an Error with the function's name.
void check(int32_t code, const RustBytes& err, const char* fn) {
  if (code == PIPE_OK) return;
  throw Error(static_cast<Status>(code), std::string(fn) + ": " + err.str());
}

void require_flag(int32_t value, const char* fn, const char* name) {
  if (value != 0 && value != 1)
    throw Error(Status::InvalidArgument,
                std::string(fn) + ": " + name + " is " + std::to_string(value) + "; it must be 0 or 1");
}

void require_ids(const int64_t* ids, size_t count, const char* fn) {
  if (count > 0) require(ids, fn, "ids");
  if (count > kMaxIds)
    throw Error(Status::InvalidArgument, std::string(fn) + ": " + std::to_string(count) +
                                             " ids are more than the 2^26 this function takes at once");
}

// Moves Rust's text into this thread's buffer and lends it.
void lend_text(const RustBytes& bytes, const char** text, size_t* length) {
  std::string& out = lent_text();
  out.assign(reinterpret_cast<const char*>(bytes.ptr), bytes.len);
  *text = out.c_str();
  *length = out.size();
}

}  // namespace

extern "C" {

pipe_status pipe_tokenizer_load(const char* dir, pipe_tokenizer** tokenizer) {
  return guarded(__func__, [&](const char* fn) {
    require(dir, fn, "dir");
    require(tokenizer, fn, "tokenizer");
    auto t = std::make_unique<TokenizerHandle>();
    RustBytes err;
    check(ptxt_tokenizer_load(reinterpret_cast<const uint8_t*>(dir), std::strlen(dir), &t->impl, &err.ptr, &err.len),
          err, fn);
    ptxt_tokenizer_info(t->impl, &t->vocab, &t->bos, &t->eos, &t->pad, &t->stop_ids, &t->num_stop_ids);
    *tokenizer = handle(t.release());
  });
}

void pipe_tokenizer_destroy(pipe_tokenizer* tokenizer) { delete get(tokenizer); }

pipe_status pipe_tokenizer_encode(const pipe_tokenizer* tokenizer, const char* text, size_t length, int32_t add_special,
                                  const int64_t** ids, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    if (length > 0) require(text, fn, "text");
    require(ids, fn, "ids");
    require(count, fn, "count");
    require_flag(add_special, fn, "add_special");
    if (length > kMaxTextBytes)
      throw Error(Status::InvalidArgument, std::string(fn) + ": the text is " + std::to_string(length) +
                                               " bytes, more than the 256 MiB this function takes at once");
    RustIds out;
    RustBytes err;
    check(ptxt_encode(get(tokenizer)->impl, reinterpret_cast<const uint8_t*>(length > 0 ? text : ""), length,
                      add_special, &out.ptr, &out.count, &err.ptr, &err.len),
          err, fn);
    std::vector<int64_t>& lent = lent_ids();
    lent.assign(out.ptr, out.ptr + out.count);
    *ids = lent.data();
    *count = lent.size();
  });
}

pipe_status pipe_tokenizer_decode(const pipe_tokenizer* tokenizer, const int64_t* ids, size_t count,
                                  int32_t skip_special, const char** text, size_t* length) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    require_ids(ids, count, fn);
    require(text, fn, "text");
    require(length, fn, "length");
    require_flag(skip_special, fn, "skip_special");
    RustBytes out, err;
    check(ptxt_decode(get(tokenizer)->impl, ids, count, skip_special, &out.ptr, &out.len, &err.ptr, &err.len), err, fn);
    lend_text(out, text, length);
  });
}

pipe_status pipe_tokenizer_vocab_size(const pipe_tokenizer* tokenizer, int64_t* size) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    require(size, fn, "size");
    *size = get(tokenizer)->vocab;
  });
}

pipe_status pipe_tokenizer_special_ids(const pipe_tokenizer* tokenizer, int64_t* bos, int64_t* eos, int64_t* pad) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    const TokenizerHandle* t = get(tokenizer);
    if (bos) *bos = t->bos;
    if (eos) *eos = t->eos;
    if (pad) *pad = t->pad;
  });
}

pipe_status pipe_tokenizer_stop_ids(const pipe_tokenizer* tokenizer, const int64_t** ids, size_t* count) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    require(ids, fn, "ids");
    require(count, fn, "count");
    *ids = get(tokenizer)->stop_ids;
    *count = get(tokenizer)->num_stop_ids;
  });
}

pipe_status pipe_tokenizer_apply_chat_template(const pipe_tokenizer* tokenizer, const char* const* roles,
                                               const char* const* contents, size_t count, int32_t add_generation_prompt,
                                               const char** text, size_t* length) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    require(text, fn, "text");
    require(length, fn, "length");
    require_flag(add_generation_prompt, fn, "add_generation_prompt");
    if (count > 0) {
      require(roles, fn, "roles");
      require(contents, fn, "contents");
    }
    size_t total = 0;
    for (size_t i = 0; i < count; ++i) {
      if (!roles[i] || !contents[i])
        throw Error(Status::InvalidArgument,
                    std::string(fn) + ": " + (roles[i] ? "contents[" : "roles[") + std::to_string(i) + "] is NULL");
      total += std::strlen(roles[i]) + std::strlen(contents[i]);
      if (total > kMaxTextBytes)
        throw Error(Status::InvalidArgument,
                    std::string(fn) + ": the conversation is more than the 256 MiB this function takes at once");
    }
    RustBytes out, err;
    check(ptxt_apply_chat_template(get(tokenizer)->impl, count > 0 ? roles : nullptr, count > 0 ? contents : nullptr,
                                   count, add_generation_prompt, &out.ptr, &out.len, &err.ptr, &err.len),
          err, fn);
    lend_text(out, text, length);
  });
}

pipe_status pipe_decode_stream_create(const pipe_tokenizer* tokenizer, int32_t skip_special,
                                      pipe_decode_stream** stream) {
  return guarded(__func__, [&](const char* fn) {
    require(tokenizer, fn, "tokenizer");
    require(stream, fn, "stream");
    require_flag(skip_special, fn, "skip_special");
    auto s = std::make_unique<DecodeStreamHandle>();
    ptxt_stream_new(get(tokenizer)->impl, skip_special, &s->impl);
    *stream = handle(s.release());
  });
}

pipe_status pipe_decode_stream_push(pipe_decode_stream* stream, int64_t id, const char** text, size_t* length) {
  return guarded(__func__, [&](const char* fn) {
    require(stream, fn, "stream");
    require(text, fn, "text");
    require(length, fn, "length");
    RustBytes out, err;
    check(ptxt_stream_step(get(stream)->impl, id, &out.ptr, &out.len, &err.ptr, &err.len), err, fn);
    lend_text(out, text, length);
  });
}

pipe_status pipe_decode_stream_flush(pipe_decode_stream* stream, const char** text, size_t* length) {
  return guarded(__func__, [&](const char* fn) {
    require(stream, fn, "stream");
    require(text, fn, "text");
    require(length, fn, "length");
    RustBytes out, err;
    check(ptxt_stream_flush(get(stream)->impl, &out.ptr, &out.len, &err.ptr, &err.len), err, fn);
    lend_text(out, text, length);
  });
}

void pipe_decode_stream_destroy(pipe_decode_stream* stream) { delete get(stream); }

}  // extern "C"
