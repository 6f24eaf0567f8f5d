"""Text in and out through libpipe's own tokenizer (pipe.h, "Text", libpipe >= 0.14).

    tok = Tokenizer.load("path/to/hf-model-folder")      # tokenizer.json, tokenizer_config.json, ...
    ids = tok.encode("Hello")                            # as transformers' tok.encode("Hello")
    text = tok.decode(ids, skip_special_tokens=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    stream = tok.decode_stream(skip_special_tokens=True) # then stream.step(id) -> whole characters,
    tail = stream.flush()                                # and at the end what it held back

Hugging Face's tokenizers library (its Rust crate, inside libpipe.so) does the work, so neither
transformers nor the `tokenizers` package is needed at run time. A Tokenizer may be used by any
number of threads at once; a DecodeStream by one at a time (it serializes its callers). It also
plugs into Generator.generate(..., tokenizer=tok): it has encode and decode.
"""

import os
import threading

from .runtime import _Closeable, _Handle, _lib


def _utf8(text):
    """str as UTF-8 bytes; lone surrogates pass through, so that libpipe refuses them by name."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    if not isinstance(text, str):
        raise TypeError(f"text must be str or bytes, not {type(text).__name__}")
    return text.encode("utf-8", "surrogatepass")


def _messages(messages):
    """Chat messages as (role, content) pairs: dicts with "role" and "content", or pairs."""
    pairs = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            role, content = message.get("role"), message.get("content")
        else:
            role, content = message
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"message {i} needs a str role and a str content")
        pairs.append((role, content))
    return pairs


class Tokenizer(_Closeable):
    """A Hugging Face model folder's tokenizer, special tokens, stop ids and chat template."""

    def __init__(self, ptr, folder):
        lib = _lib()
        self._handle = _Handle(ptr, lib.pipe_tokenizer_destroy, "tokenizer", 3)
        self.folder = folder
        self._vocab_size = lib.pipe_tokenizer_vocab_size(ptr)
        bos, eos, pad = lib.pipe_tokenizer_special_ids(ptr)
        self._special = tuple(None if i < 0 else i for i in (bos, eos, pad))
        self._stop_ids = tuple(lib.pipe_tokenizer_stop_ids(ptr))

    @classmethod
    def load(cls, folder):
        """Load the tokenizer of a Hugging Face model folder (its tokenizer.json, with
        tokenizer_config.json, chat_template.jinja, generation_config.json and config.json when
        present). NotFoundError without tokenizer.json; InvalidFormatError for a file that does not
        parse."""
        folder = os.fsdecode(os.fspath(folder))
        return cls(_lib().pipe_tokenizer_load(folder), folder)

    @property
    def vocab_size(self):
        """One past the largest id: ids are 0 .. vocab_size - 1."""
        return self._vocab_size

    @property
    def bos_token_id(self):
        return self._special[0]

    @property
    def eos_token_id(self):
        return self._special[1]

    @property
    def pad_token_id(self):
        return self._special[2]

    @property
    def stop_ids(self):
        """The ids that end a generation (generation_config.json's eos_token_id, one or several,
        and the tokenizer's eos token), for Generator.generate(stop_ids=...)."""
        return self._stop_ids

    def encode(self, text, add_special_tokens=True):
        """Token ids of `text` (str, or UTF-8 bytes), with the special tokens the tokenizer adds
        (a leading BOS, ...) unless add_special_tokens is False: transformers' encode.
        InvalidArgumentError for bytes that are not UTF-8."""
        data = _utf8(text)
        with self._handle.use() as h:
            return list(_lib().pipe_tokenizer_encode(h, data, 1 if add_special_tokens else 0))

    def decode(self, ids, skip_special_tokens=False):
        """The text of `ids`: transformers' decode. InvalidArgumentError for an id outside the
        vocabulary."""
        ids = [int(i) for i in ids]
        with self._handle.use() as h:
            return _lib().pipe_tokenizer_decode(h, ids, 1 if skip_special_tokens else 0)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        """The folder's chat template over `messages` ({"role", "content"} dicts or (role, content)
        pairs): transformers' apply_chat_template(messages, tokenize=..., add_generation_prompt=...).
        With tokenize=True the ids (encoded without added special tokens, as transformers does).
        InvalidFormatError when the folder has no template; InvalidArgumentError when the template
        raises for this conversation."""
        pairs = _messages(messages)
        with self._handle.use() as h:
            text = _lib().pipe_tokenizer_apply_chat_template(h, pairs, 1 if add_generation_prompt else 0)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def decode_stream(self, skip_special_tokens=False):
        """A DecodeStream: feed it ids one at a time, get whole characters back."""
        with self._handle.use() as h:
            return DecodeStream(_lib().pipe_decode_stream_create(h, 1 if skip_special_tokens else 0))


class DecodeStream(_Closeable):
    """Ids in one at a time, text out in whole UTF-8 characters (pipe_decode_stream_push): what
    step() returns, put together with flush() at the end, is the decode of every id fed. Outlives
    its Tokenizer."""

    def __init__(self, ptr):
        self._handle = _Handle(ptr, _lib().pipe_decode_stream_destroy, "decode stream", 3)
        self._lock = threading.Lock()  # the C stream is exclusive

    def step(self, token_id):
        """The characters `token_id` completes; "" while a character waits for its last bytes."""
        with self._lock, self._handle.use() as h:
            return _lib().pipe_decode_stream_push(h, int(token_id))

    def flush(self):
        """What the stream holds back, as the end of the text (pipe_decode_stream_flush): ids that
        complete no character yet, with U+FFFD for their bytes; "" when it holds nothing. Call it
        when the ids end; the stream may go on after it (the ids so far stay the context)."""
        with self._lock, self._handle.use() as h:
            return _lib().pipe_decode_stream_flush(h)
