//! libpipe's text in and out: a Hugging Face model folder's tokenizer (tokenizer.json, through the
//! `tokenizers` crate), its special tokens and stop ids, a streaming decoder, and its chat template
//! (through `minijinja`, set up as transformers sets up Jinja).
//!
//! This is a static library linked into libpipe.so behind capi/tokenizer.cpp, which is the only
//! caller: the functions below are `ptxt_*` (never `pipe_*`), so libpipe's version script keeps them
//! local. Every function catches panics (nothing unwinds into C) and reports failures as a libpipe
//! status code with a message. Results are allocated here and freed with `ptxt_free_*`.

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, Value};
use tokenizers::Tokenizer;

// libpipe's status codes (pipe.h), the ones this library reports.
const OK: i32 = 0;
const INVALID_ARGUMENT: i32 = 1;
const NOT_FOUND: i32 = 2;
const INVALID_FORMAT: i32 = 3;
const INTERNAL: i32 = 10;

/// A failure: a status code and its message.
struct Failure(i32, String);

type Result<T> = std::result::Result<T, Failure>;

fn fail<T>(code: i32, message: impl Into<String>) -> Result<T> {
    Err(Failure(code, message.into()))
}

/// A byte buffer handed to C: `len` bytes at `ptr`, freed with `ptxt_free_bytes(ptr, len)`.
fn give_bytes(bytes: Vec<u8>, ptr: *mut *mut u8, len: *mut usize) {
    let boxed = bytes.into_boxed_slice();
    let n = boxed.len();
    unsafe {
        *len = n;
        *ptr = Box::into_raw(boxed) as *mut u8;
    }
}

/// Runs `body`, turning a failure or a panic into a status and a message (`err`, `err_len`).
fn guarded<F: FnOnce() -> Result<()>>(err: *mut *mut u8, err_len: *mut usize, body: F) -> i32 {
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let (code, message) = match outcome {
        Ok(Ok(())) => return OK,
        Ok(Err(Failure(code, message))) => (code, message),
        Err(panic) => {
            let what = if let Some(s) = panic.downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = panic.downcast_ref::<String>() {
                s.clone()
            } else {
                "a panic".to_string()
            };
            (INTERNAL, format!("internal error in the text library: {what}"))
        }
    };
    if !err.is_null() && !err_len.is_null() {
        // A message cannot fail to be handed over unless memory is exhausted, which aborts.
        let _ = catch_unwind(AssertUnwindSafe(|| give_bytes(message.into_bytes(), err, err_len)));
    }
    code
}

/// Bytes the caller passed, as UTF-8; `what` names them in the message.
fn utf8<'a>(bytes: &'a [u8], what: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        Failure(
            INVALID_ARGUMENT,
            format!("{what} is not valid UTF-8: invalid byte sequence at byte offset {}", e.valid_up_to()),
        )
    })
}

unsafe fn slice<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, len)
    }
}

// ---- the model folder -----------------------------------------------------------------------------

/// A special token as tokenizer_config.json writes it: a string, or an AddedToken object.
fn token_content(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

/// One id or a list of ids (generation_config.json's eos_token_id may be either).
fn ids_of(value: Option<&serde_json::Value>) -> Vec<i64> {
    match value {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(items)) => items.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return fail(NOT_FOUND, format!("cannot read {}: {e}", path.display())),
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| Failure(INVALID_FORMAT, format!("{} is not valid JSON: {e}", path.display())))
}

fn special_names() -> [&'static str; 4] {
    ["bos_token", "eos_token", "unk_token", "pad_token"]
}

/// A chat template as transformers renders it: trim_blocks, lstrip_blocks, loop controls, its own
/// tojson (no HTML escaping), raise_exception, strftime_now, and Python's string methods.
fn chat_environment(source: String) -> std::result::Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> std::result::Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_template_owned("chat_template", source)
        .map_err(|e| format!("the chat template does not compile: {e:#}"))?;
    Ok(env)
}

