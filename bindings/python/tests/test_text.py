"""libpipe.text (pipe.h, "Text") against transformers' AutoTokenizer: encode, decode, the decode stream,
special and stop ids, and the chat template, on tokenizers of the GPT-2, Qwen2, Llama and Mistral
styles trained and saved here (tests/models/text_tokenizers.py; no hub is reachable) and on the real
SmolLM2 folder (tests/models/smollm2.py): that test runs in ctest's bindings_python_smollm2, which
needs the smollm2 fixture and sets LIBPIPE_TEST_SMOLLM2=1, and fails there if the folder cannot be
had; bindings_python's run of this file leaves it to that test."""

import json
import os
import sys
from pathlib import Path

import pytest

import libpipe
from libpipe.text import Tokenizer

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "models"))
import smollm2  # noqa: E402
import text_tokenizers  # noqa: E402

transformers = pytest.importorskip("transformers")

# Varied text: code, several scripts, emoji (with joiners and modifiers), whitespace runs, special
# tokens written inside text, characters no tokenizer here was trained on (byte fallback).
CORPUS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot",
    "Größe café naïve façade — «quotes» ‘single’",
    "Ελληνικά, русский, ქართული, עברית, العربية, हिन्दी",
    "日本語のテキスト。中文文本，繁體字。한국어 텍스트입니다.",
    "emoji 👋🌍🚀 ❤️ 👩‍💻 👍🏽 🇫🇷 🦀🎉",
    "tabs\t\tand    runs   of spaces\n\n\nand\r\nline ends   ",
    "numbers 1234567890 3.14159 -2e-10 0x1F",
    "<|im_start|>user\nhi<|im_end|> inside text <s> </s> <|endoftext|>",
    "[INST] instruction [/INST] answer",
    "unknown scripts: ᚠᛇᚻ ꦧꦱꦗꦮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a" * 300 + " " + "ab " * 50,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3? 🤔"},
    ],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "  Another one, with spaces  "},
    ],
]


