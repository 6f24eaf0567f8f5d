"""Tokenizer folders in the styles of Hugging Face's GPT-2, Qwen2, Llama and Mistral, built locally.

No model hub is reachable, so each is a small BPE trained here with the `tokenizers` library on a
varied corpus, in its family's layout: byte-level BPE with GPT-2's or Qwen2's pre-tokenizer
(gpt2, qwen2), and SentencePiece-like BPE with byte fallback, written the way the Llama
converter writes it (normalizer Prepend + Replace, no pre-tokenizer: llama) or with the Metaspace
pre-tokenizer (mistral). Each is wrapped in transformers' PreTrainedTokenizerFast with its family's
special tokens and chat template and saved with save_pretrained, plus a generation_config.json, so
the folder is what a model's folder holds. libpipe's tokenizer (pipe.h, "Text") is checked against
transformers' AutoTokenizer on these folders (bindings/python/tests/test_text.py), and the C
conformance test reads them (tests/conformance/test_text.c).

    python text_tokenizers.py OUT_DIR     # writes OUT_DIR/{gpt2,qwen2,llama,mistral,bare,wordpiece,neighbours}/

(bare/ holds gpt2's tokenizer.json alone; wordpiece/ is a BERT-like WordPiece tokenizer whose
tokenizer_config.json asks for clean_up_tokenization_spaces, which transformers' decode applies to
it; neighbours/ is a tokenizer whose decoder joins neighbouring tokens, see neighbours().)

Besides the folder, each gets two files for the C test: `c-reference-ids.txt`, transformers' ids
for C_TEXT (with special tokens), and `c-reference-chat.txt`, its chat template's text for C_CHAT.
"""

import json
import os
import sys

# Trained on this (repeated): code, several scripts, emoji, whitespace runs.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! It's a test; isn't it?",
    "def add(a, b):\n    return a + b  # sums\n\nfor i in range(10):\n\tprint(i * 2)",
    "Größe, café, naïve façade; Ελληνικά γράμματα; русский текст; ქართული",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "emoji: 👋🌍🚀 ❤️ 👩‍💻 and numbers 12345 3.14159 1e-9",
    "tabs\tand  double  spaces   and\n\nnew lines\r\nend",
    "<b>markup</b> & {json: [1, 2, 3]} $x^2$ @user #tag",
]

# The C conformance test's texts (test_text.c holds the same strings).
C_TEXT = "Hello, w\u00f6rld! \U0001f44b \u65e5\u672c"
C_CHAT = [("system", "Be brief."), ("user", "Hi \U0001f44b"), ("assistant", "Hello!"), ("user", "Bye")]

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'].strip() + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 2's chat template (its tokenizer_config.json's), which reads bos_token and eos_token.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Mistral's (v0.1 instruct, with a system prompt folded into the first user turn), with loop controls
# and Python string methods.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'].startswith(' ') %}{% continue %}{% endif %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""


def _trainer_corpus():
    return CORPUS * 20


def _byte_level(style):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = ["<|endoftext|>"]
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_trainer_corpus(), trainer)
    return tok


def _sentencepiece_like(style):
    """BPE with byte fallback: <unk> <s> </s>, then <0x00>..<0xFF> in the vocabulary (not added
    tokens), then the trained pieces, as Llama's and Mistral's tokenizer.json hold them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained.train_from_iterator(_trainer_corpus(), trainers.BpeTrainer(vocab_size=700, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [
                decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
                decoders.ByteFallback(),
                decoders.Fuse(),
            ]
        )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if style == "mistral":
        tok.add_tokens(["[INST]", "[/INST]"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


STYLES = {
    # style: (builder, special tokens, chat template, generation_config's eos_token_id as names)
    "gpt2": (
        _byte_level,
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
        CHATML,
        None,
    ),
    "qwen2": (
        _byte_level,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        CHATML,
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "llama": (_sentencepiece_like, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, LLAMA2, "</s>"),
    "mistral": (_sentencepiece_like, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, MISTRAL, "</s>"),
}


def build(style, out):
    """Writes the folder of `style` into `out` and returns transformers' tokenizer for it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    builder, specials, template, eos = STYLES[style]
    tok = builder(style)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    wrapped.chat_template = template
    os.makedirs(out, exist_ok=True)
    wrapped.save_pretrained(out)
    if eos is not None:
        names = eos if isinstance(eos, list) else [eos]
        ids = [tok.token_to_id(n) for n in names]
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": ids if isinstance(eos, list) else ids[0]}, f)
    reference = AutoTokenizer.from_pretrained(out)
    ids = reference.encode(C_TEXT, add_special_tokens=True)
    chat = reference.apply_chat_template(
        [{"role": r, "content": c} for r, c in C_CHAT],
        tokenize=False,
        add_generation_prompt=False,
    )
    with open(os.path.join(out, "c-reference-ids.txt"), "w") as f:
        f.write(" ".join(map(str, ids)) + "\n")
    with open(os.path.join(out, "c-reference-chat.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(chat)
    return reference


def wordpiece(out):
    """A WordPiece tokenizer (BERT's normalizer and pre-tokenizer, the decoder without its own
    clean-up) saved by transformers with clean_up_tokenization_spaces: decode applies it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[PAD]"], show_progress=False)
    tok.train_from_iterator(_trainer_corpus(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    wrapped.save_pretrained(out)
    return wrapped


# neighbours/'s vocabulary: its decoder writes "X" for "a" followed by "b".
NEIGHBOURS_VOCAB = {"a": 0, "b": 1, "c": 2, "[UNK]": 3}


def neighbours(out):
    """A tokenizer whose decoder looks at neighbouring tokens: Fuse, then Replace("ab", "X"), so
    decode(["a"]) is "a" but decode(["a", "b"]) is "X": the text of earlier ids changes with later
    ones, which a decode stream cannot take back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=NEIGHBOURS_VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: text_tokenizers.py OUT_DIR")
    for style in STYLES:
        build(style, os.path.join(sys.argv[1], style))
    # A folder with a tokenizer and nothing else: no chat template, no special tokens named.
    bare = os.path.join(sys.argv[1], "bare")
    os.makedirs(bare, exist_ok=True)
    with open(os.path.join(sys.argv[1], "gpt2", "tokenizer.json"), "rb") as src:
        data = src.read()
    with open(os.path.join(bare, "tokenizer.json"), "wb") as dst:
        dst.write(data)
    wordpiece(os.path.join(sys.argv[1], "wordpiece"))
    neighbours(os.path.join(sys.argv[1], "neighbours"))


if __name__ == "__main__":
    main()
