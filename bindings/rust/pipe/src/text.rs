//! Text in and out (pipe.h's "Text", libpipe >= 0.14): a Hugging Face model folder's tokenizer,
//! its special and stop ids, its chat template, and streaming decoders.

use std::ffi::CString;
use std::path::Path;
use std::ptr::{self, NonNull};

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};

/// A model folder's tokenizer (tokenizer.json, with tokenizer_config.json, chat_template.jinja,
/// generation_config.json and config.json when present), run by Hugging Face's tokenizers library
/// inside libpipe.
pub struct Tokenizer {
    ptr: NonNull<sys::pipe_tokenizer>,
    vocab_size: i64,
    special: [Option<i64>; 3],
    stop_ids: Vec<i64>,
}

// SAFETY: pipe.h: every function on a tokenizer except pipe_tokenizer_destroy is thread-safe on the
// same handle, and destroy runs in Drop with sole ownership; results lent in a thread's own buffers
// are copied before that thread calls libpipe again.
unsafe impl Send for Tokenizer {}
unsafe impl Sync for Tokenizer {}

fn flag(b: bool) -> i32 {
    i32::from(b)
}

/// Copies `n` ids lent by libpipe (until this thread's next call).
unsafe fn lent_ids(ids: *const i64, n: usize) -> Vec<i64> {
    if n == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(ids, n).to_vec()
    }
}

/// Copies `n` bytes of UTF-8 text lent by libpipe.
unsafe fn lent_text(text: *const std::os::raw::c_char, n: usize) -> String {
    if n == 0 {
        return String::new();
    }
    String::from_utf8_lossy(std::slice::from_raw_parts(text as *const u8, n)).into_owned()
}

impl Tokenizer {
    /// Load the tokenizer of a Hugging Face model folder. [`Status::NotFound`] without
    /// tokenizer.json; [`Status::InvalidFormat`] for a file that does not parse.
    pub fn load(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let c = crate::path_cstring(dir.as_ref())?;
        let mut raw = ptr::null_mut();
        // SAFETY: global; `c` outlives the call; `raw` is written only on success.
        check(unsafe { sys::pipe_tokenizer_load(c.as_ptr(), &mut raw) })?;
        let ptr = NonNull::new(raw).ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL tokenizer"))?;
        let mut t = Tokenizer { ptr, vocab_size: 0, special: [None; 3], stop_ids: Vec::new() };
        let (mut bos, mut eos, mut pad) = (-1i64, -1i64, -1i64);
        let (mut stop, mut n) = (ptr::null(), 0usize);
        // SAFETY: thread-safe; the stop ids belong to the tokenizer and are copied at once.
        unsafe {
            check(sys::pipe_tokenizer_vocab_size(ptr.as_ptr(), &mut t.vocab_size))?;
            check(sys::pipe_tokenizer_special_ids(ptr.as_ptr(), &mut bos, &mut eos, &mut pad))?;
            check(sys::pipe_tokenizer_stop_ids(ptr.as_ptr(), &mut stop, &mut n))?;
            t.stop_ids = lent_ids(stop, n);
        }
        t.special = [bos, eos, pad].map(|id| (id >= 0).then_some(id));
        Ok(t)
    }

    /// One past the largest token id: ids are `0..vocab_size()`.
    pub fn vocab_size(&self) -> i64 {
        self.vocab_size
    }

    /// The beginning-of-sequence token's id, if the folder names one.
    pub fn bos_token_id(&self) -> Option<i64> {
        self.special[0]
    }

    /// The end-of-sequence token's id, if the folder names one.
    pub fn eos_token_id(&self) -> Option<i64> {
        self.special[1]
    }

    /// The padding token's id, if the folder names one.
    pub fn pad_token_id(&self) -> Option<i64> {
        self.special[2]
    }

    /// The ids that end a generation (generation_config.json's eos_token_id, one or several, and
    /// the tokenizer's eos token), for [`crate::GenerationOptions`]' stop ids.
    pub fn stop_ids(&self) -> &[i64] {
        &self.stop_ids
    }