/// Python's json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys) as transformers'
/// tojson filter gives it (separators ", " and ": ", or "," and ": " with an indent).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(&json, indent, sort_keys.unwrap_or(false), ensure_ascii.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, sort: bool, ascii: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        serde_json::Value::Null => out.push_str("null"),
        serde_json::Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        serde_json::Value::Number(n) => out.push_str(&n.to_string()),
        serde_json::Value::String(s) => python_json_string(s, ascii, out),
        serde_json::Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, sort, ascii, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        serde_json::Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json_string(key, ascii, out);
                out.push_str(": ");
                python_json(item, indent, sort, ascii, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// strftime_now(format) for the directives chat templates use (%d %m %Y %y %b %B %H %M %S %%), UTC.
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&format!("{year}")),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// What pipe_tokenizer holds: immutable once loaded, so shared by any number of threads.
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    /// One past the largest id the tokenizer knows, added tokens included.
    vocab: i64,
    bos: i64,
    eos: i64,
    pad: i64,
    stop_ids: Vec<i64>,
    /// bos_token, eos_token, unk_token, pad_token as strings, for the chat template.
    specials: Vec<(&'static str, String)>,
    /// transformers' clean_up_tokenization_spaces on decode.
    clean_up_spaces: bool,
    /// The compiled chat template, or why there is none.
    chat: std::result::Result<Environment<'static>, String>,
}

fn load(dir: &Path) -> Result<TextTokenizer> {
    if !dir.is_dir() {
        return fail(
            NOT_FOUND,
            format!("{} is not a folder (a Hugging Face model folder holding tokenizer.json)", dir.display()),
        );
    }
    let tokenizer_json = dir.join("tokenizer.json");
    if !tokenizer_json.is_file() {
        return fail(
            NOT_FOUND,
            format!(
                "{} has no tokenizer.json (libpipe reads the fast tokenizer's file that Hugging Face's save_pretrained writes)",
                dir.display()
            ),
        );
    }
    let tokenizer = Tokenizer::from_file(&tokenizer_json)
        .map_err(|e| Failure(INVALID_FORMAT, format!("{} is not a tokenizer file: {e}", tokenizer_json.display())))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(serde_json::Value::Null);
    let special_map = read_json(&dir.join("special_tokens_map.json"))?.unwrap_or(serde_json::Value::Null);
    let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(serde_json::Value::Null);
    let model_config = read_json(&dir.join("config.json"))?.unwrap_or(serde_json::Value::Null);

    let vocab = tokenizer.get_vocab(true).values().map(|&id| id as i64 + 1).max().unwrap_or(0);
    let mut specials = Vec::new();
    for name in special_names() {
        if let Some(content) = token_content(config.get(name)).or_else(|| token_content(special_map.get(name))) {
            specials.push((name, content));
        }
    }
    let id_of = |name: &str| -> i64 {
        let from_token = specials
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, content)| tokenizer.token_to_id(content))
            .map(|id| id as i64);
        let key = format!("{name}_id");
        from_token
            .or_else(|| ids_of(generation.get(&key)).first().copied())
            .or_else(|| ids_of(model_config.get(&key)).first().copied())
            .unwrap_or(-1)
    };
    let (bos, eos, pad) = (id_of("bos_token"), id_of("eos_token"), id_of("pad_token"));
    // The ids that end a generation: generation_config.json's eos_token_id (one or a list, as
    // transformers' generate reads it), else config.json's, and the tokenizer's eos token.
    let mut stop_ids = ids_of(generation.get("eos_token_id"));
    if stop_ids.is_empty() {
        stop_ids = ids_of(model_config.get("eos_token_id"));
    }
    if eos >= 0 && !stop_ids.contains(&eos) {
        stop_ids.push(eos);
    }
    stop_ids.retain(|&id| id >= 0 && id < vocab);
    // As transformers' decode: clean_up_tokenization_spaces, which it skips for a BPE model (it would
    // strip spaces BPE keeps) unless the folder insists.
    let flag = |key: &str| config.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
    let is_bpe = matches!(tokenizer.get_model(), tokenizers::models::ModelWrapper::BPE(_));
    let clean_up_spaces = flag("clean_up_tokenization_spaces")
        && (!is_bpe || flag("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"));

    // The chat template: chat_template.jinja (what transformers writes since 4.47), else
    // tokenizer_config.json's chat_template (a string, or a list of named templates: "default").
    let jinja = dir.join("chat_template.jinja");
    let source = if jinja.is_file() {
        match std::fs::read(&jinja) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(s) => Ok(s),
                Err(_) => Err(format!("{} is not valid UTF-8", jinja.display())),
            },
            Err(e) => Err(format!("cannot read {}: {e}", jinja.display())),
        }
    } else {
        match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| {
                    "tokenizer_config.json's chat_template list has no template named \"default\"".to_string()
                }),
            _ => Err(format!(
                "{} has no chat template (neither chat_template.jinja nor a chat_template in tokenizer_config.json)",
                dir.display()
            )),
        }
    };
    let chat = source.and_then(chat_environment);
    Ok(TextTokenizer { tokenizer, vocab, bos, eos, pad, stop_ids, specials, clean_up_spaces, chat })
}

/// transformers' clean_up_tokenization (PreTrainedTokenizerBase.clean_up_tokenization).
fn clean_up(text: String) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

