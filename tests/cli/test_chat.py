"""`pipe chat`'s command-line contract, on the generation engine's decoder fixtures
(tests/models/decoder_models.py: tiny_decoder.pt, vocab 128, max_len 64, with transformers' greedy
tokens in tiny_decoder.expected.json; gated_decoder.pt, whose steps a test can hold) and a word-level
tokenizer made here whose ids are the decoder's (the word "wN" is id N), with a chat template that
joins the messages' texts with spaces: a conversation's tokens are its messages' words, in order.

- From a pipe: one reply per line, the first equal to transformers' greedy tokens for the first
  message; empty lines skipped; the next message is sent with the conversation so far (its prompt
  holds both messages and the first reply, whose tokens the generator finds in the cache: --stats).
- A reply that fills the decoder's max_len says so on stderr (the reply: every token transformers
  generates after that prompt until the cache is full); a message that no longer fits is refused,
  exit 1, one line.
- A model folder with the decoder exported into it (decoder.pt) works without --tokenizer.
- On a terminal (terminal.py, a pseudo-terminal): a "> " prompt, the reply, Ctrl-D ends with exit 0;
  Ctrl-C while a reply's step is held at the gate stops that reply and the chat goes on; Ctrl-C at
  the prompt drops the line.
- Refused with one line: a folder holding no decoder (saying how to export one), a decoder file
  without a tokenizer, a tokenizer without a chat template, a model that is not a decoder (exit 1);
  malformed or conflicting flags (exit 2).
(SmolLM2 against transformers, multi-turn, over 2 stages and 2 processes: tests/llm/test_chat.py.)
"""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import MODELS, PIPE, assert_one_line_error
from conftest import run_pipe as pipe
from terminal import Terminal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gate"))
from gate import Gate  # noqa: E402  (tests/gate)

TINY = os.path.join(MODELS, "tiny_decoder.pt")
GATED = os.path.join(MODELS, "gated_decoder.pt")
CUT = ["--split-at", "model.layers.1:begin"]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
STATS = re.compile(
    r"^\[(\d+) tokens, [0-9.]+ tokens/s, first token after \d+ ms, (\d+) of (\d+) prompt tokens cached\]$"
)


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(MODELS, "tiny_decoder.expected.json")) as f:
        return json.load(f)


