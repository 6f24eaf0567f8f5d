//! pipe::Tokenizer and DecodeStream (pipe.h's "Text") on the tokenizer folders of
//! tests/models/text_tokenizers.py (staged into LIBPIPE_FIXTURES/text): ids and chat text equal
//! transformers' (the reference files that script writes), round trips, whole characters from the
//! stream, and errors.
use std::path::PathBuf;

use pipe::{Status, Tokenizer};

// tests/models/text_tokenizers.py's C_TEXT and C_CHAT.
const TEXT: &str = "Hello, w\u{f6}rld! \u{1f44b} \u{65e5}\u{672c}";
const CHAT: [(&str, &str); 4] =
    [("system", "Be brief."), ("user", "Hi \u{1f44b}"), ("assistant", "Hello!"), ("user", "Bye")];

fn folder(style: &str) -> PathBuf {
    let dir = std::env::var_os("LIBPIPE_FIXTURES")
        .expect("LIBPIPE_FIXTURES must name the fixture folder (run-tests.sh sets it)");
    PathBuf::from(dir).join("text").join(style)
}

#[test]
fn matches_transformers() {
    for style in ["gpt2", "qwen2", "llama", "mistral"] {
        let dir = folder(style);
        let tok = Tokenizer::load(&dir).unwrap();
        let want: Vec<i64> = std::fs::read_to_string(dir.join("c-reference-ids.txt"))
            .unwrap()
            .split_whitespace()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(tok.encode(TEXT, true).unwrap(), want, "{style}");
        let plain = tok.encode(TEXT, false).unwrap();
        assert_eq!(tok.decode(&plain, false).unwrap(), TEXT, "{style}");
        let chat = std::fs::read_to_string(dir.join("c-reference-chat.txt")).unwrap();
        assert_eq!(tok.apply_chat_template(&CHAT, false).unwrap(), chat, "{style}");
        let mut stream = tok.decode_stream(false).unwrap();
        drop(tok); // the stream outlives its tokenizer
        let joined: String = plain.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(joined, TEXT, "{style}");
        assert_eq!(stream.flush().unwrap(), "", "{style}: nothing held back after whole characters");
    }
}

/// A reply cut inside a character: the pushes hold its bytes back, flush gives them out as U+FFFD,
/// and together they are the decode of the ids; a second flush gives nothing.
#[test]
fn flush_gives_what_is_held_back() {
    // U+1F980 is not in the tokenizers' training text: its bytes are tokens of their own.
    let text = "a \u{1f980} b";
    for style in ["gpt2", "qwen2", "llama", "mistral"] {
        let tok = Tokenizer::load(folder(style)).unwrap();
        let ids = tok.encode(text, false).unwrap();
        let cut = (1..=ids.len())
            .rev()
            .find(|&n| tok.decode(&ids[..n], false).unwrap().ends_with('\u{fffd}'))
            .unwrap_or_else(|| panic!("{style}: no prefix of {ids:?} ends inside the emoji"));
        let mut stream = tok.decode_stream(false).unwrap();
        let mut joined: String = ids[..cut].iter().map(|&id| stream.push(id).unwrap()).collect();
        let tail = stream.flush().unwrap();
        assert!(tail.ends_with('\u{fffd}'), "{style}: flush gave {tail:?}");
        joined.push_str(&tail);
        assert_eq!(joined, tok.decode(&ids[..cut], false).unwrap(), "{style}");
        assert_eq!(stream.flush().unwrap(), "", "{style}");
    }
}

#[test]
fn ids_and_errors() {
    let tok = Tokenizer::load(folder("qwen2")).unwrap();
    let ends = tok.encode("<|im_end|><|endoftext|>", false).unwrap();
    assert_eq!(ends.len(), 2);
    assert_eq!((tok.bos_token_id(), tok.eos_token_id(), tok.pad_token_id()), (None, Some(ends[0]), Some(ends[1])));
    assert_eq!(tok.stop_ids(), &ends[..]);
    let err = tok.encode_bytes(b"caf\xc3", true).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("UTF-8"), "{err}");
    let err = tok.decode(&[1, tok.vocab_size()], false).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    let err = tok.apply_chat_template(&[("user", "a\0b")], true).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    let err = Tokenizer::load(folder("")).err().unwrap();
    assert_eq!(err.status, Status::NotFound);
    let err = Tokenizer::load(folder("bare")).unwrap().apply_chat_template(&CHAT, true).unwrap_err();
    assert_eq!(err.status, Status::InvalidFormat);
    // One tokenizer shared by threads.
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..100 {
                    let ids = tok.encode(TEXT, true).unwrap();
                    assert_eq!(tok.decode(&ids, true).unwrap(), TEXT);
                }
            });
        }
    });
}

static_assertions::assert_impl_all!(Tokenizer: Send, Sync);
static_assertions::assert_impl_all!(pipe::DecodeStream: Send);
static_assertions::assert_not_impl_any!(pipe::DecodeStream: Sync);