impl TextTokenizer {
    fn check_ids(&self, ids: &[i64]) -> Result<Vec<u32>> {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                if id < 0 || id >= self.vocab {
                    fail(
                        INVALID_ARGUMENT,
                        format!("token id {id} at index {i} is outside the vocabulary (0 .. {})", self.vocab - 1),
                    )
                } else {
                    Ok(id as u32)
                }
            })
            .collect()
    }

    fn decode_u32(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer.decode(ids, skip_special).map_err(|e| Failure(INTERNAL, format!("decoding failed: {e}")))
    }
}

// ---- the C interface ------------------------------------------------------------------------------

/// Load the tokenizer of the model folder `dir` (`dir_len` bytes of UTF-8).
///
/// # Safety
/// `dir` points to `dir_len` bytes; `out`, `err`, `err_len` are writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_tokenizer_load(
    dir: *const u8,
    dir_len: usize,
    out: *mut *mut TextTokenizer,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let path = utf8(slice(dir, dir_len), "the folder's path")?;
        let t = load(Path::new(path))?;
        *out = Arc::into_raw(Arc::new(t)) as *mut TextTokenizer;
        Ok(())
    })
}

/// Release a tokenizer (streams keep their own reference). NULL is ignored.
///
/// # Safety
/// `t` is NULL or from ptxt_tokenizer_load, released once.
#[no_mangle]
pub unsafe extern "C" fn ptxt_tokenizer_free(t: *mut TextTokenizer) {
    if !t.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Arc::from_raw(t as *const TextTokenizer))));
    }
}

/// bos, eos, pad ids (-1: none), the vocabulary's size, and the stop ids (borrowed from `t`).
///
/// # Safety
/// `t` is a live tokenizer; every other pointer is writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_tokenizer_info(
    t: *const TextTokenizer,
    vocab: *mut i64,
    bos: *mut i64,
    eos: *mut i64,
    pad: *mut i64,
    stop_ids: *mut *const i64,
    num_stop_ids: *mut usize,
) {
    let t = &*t;
    *vocab = t.vocab;
    *bos = t.bos;
    *eos = t.eos;
    *pad = t.pad;
    *stop_ids = t.stop_ids.as_ptr();
    *num_stop_ids = t.stop_ids.len();
}

/// Encode `len` bytes of UTF-8 into ids, freed with ptxt_free_ids.
///
/// # Safety
/// `t` is a live tokenizer, `text` points to `len` bytes; outputs are writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_encode(
    t: *const TextTokenizer,
    text: *const u8,
    len: usize,
    add_special: i32,
    ids: *mut *mut i64,
    count: *mut usize,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let t = &*t;
        let text = utf8(slice(text, len), "text")?;
        let encoding = t
            .tokenizer
            .encode(text, add_special != 0)
            .map_err(|e| Failure(INTERNAL, format!("encoding failed: {e}")))?;
        let out: Vec<i64> = encoding.get_ids().iter().map(|&id| id as i64).collect();
        let boxed = out.into_boxed_slice();
        *count = boxed.len();
        *ids = Box::into_raw(boxed) as *mut i64;
        Ok(())
    })
}

/// Decode ids into UTF-8, freed with ptxt_free_bytes.
///
/// # Safety
/// `t` is a live tokenizer, `ids` points to `count` ids; outputs are writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_decode(
    t: *const TextTokenizer,
    ids: *const i64,
    count: usize,
    skip_special: i32,
    text: *mut *mut u8,
    len: *mut usize,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let t = &*t;
        let ids = t.check_ids(slice(ids, count))?;
        let mut s = t.decode_u32(&ids, skip_special != 0)?;
        if t.clean_up_spaces {
            s = clean_up(s);
        }
        give_bytes(s.into_bytes(), text, len);
        Ok(())
    })
}

