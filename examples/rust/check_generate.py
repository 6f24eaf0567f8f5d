"""Runs the Rust generation example (src/bin/generate.rs) and checks its text against references made
without it:

1. the tiny decoder fixture (FIXTURES/tiny_decoder.pt, 2 layers, vocab 128) with a word-level
   tokenizer.json written here (token i is the word "t<i>"): every prompt of
   tiny_decoder.expected.json at once (more than the decoder's slots), each answer must be the
   words of transformers' greedy tokens for it;
2. SmolLM2-135M-Instruct when its converted folder can be had (tests/models/smollm2.py: cached
   per machine, made by scripts/install-deps.sh), exported here with libpipe.export_llm: a chat
   prompt whose answer must equal transformers' greedy answer, decoded. Skipped, saying why,
   when the model's package or transformers is missing.

    check_generate.py GENERATE_BINARY FIXTURES WORKDIR REPO

The binary must find libpipe (the caller sets LD_LIBRARY_PATH). Standard library only, except
part 2 (torch, transformers, as tests/llm needs them).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

SMOLLM2_PROMPT = "What is the capital of France?"
# SmolLM2's chat template adds this system turn when a conversation has none.
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM2_NEW_TOKENS = 24


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

    prompts = [words(p) for p in expected["prompts"]]
    out = run_example(binary, [folder, "--max-new-tokens", expected["max_new_tokens"], *prompts])
    want = [words(g) for g in expected["greedy"]]
    got = out.splitlines()
    if got != want:
        sys.exit(
            f"check_generate: tiny decoder: the example printed\n{out}\ntransformers' greedy tokens are\n"
            + "\n".join(want)
        )
    print(f"check_generate: tiny decoder: {len(want)} answers equal transformers' greedy tokens")


def smollm2_folder(repo):
    """The converted SmolLM2 folder, or None with the reason printed."""
    sys.path.insert(0, str(repo / "tests" / "models"))
    try:
        import smollm2

        return smollm2.smollm2_folder()
    except Exception as e:  # a missing package, or a conversion that cannot run here
        print(f"check_generate: SmolLM2 skipped: {e}")
        return None


def transformers_answer(folder):
    """transformers' greedy answer to SMOLLM2_PROMPT through SmolLM2's own chat template, decoded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SMOLLM2_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def check_smollm2(binary, workdir, repo):
    source = smollm2_folder(repo)
    if source is None:
        return
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"check_generate: SmolLM2 skipped: {e}")
        return
    folder = workdir / "smollm2"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        link = folder / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path(source) / name)
    env = {**os.environ, "PYTHONPATH": str(repo / "bindings" / "python")}
    # A skeleton with room for this prompt and answer: 256 tokens, 2 slots.
    export = ["-m", "libpipe.export_llm", source, folder / "decoder.pt", "--max-seq-len", 256, "--max-batch", 2]
    subprocess.run([sys.executable, *map(str, export)], check=True, env=env, stdout=subprocess.DEVNULL)

    want = transformers_answer(source)
    args = ["--chat", "--system", SMOLLM2_SYSTEM, "--max-new-tokens", SMOLLM2_NEW_TOKENS, SMOLLM2_PROMPT]
    got = run_example(binary, [folder, *args])
    if got != want + "\n" or "Paris" not in got:
        sys.exit(f"check_generate: SmolLM2 answered\n{got!r}\ntransformers answers\n{want!r}")
    print(f"check_generate: SmolLM2 answers {SMOLLM2_PROMPT!r} as transformers does: {got.strip()!r}")


def main():
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.argv[0]} GENERATE_BINARY FIXTURES WORKDIR REPO")
    binary, fixtures, workdir, repo = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    for name in ("tiny_decoder.pt", "tiny_decoder.expected.json"):
        if not (fixtures / name).is_file():
            sys.exit(f"check_generate: {fixtures / name} is missing (tests/bindings/stage.cmake copies it there)")
    check_tiny(binary, fixtures, workdir)
    check_smollm2(binary, workdir, repo)


if __name__ == "__main__":
    main()