@pytest.fixture(scope="module")
def styles(tmp_path_factory):
    """{style: (folder, transformers' tokenizer)} for the four styles."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for style in text_tokenizers.STYLES:
        folder = root / style
        out[style] = (folder, text_tokenizers.build(style, str(folder)))
    return out


def each_tokenizer(styles):
    for style, (folder, reference) in styles.items():
        yield style, Tokenizer.load(folder), reference


def check_like_transformers(name, tok, reference, conversations):
    for text in CORPUS:
        for special in (True, False):
            want = reference.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == want, (name, text, special)
            for skip in (False, True):
                assert tok.decode(want, skip_special_tokens=skip) == reference.decode(want, skip_special_tokens=skip), (
                    name,
                    text,
                    skip,
                )
    for conversation in conversations:
        for prompt in (False, True):
            want = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert tok.apply_chat_template(conversation, add_generation_prompt=prompt) == want, (name, conversation)
            ids = reference.apply_chat_template(conversation, tokenize=True, add_generation_prompt=prompt)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert tok.apply_chat_template(conversation, add_generation_prompt=prompt, tokenize=True) == list(ids)
    assert tok.bos_token_id == reference.bos_token_id
    assert tok.eos_token_id == reference.eos_token_id
    assert tok.pad_token_id == reference.pad_token_id
    assert tok.vocab_size == max(reference.get_vocab().values()) + 1


def test_like_transformers(styles):
    for style, tok, reference in each_tokenizer(styles):
        with tok:
            # Llama 2's template wants user and assistant turns alternating after the system message.
            check_like_transformers(style, tok, reference, CONVERSATIONS)


@pytest.mark.skipif(
    os.environ.get("LIBPIPE_TEST_SMOLLM2") != "1",
    reason="ctest's bindings_python_smollm2 runs it, on the smollm2 fixture",
)
def test_smollm2_like_transformers():
    folder = smollm2.smollm2_folder()  # the fixture's folder; FixtureError (a failure) if it cannot be had
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    with Tokenizer.load(folder) as tok:
        check_like_transformers("smollm2", tok, reference, CONVERSATIONS)
        generation = json.loads((folder / "generation_config.json").read_text())
        eos = generation["eos_token_id"]
        assert set(tok.stop_ids) == set(eos if isinstance(eos, list) else [eos]) | {reference.eos_token_id}


def test_stop_ids_from_generation_config(styles):
    for style, tok, reference in each_tokenizer(styles):
        with tok:
            path = Path(styles[style][0]) / "generation_config.json"
            named = json.loads(path.read_text())["eos_token_id"] if path.exists() else []
            named = named if isinstance(named, list) else [named]
            want = named + [i for i in [reference.eos_token_id] if i is not None and i not in named]
            assert list(tok.stop_ids) == want, style
    assert len(named) >= 1


def stream_text(tok, ids, skip):
    """The pieces a fresh decode stream gives for ids, and its flush at the end."""
    with tok.decode_stream(skip_special_tokens=skip) as stream:
        pieces = [stream.step(i) for i in ids]
        tail = stream.flush()
        assert stream.flush() == "", "a second flush gives nothing"
    return pieces, tail


def expected_stream_text(reference, ids, skip):
    """What a decode stream's pieces and flush give for ids, by pipe.h, from transformers' decode:
    the decode of all the ids, unless they end inside a character and that decode does not begin
    with the text of the ids up to the last one that gave text (a byte-fallback decoder makes U+FFFD
    of every byte of a run of byte tokens that ends inside a character, characters whole before
    included): then that text, and the ids after it decoded alone."""
    want = reference.decode(ids, skip_special_tokens=skip)
    m, given = 0, ""  # the ids that gave text last, and the text up to them
    for k in range(1, len(ids)):
        text = reference.decode(ids[:k], skip_special_tokens=skip)
        if not text.endswith("\ufffd") and len(text.encode()) > len(given.encode()):
            m, given = k, text
    if want.startswith(given):
        return want
    return given + reference.decode(ids[m:], skip_special_tokens=skip)


def test_stream_adds_up_to_decode(styles):
    """Pieces and the flush put together are transformers' decode, also of the ids cut anywhere
    inside a character (where the flush gives the cut character's bytes as U+FFFD)."""
    cuts_inside = 0
    for style, tok, reference in each_tokenizer(styles):
        with tok:
            for text in CORPUS:
                ids = reference.encode(text, add_special_tokens=True)
                for skip in (False, True):
                    pieces, tail = stream_text(tok, ids, skip)
                    want = reference.decode(ids, skip_special_tokens=skip)
                    assert "".join(pieces) + tail == want, (style, text, skip, pieces, tail)
                    assert tail == "", (style, text, skip, tail)  # the text ends with a whole character
                    # Whole characters only: no piece carries a replacement character decode lacks.
                    assert "\ufffd" not in "".join(pieces) or "\ufffd" in want
                    for n in range(1, len(ids)):
                        if not reference.decode(ids[:n], skip_special_tokens=skip).endswith("\ufffd"):
                            continue
                        cuts_inside += 1
                        want = expected_stream_text(reference, ids[:n], skip)
                        if style in ("gpt2", "qwen2"):  # byte-level: always the decode itself
                            assert want == reference.decode(ids[:n], skip_special_tokens=skip)
                        pieces, tail = stream_text(tok, ids[:n], skip)
                        assert "".join(pieces) + tail == want, (style, text, skip, n, pieces, tail)
                        assert tail.endswith("\ufffd") and "\ufffd" not in "".join(pieces), (style, text, n, pieces)
    assert cuts_inside > 0, "no cut of the corpus falls inside a character"


def test_stream_flush_goes_on(styles):
    """After a flush the stream holds nothing and continues the text: the ids so far stay the
    context of the next ones (Llama's and Mistral's decoders drop only the text's first space)."""
    for style, tok, reference in each_tokenizer(styles):
        with tok:
            ids = reference.encode("Hello world, again and again", add_special_tokens=False)
            with tok.decode_stream() as stream:
                assert stream.flush() == ""
                text = ""
                for i in ids:
                    text += stream.step(i)
                    text += stream.flush()
            assert text == reference.decode(ids), (style, text)


def test_stream_restarts_at_ids_not_given_out(styles, tmp_path):
    """When the window's text stops beginning with what the stream gave out, the ids it held back
    go out decoded together (transformers' decode of them alone), never lost."""
    # A byte-fallback tokenizer (Llama's style): 15 skipped <s> and a 4-byte character's first byte
    # are 16 ids that complete no character, so U+FFFD goes out; the next 3 bytes complete the
    # character, which the window then decodes to, not beginning with that U+FFFD.
    _, reference = styles["llama"]
    with Tokenizer.load(styles["llama"][0]) as tok:
        crab = [reference.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "\U0001f980".encode()]
        ids = [reference.bos_token_id] * 15 + crab
        pieces, tail = stream_text(tok, ids, True)
        first = reference.decode(ids[:16], skip_special_tokens=True)
        rest = reference.decode(ids[16:], skip_special_tokens=True)
        assert (first, rest) == ("\ufffd", "\ufffd" * 3)
        assert pieces == [""] * 15 + [first, "", "", rest] and tail == "", pieces
    # A decoder that looks at neighbours: "a" then "b" decode to "X".
    text_tokenizers.neighbours(str(tmp_path / "neighbours"))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "neighbours" / "tokenizer.json"))
    a, b, c = (text_tokenizers.NEIGHBOURS_VOCAB[t] for t in "abc")
    with Tokenizer.load(tmp_path / "neighbours") as tok:
        assert reference.decode([a, b, c]) == tok.decode([a, b, c]) == "Xc"
        pieces, tail = stream_text(tok, [a, b, c], False)
        assert pieces == [reference.decode([a]), "", reference.decode([b, c])] and tail == "", pieces
        pieces, tail = stream_text(tok, [a, b], False)  # the flush too
        assert pieces == [reference.decode([a]), ""] and tail == reference.decode([b]), (pieces, tail)


