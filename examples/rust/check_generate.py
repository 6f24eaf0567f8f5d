"""Runs the Rust generation example (src/bin/generate.rs) and checks its text against a reference
made without it: the tiny decoder fixture (FIXTURES/tiny_decoder.pt, 2 layers, vocab 128) with a
word-level tokenizer.json written here (token i is the word "t<i>"), which libpipe's tokenizer
reads: every prompt of tiny_decoder.expected.json at once (more than the decoder's slots), each
answer must be the words of transformers' greedy tokens for it. (SmolLM2 and its chat template:
examples/check_chat.py, on the chat example.)

    check_generate.py GENERATE_BINARY FIXTURES WORKDIR

The binary must find libpipe (the caller sets LD_LIBRARY_PATH). Standard library only.
"""

import json
import subprocess
import sys
from pathlib import Path

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def words(ids):
    return " ".join(f"t{i}" for i in ids)


def word_level_tokenizer(vocab):
    """tokenizer.json of a word-level model: "t<i>" is id i, words split at whitespace; decoding
    joins the words with spaces (no decoder)."""
    entries = {f"t{i}": i for i in range(vocab)}
    entries["<unk>"] = vocab  # never in a prompt; the model refuses ids >= vocab anyway
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": entries, "unk_token": "<unk>"},
    }


def run_example(binary, args):
    result = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"check_generate: {binary} {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr}")
    sys.stderr.write(result.stderr)
    return result.stdout


def check_tiny(binary, fixtures, workdir):
    expected = json.loads((fixtures / "tiny_decoder.expected.json").read_text())
    folder = workdir / "tiny"
    folder.mkdir(parents=True, exist_ok=True)
    decoder = folder / "decoder.pt"
    decoder.unlink(missing_ok=True)
    decoder.symlink_to(fixtures / "tiny_decoder.pt")
    (folder / "tokenizer.json").write_text(json.dumps(word_level_tokenizer(expected["vocab"])))
    if len(expected["prompts"]) <= expected["slots"]:
        sys.exit("check_generate: the fixture has no more prompts than slots; none would wait for one")

    # --chat goes through the folder's chat template; this one writes each message's text as it
    # is, so the prompts' ids are the same as without it.
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))

    prompts = [words(p) for p in expected["prompts"]]
    want = [words(g) for g in expected["greedy"]]
    for chat in ([], ["--chat"]):
        out = run_example(binary, [folder, *chat, "--max-new-tokens", expected["max_new_tokens"], *prompts])
        if out.splitlines() != want:
            sys.exit(
                f"check_generate: tiny decoder {chat}: the example printed\n{out}\ntransformers' greedy tokens are\n"
                + "\n".join(want)
            )
    print(f"check_generate: tiny decoder: {len(want)} answers equal transformers' greedy tokens, with --chat too")


def main():
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} GENERATE_BINARY FIXTURES WORKDIR")
    binary, fixtures, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    for name in ("tiny_decoder.pt", "tiny_decoder.expected.json"):
        if not (fixtures / name).is_file():
            sys.exit(f"check_generate: {fixtures / name} is missing (tests/bindings/stage.cmake copies it there)")
    check_tiny(binary, fixtures, workdir)


if __name__ == "__main__":
    main()
