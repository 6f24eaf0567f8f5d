"""The chat examples (examples/c/chat.c, examples/go/chat, examples/python/chat.py,
examples/rust/src/bin/chat.rs) against transformers, on SmolLM2-135M-Instruct.

Each example asks "What is the capital of France?" through the model's own chat template (loaded
by libpipe from the model folder: no tokenizer library of its own), generates greedily over 2
stages and prints the prompt's ids (with --prompt-ids) and the streamed reply. Two steps:

    check_chat.py prepare DIR
        once, for every language (ctest's smollm2_chat fixture): DIR gets the model folder's files
        (links to tests/models/smollm2.py's converted folder), decoder.pt exported with
        libpipe.export_llm, and reference.json: transformers' prompt ids
        (AutoTokenizer.apply_chat_template) and greedy reply (generate). Exits 77 (skipped) when the
        SmolLM2 package is missing, after writing why into DIR/skipped.txt.

    check_chat.py check DIR -- COMMAND [ARG...]
        runs COMMAND --max-new-tokens N --prompt-ids DIR QUESTION and checks that it prints
        transformers' ids on its first line, then transformers' reply. Exits 77 when `prepare`
        skipped. Standard library only.

So the C, Go, Python and Rust examples each give transformers' ids for the same conversation (and
so the same ids as each other) and its reply, which must be EXPECTED (the issue's own words).
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

QUESTION = "What is the capital of France?"
EXPECTED = "The capital of France is Paris."
MAX_NEW_TOKENS = 24
# The decoder's room: SmolLM2's template with its default system turn and the question is 37
# tokens, then the reply; one cache slot (one conversation at a time).
MAX_SEQ_LEN = 96
SKIP = 77
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def reference(folder):
    """transformers' prompt ids and greedy reply to QUESTION, as the examples must give them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    reply = out[0, len(ids) :].tolist()
    return {"prompt_ids": ids, "reply_ids": reply, "reply": tokenizer.decode(reply, skip_special_tokens=True)}


def prepare(out):
    repo = Path(__file__).resolve().parents[1]
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("reference.json", "skipped.txt"):
        (out / stale).unlink(missing_ok=True)
    sys.path.insert(0, str(repo / "tests" / "models"))
    import smollm2

    try:
        source = smollm2.smollm2_folder()
    except smollm2.FixtureError as e:
        (out / "skipped.txt").write_text(f"no SmolLM2: {e}\n")
        print(f"check_chat: skipped: no SmolLM2: {e}")
        return SKIP
    for name in FILES:
        link = out / name
        link.unlink(missing_ok=True)
        if (source / name).exists():
            link.symlink_to(source / name)
    export = ["-m", "libpipe.export_llm", source, out / "decoder.pt", "--max-seq-len", MAX_SEQ_LEN, "--max-batch", 1]
    env = {**os.environ, "PYTHONPATH": str(repo / "bindings" / "python")}
    subprocess.run([sys.executable, *map(str, export)], check=True, env=env, stdout=subprocess.DEVNULL)

    want = reference(source)
    if want["reply"] != EXPECTED:
        sys.exit(f"check_chat: transformers answers {want['reply']!r} to {QUESTION!r}, not {EXPECTED!r}")
    (out / "reference.json").write_text(json.dumps({"question": QUESTION, **want}) + "\n")
    print(f"check_chat: {out}: decoder.pt and transformers' reply {want['reply']!r}")
    return 0


def check(folder, command):
    path = folder / "reference.json"
    if not path.is_file():
        why = (folder / "skipped.txt").read_text().strip() if (folder / "skipped.txt").is_file() else "not prepared"
        print(f"check_chat: skipped: {folder}: {why}")
        return SKIP
    want = json.loads(path.read_text())
    args = [*command, "--max-new-tokens", str(MAX_NEW_TOKENS), "--prompt-ids", str(folder), want["question"]]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        sys.exit(f"check_chat: {shlex.join(args)} failed with exit status {result.returncode}")
    first, _, reply = result.stdout.partition("\n")
    try:
        ids = [int(word) for word in first.split()]
    except ValueError:
        sys.exit(f"check_chat: the first line is not the prompt's ids: {first!r}")
    if ids != want["prompt_ids"]:
        sys.exit(f"check_chat: prompt ids\n{ids}\ndiffer from transformers' apply_chat_template\n{want['prompt_ids']}")
    if reply != want["reply"] + "\n":
        sys.exit(f"check_chat: the reply\n{reply!r}\ndiffers from transformers'\n{want['reply'] + chr(10)!r}")
    print(f"check_chat: {Path(command[-1]).name}: transformers' {len(ids)} prompt ids and its reply {reply.strip()!r}")
    return 0


def main():
    argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "prepare":
        return prepare(Path(argv[1]))
    if len(argv) >= 4 and argv[0] == "check" and argv[2] == "--":
        return check(Path(argv[1]), argv[3:])
    sys.exit(f"usage: {sys.argv[0]} prepare DIR | check DIR -- COMMAND [ARG...]")


if __name__ == "__main__":
    sys.exit(main())