def write_tokenizer(folder, vocab, template=TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template} if template else {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def words_tokenizer(tmp_path_factory, expected):
    return write_tokenizer(tmp_path_factory.mktemp("words"), expected["vocab"])


def words(ids):
    return " ".join(f"w{i}" for i in ids)


def chat(*args, stdin):
    return subprocess.run([PIPE, "chat", *map(str, args)], input=stdin, capture_output=True, text=True, timeout=300)


def stats_lines(stderr):
    return [tuple(map(int, m.groups())) for m in map(STATS.match, stderr.splitlines()) if m]


def test_piped_messages_get_a_reply_line_each_and_the_conversation_is_kept(expected, words_tokenizer):
    first, reply = expected["prompts"][1], expected["greedy"][1]
    second = [5, 6, 7]
    n = expected["max_new_tokens"]
    result = chat(
        TINY,
        "--tokenizer",
        words_tokenizer,
        *CUT,
        "--max-new-tokens",
        n,
        "--stats",
        stdin=f"{words(first)}\n\n  \n{words(second)}\n",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == 3 and lines[2] == "", result.stdout  # two replies, each ending its line
    assert lines[0] == words(reply)
    assert len(lines[1].split()) == n
    # Every reply ran to --max-new-tokens (this tokenizer names no stop id), and says so.
    assert result.stderr.count(f"[reply cut at {n} tokens (--max-new-tokens)]") == 2, result.stderr
    (gen1, cached1, prompt1), (gen2, cached2, prompt2), *rest = stats_lines(result.stderr)
    assert not rest and gen1 == gen2 == n
    assert (cached1, prompt1) == (0, len(first))
    # The second prompt is the whole conversation: the first message, its reply and the second message;
    # the first turn's tokens came from the cache slot it left.
    assert prompt2 == len(first) + n + len(second)
    assert cached2 >= len(first), result.stderr
    assert "[chat: 2 replies" in result.stderr


def test_a_model_folder_holds_decoder_and_tokenizer(expected, words_tokenizer, tmp_path):
    folder = write_tokenizer(tmp_path, expected["vocab"])
    os.symlink(TINY, folder / "decoder.pt")
    first, reply = expected["prompts"][2], expected["greedy"][2]
    result = chat(folder, *CUT, "--max-new-tokens", expected["max_new_tokens"], stdin=words(first) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == words(reply) + "\n"


def test_a_reply_that_fills_the_cache_says_so_and_a_message_that_no_longer_fits_is_refused(expected, words_tokenizer):
    prompt, reply = expected["max_len_prompt"], expected["max_len_greedy"]
    result = chat(TINY, "--tokenizer", words_tokenizer, stdin=f"{words(prompt)}\nw5\nw6\n")
    assert result.returncode == 1
    assert result.stdout == words(reply) + "\n"  # every token the cache has room for, no limit given
    notes, error = result.stderr.splitlines()[:-1], result.stderr.splitlines()[-1]
    assert notes == [
        f"[reply cut: the conversation filled the decoder's {expected['max_len']} tokens per sequence "
        "(its --max-seq-len)]"
    ]
    assert error.startswith("pipe: error: chat: the conversation no longer fits the decoder"), error
    assert f"holds {expected['max_len']} per sequence" in error and "--max-seq-len" in error


def test_on_a_terminal_a_prompt_the_reply_and_ctrl_d_ends(expected, words_tokenizer):
    first, reply = expected["prompts"][1], expected["greedy"][1]
    term = Terminal(
        [PIPE, "chat", TINY, "--tokenizer", words_tokenizer, *CUT, "--max-new-tokens", expected["max_new_tokens"]]
    )
    try:
        term.expect("Ctrl-D ends the chat.\n")  # the banner, once the model is loaded
        term.expect("> ")
        term.type(words(first) + "\n")
        shown = term.expect("> ")
        # The line typed (the terminal's echo), then the reply, then a blank line before the next prompt.
        assert (
            shown == f"{words(first)}\n{words(reply)}\n[reply cut at {expected['max_new_tokens']} tokens "
            "(--max-new-tokens)]\n\n"
        ), shown
        term.type("\x04")  # Ctrl-D at the start of a line: the end of input
        assert term.exit_status() == 0, term.text()
        assert term.text().endswith("> \n")
    finally:
        term.close()


def test_on_a_terminal_ctrl_c_stops_the_reply_and_the_chat_goes_on(expected, words_tokenizer):
    gate = Gate()
    term = Terminal(
        [PIPE, "chat", GATED, "--tokenizer", words_tokenizer, *CUT, "--max-new-tokens", 4], env=gate.child_env()
    )
    try:
        term.expect("> ")
        term.type("w120 w5 w6\n")  # a prompt starting with id 120: its prefill step waits at gate 1
        gate.wait(1, "stage1")
        term.type("\x03")  # Ctrl-C while the reply's step is held
        term.expect("[reply stopped]")
        gate.open(1, "stage1")
        term.expect("> ")  # the chat goes on
        term.type(words(expected["prompts"][0]) + "\n")
        answer = term.expect("> ")
        assert len(answer.split("\n")[1].split()) == 4, answer  # the echo, then a reply of 4 words
        term.type("w9 w9")
        term.type("\x03")  # at the prompt: the line is dropped
        term.expect("(Ctrl-D ends the chat)\n> ")
        term.type("\x04")
        assert term.exit_status() == 0, term.text()
    finally:
        term.close()


def test_a_folder_without_a_decoder_says_how_to_export_one(tmp_path):
    result = pipe("chat", tmp_path)
    assert result.returncode == 1
    assert_one_line_error(
        result, str(tmp_path), "no decoder", f"python -m libpipe.export_llm {tmp_path} {tmp_path}/decoder.pt"
    )


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    result = pipe("chat", tmp_path / "missing.pt")
    assert result.returncode == 1
    assert_one_line_error(result, "missing.pt", "No such file")


def test_a_tokenizer_without_a_chat_template_is_refused(expected, tmp_path):
    folder = write_tokenizer(tmp_path, expected["vocab"], template=None)
    result = pipe("chat", TINY, "--tokenizer", folder)
    assert result.returncode == 1
    assert_one_line_error(result, "no chat template", "pipe generate --prompt")


def test_a_folder_without_a_tokenizer_is_refused(tmp_path):
    result = pipe("chat", TINY, "--tokenizer", tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, "cannot load the tokenizer", "tokenizer.json", "NOT_FOUND")


def test_a_model_that_is_not_a_decoder_is_refused(words_tokenizer):
    result = subprocess.run(
        [PIPE, "chat", os.path.join(MODELS, "example_code.scripted.pt"), "--tokenizer", str(words_tokenizer)],
        input="w5\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert_one_line_error(result, "cannot create the generator", "decoder", "INVALID_ARGUMENT")


USAGE_ERRORS = [
    ([], ["MODEL_DIR_OR_DECODER is required"]),
    ([TINY], ["decoder file", "--tokenizer DIR"]),
    ([TINY, "hello"], ["unexpected argument 'hello'", "stdin"]),
    ([TINY, "--bogus"], ["unknown option '--bogus'"]),
    ([TINY, "--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
    ([TINY, "--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
    ([TINY, "--temperature", "-1"], ["--temperature"]),
    ([TINY, "--top-k", "5"], ["--top-k", "--temperature"]),
    ([TINY, "--temperature", "1", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    ([TINY, "--seed", "-3"], ["--seed", "'-3'"]),
    ([TINY, "--system"], ["--system needs a value"]),
    ([TINY, "--microbatches", "2"], ["--microbatches", "does not apply"]),
    ([TINY, "--stages", "2", "--policy", "time"], ["--policy time"]),
    ([TINY, "--processes", "0"], ["--processes", "at least 1"]),
]


@pytest.mark.parametrize(
    "args,needles", USAGE_ERRORS, ids=[" ".join(os.path.basename(x) for x in a) or "none" for a, _ in USAGE_ERRORS]
)
def test_usage_errors_are_one_line(args, needles):
    result = pipe("chat", *args)
    assert result.returncode == 2
    assert_one_line_error(result, "chat", *needles)


def test_help_names_chat():
    result = pipe("chat", "--help")
    assert result.returncode == 0
    assert "chat MODEL_DIR_OR_DECODER [SPLIT]" in result.stdout
