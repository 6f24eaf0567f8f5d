"""Text in and out of a generation, through a tokenizer of the `tokenizers` package (which comes
with transformers): the tiny decoder's greedy tokens through a word-level tokenizer built here (one
word per id), a transformers tokenizer around it, and the incremental decoding of tokens whose bytes
only make a character together (byte-level BPE) or that merge into words (WordPiece)."""

import asyncio

import pytest
import tokenizers
from conftest import WAIT_LIMIT_S

import libpipe
from libpipe.generation import _Codec, _TextStream


@pytest.fixture(scope="module")
def words():
    """One word per id of the tiny decoder's vocabulary: id i is "w<i>"."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tokenizer


def text_of(ids):
    return " ".join(f"w{i}" for i in ids)


def test_text_in_and_out(tiny_generator, decoder_expected, words):
    n = decoder_expected["max_new_tokens"]
    for prompt, want in zip(decoder_expected["prompts"], decoder_expected["greedy"]):
        generation = tiny_generator.generate(text_of(prompt), max_new_tokens=n, tokenizer=words)
        assert generation.prompt == tuple(prompt)  # the text was encoded with the tokenizer
        pieces = list(generation)
        # One piece per token (each word completes at its token), joined: the tokens' text.
        assert len(pieces) == n and "".join(pieces) == text_of(want)
        assert generation.tokens == want
        assert generation.text == generation.wait() == text_of(want)


def test_text_with_async_for(tiny_generator, decoder_expected, words):
    prompt, want = decoder_expected["prompts"][0], decoder_expected["greedy"][0]

    async def main():
        generation = tiny_generator.generate(
            text_of(prompt), max_new_tokens=decoder_expected["max_new_tokens"], tokenizer=words
        )
        return [piece async for piece in generation], await generation

    pieces, whole = asyncio.run(asyncio.wait_for(main(), WAIT_LIMIT_S))
    assert "".join(pieces) == whole == text_of(want)


def test_token_ids_with_a_tokenizer(tiny_generator, decoder_expected, words):
    # A prompt of ids needs no encoding; the output is text all the same.
    prompt, want = decoder_expected["prompts"][0], decoder_expected["greedy"][0]
    generation = tiny_generator.generate(prompt, max_new_tokens=decoder_expected["max_new_tokens"], tokenizer=words)
    assert generation.wait() == text_of(want)


def test_a_transformers_tokenizer(tiny_generator, decoder_expected, words):
    import transformers

    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=words)
    prompt, want = decoder_expected["prompts"][0], decoder_expected["greedy"][0]
    generation = tiny_generator.generate(
        text_of(prompt), max_new_tokens=decoder_expected["max_new_tokens"], tokenizer=wrapped
    )
    assert generation.prompt == tuple(prompt)
    assert "".join(generation) == text_of(want)


def test_text_errors(tiny_generator, words):
    with pytest.raises(libpipe.InvalidArgumentError, match="tokenizer"):
        tiny_generator.generate("w1 w2")  # text without a tokenizer
    with pytest.raises(libpipe.InvalidArgumentError, match="tokenizer"):
        tiny_generator.generate("w1 w2", tokenizer=object())
    with pytest.raises(libpipe.InvalidArgumentError, match="tokenizer"):
        tiny_generator.generate([1, 2], max_new_tokens=1).text


def byte_level():
    """A byte-level BPE tokenizer without merges: one token per UTF-8 byte."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def test_characters_split_over_tokens_come_whole():
    tokenizer = byte_level()
    text = "héllo €😀!"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # multi-byte characters span several tokens
    stream = _TextStream(_Codec(tokenizer))
    pieces = [stream.add(i) for i in ids]
    # A character comes out with its last byte's token, never as U+FFFD before it is complete.
    assert [p for p in pieces if p] == list(text)
    assert stream.flush() == ""


def test_an_unfinished_character_at_the_end():
    tokenizer = byte_level()
    ids = tokenizer.encode("a€").ids
    stream = _TextStream(_Codec(tokenizer))
    assert [stream.add(i) for i in ids[:-1]] == ["a", "", ""]  # held back: maybe more bytes come
    assert stream.flush() == "\ufffd"  # the sequence ended: what there is, as the tokenizer decodes it


def test_tokens_that_merge_into_words():
    vocab = {"[UNK]": 0, "hel": 1, "##lo": 2, "wor": 3, "##ld": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    stream = _TextStream(_Codec(tokenizer))
    assert [stream.add(i) for i in (1, 2, 3, 4)] == ["hel", "lo", " wor", "ld"]
    assert stream.flush() == ""
