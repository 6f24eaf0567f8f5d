"""transformers' greedy replies to a conversation, turn by turn, as `pipe chat` holds it: each question
is appended to the conversation as a user message, the whole conversation goes through the
tokenizer's chat template (apply_chat_template, add_generation_prompt), `generate` answers it
greedily with at most N new tokens, and the reply (decoded without special tokens) joins the
conversation as the assistant's message before the next question.

    python chat_reference.py MODEL_DIR --max-new-tokens N [--system TEXT] QUESTION... [--check FILE]

prints {"replies": [{"text": ..., "tokens": [...], "stopped": true|false}, ...]} (stopped: the reply
ended at a stop id, not at the limit), or with --check FILE (what `pipe chat` printed: each reply
followed by a line break) says reply by reply whether FILE holds the same and exits 1 if not.
Used by tests/llm/test_chat.py and scripts/demo.sh. The model is read as a Hugging Face folder that
stands on its own (`import gguf` fails here, so nothing is taken from the GGUF it was converted from).
"""

import argparse
import json
import sys


def replies(folder, questions, new_tokens, system=None):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            x = torch.tensor([ids])
            generated = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        tokens = generated[0, len(ids) :].tolist()
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append({"text": text, "tokens": tokens, "stopped": bool(tokens) and tokens[-1] in eos})
        messages.append({"role": "assistant", "content": text})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("questions", nargs="+")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--system")
    parser.add_argument("--check", metavar="FILE", help="pipe chat's output to compare with the replies")
    args = parser.parse_args()
    sys.modules["gguf"] = None  # the folder must stand on its own
    result = replies(args.model_dir, args.questions, args.max_new_tokens, args.system)
    if not args.check:
        print(json.dumps({"replies": result}))
        return 0
    with open(args.check, encoding="utf-8") as f:
        printed = f.read()
    expected = "".join(r["text"] + "\n" for r in result)
    at, same = 0, True
    for i, r in enumerate(result):
        ok = printed.startswith(r["text"] + "\n", at)
        same &= ok
        print(f"reply {i + 1}: {'the same as' if ok else 'DIFFERENT from'} transformers' greedy reply")
        if not ok:
            print(f"  transformers: {r['text']!r}")
        at += len(r["text"]) + 1
    if same and printed != expected:
        same = False
        print(f"more printed than replies: {printed[len(expected) :]!r}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