/// Render the chat template over `count` messages (roles and contents, NUL-terminated strings).
///
/// # Safety
/// `t` is a live tokenizer; `roles` and `contents` hold `count` NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn ptxt_apply_chat_template(
    t: *const TextTokenizer,
    roles: *const *const c_char,
    contents: *const *const c_char,
    count: usize,
    add_generation_prompt: i32,
    text: *mut *mut u8,
    len: *mut usize,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let t = &*t;
        let env = match &t.chat {
            Ok(env) => env,
            Err(why) => return fail(INVALID_FORMAT, why.clone()),
        };
        let roles = slice(roles, count);
        let contents = slice(contents, count);
        let mut messages = Vec::with_capacity(count);
        for i in 0..count {
            let role = utf8(CStr::from_ptr(roles[i]).to_bytes(), &format!("roles[{i}]"))?;
            let content = utf8(CStr::from_ptr(contents[i]).to_bytes(), &format!("contents[{i}]"))?;
            messages.push(Value::from_iter([("role", Value::from(role)), ("content", Value::from(content))]));
        }
        let mut context: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt != 0)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        for (name, content) in &t.specials {
            context.push((name, Value::from(content.as_str())));
        }
        let template = env
            .get_template("chat_template")
            .map_err(|e| Failure(INTERNAL, format!("the chat template is missing: {e}")))?;
        let rendered = template
            .render(Value::from_iter(context))
            .map_err(|e| Failure(INVALID_ARGUMENT, format!("the chat template failed: {e:#}")))?;
        give_bytes(rendered.into_bytes(), text, len);
        Ok(())
    })
}

/// A streaming decoder: ids in one at a time, whole UTF-8 characters out.
pub struct TextStream {
    tokenizer: Arc<TextTokenizer>,
    skip_special: bool,
    /// The window of ids still decoded together: ids[..prefix_index] were emitted already (they
    /// give the context the next ids decode in), the rest wait for a whole character.
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    /// With clean_up_tokenization_spaces: text decoded but not given out yet, because a clean-up
    /// rule could still join it with the text that follows (see `clean_up_cut`).
    held: String,
}

/// Ids that may wait for a whole character: beyond them the window's text goes out as decode
/// gives it (with U+FFFD for bytes that are no character), so a step never costs more than this.
const MAX_PENDING: usize = 16;

/// Where text may be cut for clean_up: the largest k such that clean_up(text[..k] + rest) ==
/// clean_up(text[..k]) + clean_up(text[k..] + rest) whatever `rest` follows (0: nowhere yet).
///
/// Every rule of `clean_up` replaces a pattern that starts with a space and is at most 4 characters
/// long, and only ever deletes spaces; `str::replace` matches left to right without overlaps, so a
/// cut is safe when, at every rule in turn, no match can straddle it. That holds at k when
///   - the 4 characters before k hold no space: a straddling match would start with a space among
///     the last 3;
///   - text[k] is a space, text[k - 1] is not an apostrophe, and either text[k - 1] is neither a
///     space nor "n" or text[k + 1] is none of . ? ! , ' n. A straddling match holds text[k - 1]
///     (which no rule changes: it is not a space, or a space no rule can delete without matching
///     across k) followed by what starts the right part. While that is the space, only " ' " fits,
///     after an apostrophe. A rule deletes the space only when text[k + 1] is one of . ? ! , ' n;
///     the right part then starts with that character, which fits after a space (" .", " n't",
///     ...) or after "n" (" n't") only.
/// tests/conformance/test_text.c and bindings/python/tests/test_text.py check the stream against
/// decode on ids in any order; the rules were also checked exhaustively on short texts.
fn clean_up_cut(text: &str) -> usize {
    let b = text.as_bytes();
    let mut run = 0; // characters other than a space just before k
    let mut cut = 0;
    for (k, c) in text.char_indices() {
        if k > 0 && (run >= 4 || (c == ' ' && space_cut_is_safe(b[k - 1], b.get(k + 1).copied()))) {
            cut = k;
        }
        run = if c == ' ' { 0 } else { run + 1 };
    }
    if run >= 4 {
        cut = b.len();
    }
    cut
}

/// `clean_up_cut`'s rule for a cut before a space, from the byte before it and the one after it.
fn space_cut_is_safe(before: u8, after: Option<u8>) -> bool {
    before != b'\''
        && (!matches!(before, b' ' | b'n')
            || matches!(after, Some(a) if !matches!(a, b'.' | b'?' | b'!' | b',' | b'\'' | b'n')))
}