def test_stream_cleans_up_as_decode(tmp_path):
    """With clean_up_tokenization_spaces (a WordPiece tokenizer), the stream's text is
    transformers' decode, clean-up included, however the ids follow one another."""
    import random

    reference = text_tokenizers.wordpiece(str(tmp_path / "wordpiece"))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "wordpiece")
    sentence = "Hello , world ! It 's a test ; is n't it ? I 'm here . They 've , we 're ' ' n't"
    ids = reference.encode(sentence, add_special_tokens=False)
    pool = sorted(set(ids))
    rng = random.Random(1)
    with Tokenizer.load(tmp_path / "wordpiece") as tok:
        pieces, tail = stream_text(tok, ids, False)
        want = reference.decode(ids)
        assert "".join(pieces) + tail == want and " ." not in want, (pieces, tail, want)
        assert sum(1 for p in pieces if p) > len(ids) // 3, "the stream gives text as it comes"
        for _ in range(500):
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
            pieces, tail = stream_text(tok, ids, False)
            assert "".join(pieces) + tail == reference.decode(ids), (ids, pieces, tail)


def test_errors(styles):
    folder, _ = styles["gpt2"]
    with Tokenizer.load(folder) as tok:
        with pytest.raises(libpipe.InvalidArgumentError, match="not valid UTF-8"):
            tok.encode(b"caf\xc3")
        with pytest.raises(libpipe.InvalidArgumentError, match="not valid UTF-8"):
            tok.encode("lone \ud800 surrogate")
        with pytest.raises(libpipe.InvalidArgumentError, match="outside the vocabulary"):
            tok.decode([1, tok.vocab_size])
        stream = tok.decode_stream()
        with pytest.raises(libpipe.InvalidArgumentError):
            stream.step(-1)
        assert stream.step(tok.encode("a")[0]) == "a"
    with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
        tok.encode("a")
    with pytest.raises(libpipe.NotFoundError, match="tokenizer.json"):
        Tokenizer.load(Path(folder).parent)
    bare = Path(folder).parent / "bare"
    bare.mkdir(exist_ok=True)
    (bare / "tokenizer.json").write_bytes((Path(folder) / "tokenizer.json").read_bytes())
    with Tokenizer.load(bare) as tok:
        with pytest.raises(libpipe.InvalidFormatError, match="no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert tok.stop_ids == () and tok.eos_token_id is None
    (bare / "tokenizer.json").write_text("{not json")
    with pytest.raises(libpipe.InvalidFormatError):
        Tokenizer.load(bare)


def test_clean_up_tokenization_spaces_as_transformers(styles, tmp_path):
    """tokenizer_config.json's clean_up_tokenization_spaces: transformers applies it to WordPiece
    tokenizers and ignores it for BPE ones; so does libpipe."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    wordpiece = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[PAD]"], show_progress=False)
    wordpiece.train_from_iterator(text_tokenizers.CORPUS * 10, trainer)
    bpe_folder, _ = styles["gpt2"]
    bpe = HFTokenizer.from_file(str(Path(bpe_folder) / "tokenizer.json"))
    text = "Hello , world ! It 's a test ; is n't it ? I 'm here . They 've , we 're"
    for name, tok in (("wordpiece", wordpiece), ("bpe", bpe)):
        folder = tmp_path / name
        wrapped = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]" if name == "wordpiece" else None, clean_up_tokenization_spaces=True
        )
        wrapped.save_pretrained(folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert config["clean_up_tokenization_spaces"] is True
        reference = transformers.AutoTokenizer.from_pretrained(folder)
        ids = reference.encode(text, add_special_tokens=False)
        with Tokenizer.load(folder) as mine:
            assert mine.decode(ids) == reference.decode(ids), name