    /// The token ids of `text`, with the special tokens the tokenizer adds (a leading BOS, ...)
    /// when `add_special` is true: Hugging Face's `encode(text, add_special_tokens)`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<i64>> {
        self.encode_bytes(text.as_bytes(), add_special)
    }

    /// [`Tokenizer::encode`] of bytes that should be UTF-8: [`Status::InvalidArgument`] when they
    /// are not.
    pub fn encode_bytes(&self, text: &[u8], add_special: bool) -> Result<Vec<i64>> {
        let (mut ids, mut n) = (ptr::null(), 0usize);
        // SAFETY: thread-safe; `text` is read during the call; the lent ids are copied before this
        // thread calls libpipe again.
        unsafe {
            check(sys::pipe_tokenizer_encode(
                self.ptr.as_ptr(),
                text.as_ptr() as *const _,
                text.len(),
                flag(add_special),
                &mut ids,
                &mut n,
            ))?;
            Ok(lent_ids(ids, n))
        }
    }

    /// The text of `ids`, special tokens left out when `skip_special` is true: Hugging Face's
    /// `decode`. [`Status::InvalidArgument`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[i64], skip_special: bool) -> Result<String> {
        let (mut text, mut n) = (ptr::null(), 0usize);
        // SAFETY: thread-safe; `ids` is read during the call; the lent text is copied at once.
        unsafe {
            check(sys::pipe_tokenizer_decode(
                self.ptr.as_ptr(),
                ids.as_ptr(),
                ids.len(),
                flag(skip_special),
                &mut text,
                &mut n,
            ))?;
            Ok(lent_text(text, n))
        }
    }

    /// The folder's chat template over `messages` (role, content), the assistant's opening
    /// appended when `add_generation_prompt` is true: transformers'
    /// `apply_chat_template(messages, tokenize=False)`. Encode the result with `add_special`
    /// false. [`Status::InvalidFormat`] when the folder has no template;
    /// [`Status::InvalidArgument`] when the template raises for this conversation.
    pub fn apply_chat_template(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> Result<String> {
        let roles: Vec<CString> = messages.iter().map(|(r, _)| crate::cstring("role", r)).collect::<Result<_>>()?;
        let contents: Vec<CString> =
            messages.iter().map(|(_, c)| crate::cstring("content", c)).collect::<Result<_>>()?;
        let role_ptrs: Vec<*const std::os::raw::c_char> = roles.iter().map(|s| s.as_ptr()).collect();
        let content_ptrs: Vec<*const std::os::raw::c_char> = contents.iter().map(|s| s.as_ptr()).collect();
        let (mut text, mut n) = (ptr::null(), 0usize);
        // SAFETY: thread-safe; the strings outlive the call; the lent text is copied at once.
        unsafe {
            check(sys::pipe_tokenizer_apply_chat_template(
                self.ptr.as_ptr(),
                role_ptrs.as_ptr(),
                content_ptrs.as_ptr(),
                messages.len(),
                flag(add_generation_prompt),
                &mut text,
                &mut n,
            ))?;
            Ok(lent_text(text, n))
        }
    }

    /// A streaming decoder over this tokenizer (which it may outlive).
    pub fn decode_stream(&self, skip_special: bool) -> Result<DecodeStream> {
        let mut raw = ptr::null_mut();
        // SAFETY: thread-safe on the tokenizer; `raw` is written only on success.
        check(unsafe { sys::pipe_decode_stream_create(self.ptr.as_ptr(), flag(skip_special), &mut raw) })?;
        NonNull::new(raw)
            .map(|ptr| DecodeStream { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL decode stream"))
    }
}

impl Drop for Tokenizer {
    fn drop(&mut self) {
        // SAFETY: sole owner; decode streams hold what they need.
        unsafe { sys::pipe_tokenizer_destroy(self.ptr.as_ptr()) }
    }
}

/// Ids in one at a time, whole UTF-8 characters out (pipe_decode_stream_push): what
/// [`DecodeStream::push`] returns, put together with [`DecodeStream::flush`] at the end, is the
/// decode of every id fed.
pub struct DecodeStream {
    ptr: NonNull<sys::pipe_decode_stream>,
}

// SAFETY: a stream is exclusive per handle: `push` takes `&mut self`, so it may move between threads
// (Send) but is not shared (no Sync).
unsafe impl Send for DecodeStream {}

impl DecodeStream {
    /// Feed the next id; the characters it completes ("" while a character waits for its last
    /// bytes). [`Status::InvalidArgument`] for an id outside the vocabulary.
    pub fn push(&mut self, id: i64) -> Result<String> {
        let (mut text, mut n) = (ptr::null(), 0usize);
        // SAFETY: exclusive through &mut self; the lent text is copied at once.
        unsafe {
            check(sys::pipe_decode_stream_push(self.ptr.as_ptr(), id, &mut text, &mut n))?;
            Ok(lent_text(text, n))
        }
    }

    /// What the stream holds back, as the end of the text (pipe_decode_stream_flush): ids that
    /// complete no character yet, with U+FFFD for their bytes; "" when it holds nothing. Call it
    /// when the ids end; the stream may go on after it (the ids so far stay the context).
    pub fn flush(&mut self) -> Result<String> {
        let (mut text, mut n) = (ptr::null(), 0usize);
        // SAFETY: exclusive through &mut self; the lent text is copied at once.
        unsafe {
            check(sys::pipe_decode_stream_flush(self.ptr.as_ptr(), &mut text, &mut n))?;
            Ok(lent_text(text, n))
        }
    }
}

impl Drop for DecodeStream {
    fn drop(&mut self) {
        // SAFETY: sole owner.
        unsafe { sys::pipe_decode_stream_destroy(self.ptr.as_ptr()) }
    }
}