impl TextStream {
    /// Hugging Face tokenizers' DecodeStream::step, with the window bounded by MAX_PENDING, and
    /// clean_up_tokenization_spaces applied as decode applies it.
    fn step(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let string = match self.tokenizer.decode_u32(&self.ids, self.skip_special) {
            Ok(s) => s,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        let pending = self.ids.len() - self.prefix_index;
        let whole = string.len() > self.prefix.len() && !string.ends_with('\u{FFFD}');
        if !whole && pending < MAX_PENDING {
            return Ok(String::new());
        }
        let text = self.emit(string)?;
        Ok(self.clean(text))
    }

    /// What the stream holds back, decoded as it is (U+FFFD for bytes that form no character),
    /// clean_up_tokenization_spaces applied as at the end of the text; the stream then holds
    /// nothing and goes on with the ids so far as the context of the next ones.
    fn flush(&mut self) -> Result<String> {
        let mut text = std::mem::take(&mut self.held);
        if self.ids.len() > self.prefix_index {
            let string = self.tokenizer.decode_u32(&self.ids, self.skip_special)?;
            text.push_str(&self.emit(string)?);
        }
        Ok(if self.tokenizer.clean_up_spaces { clean_up(text) } else { text })
    }

    /// Gives out the window's text past what was emitted (`string` is the window's decode) and
    /// slides the window: the ids just emitted become the context of the next ones.
    fn emit(&mut self, string: String) -> Result<String> {
        // The ids not emitted yet, which become the next window.
        self.ids.drain(..self.prefix_index);
        let new_text = match string.strip_prefix(self.prefix.as_str()) {
            Some(rest) => {
                let new_text = rest.to_string();
                self.prefix = self.tokenizer.decode_u32(&self.ids, self.skip_special)?;
                new_text
            }
            None => {
                // The window no longer decodes to what was emitted followed by more: a decoder that
                // looks at neighbours, or bytes given out as U+FFFD after MAX_PENDING ids that now
                // complete a character. What was emitted stands; the ids not emitted yet go out
                // decoded together, without the context.
                self.prefix = self.tokenizer.decode_u32(&self.ids, self.skip_special)?;
                self.prefix.clone()
            }
        };
        self.prefix_index = self.ids.len();
        Ok(new_text)
    }

    /// With clean_up_tokenization_spaces, the part of `text` (after what is held) that no text to
    /// come can change; the rest is held.
    fn clean(&mut self, text: String) -> String {
        if !self.tokenizer.clean_up_spaces {
            return text;
        }
        self.held.push_str(&text);
        let rest = self.held.split_off(clean_up_cut(&self.held));
        clean_up(std::mem::replace(&mut self.held, rest))
    }
}

/// A new stream over `t` (which it keeps alive).
///
/// # Safety
/// `t` is a live tokenizer; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_stream_new(t: *const TextTokenizer, skip_special: i32, out: *mut *mut TextStream) {
    Arc::increment_strong_count(t);
    let tokenizer = Arc::from_raw(t);
    let stream = TextStream {
        tokenizer,
        skip_special: skip_special != 0,
        ids: Vec::new(),
        prefix: String::new(),
        prefix_index: 0,
        held: String::new(),
    };
    *out = Box::into_raw(Box::new(stream));
}

/// Feed one id; `text` gets the whole characters it completes (possibly none), freed with
/// ptxt_free_bytes.
///
/// # Safety
/// `s` is a live stream used by one thread at a time; outputs are writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_stream_step(
    s: *mut TextStream,
    id: i64,
    text: *mut *mut u8,
    len: *mut usize,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let s = &mut *s;
        let id = s.tokenizer.check_ids(&[id])?[0];
        let out = s.step(id)?;
        give_bytes(out.into_bytes(), text, len);
        Ok(())
    })
}

/// Give out what the stream holds back (`text`, freed with ptxt_free_bytes): the ids that complete
/// no character yet, decoded with U+FFFD for their bytes, and text clean_up_tokenization_spaces
/// still held. The stream goes on from there.
///
/// # Safety
/// `s` is a live stream used by one thread at a time; outputs are writable.
#[no_mangle]
pub unsafe extern "C" fn ptxt_stream_flush(
    s: *mut TextStream,
    text: *mut *mut u8,
    len: *mut usize,
    err: *mut *mut u8,
    err_len: *mut usize,
) -> i32 {
    guarded(err, err_len, || {
        let s = &mut *s;
        let out = s.flush()?;
        give_bytes(out.into_bytes(), text, len);
        Ok(())
    })
}

/// Free a stream. NULL is ignored.
///
/// # Safety
/// `s` is NULL or from ptxt_stream_new, freed once.
#[no_mangle]
pub unsafe extern "C" fn ptxt_stream_free(s: *mut TextStream) {
    if !s.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(s))));
    }
}

/// Free bytes this library handed out (text, messages).
///
/// # Safety
/// `ptr`, `len` are exactly as handed out, freed once.
#[no_mangle]
pub unsafe extern "C" fn ptxt_free_bytes(ptr: *mut u8, len: usize) {
    if !ptr.is_null() {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)));
    }
}

/// Free ids this library handed out.
///
/// # Safety
/// `ptr`, `count` are exactly as handed out, freed once.
#[no_mangle]
pub unsafe extern "C" fn ptxt_free_ids(ptr: *mut i64, count: usize) {
    if !ptr.is_null() {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, count)));
    }
}
