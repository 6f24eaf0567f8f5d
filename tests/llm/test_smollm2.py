"""SmolLM2-135M-Instruct, a real trained chat model (tests/models/smollm2.py: the folder a Hugging
Face checkpoint would be), end to end as the README shows it: its skeleton exported by export_llm
from the folder's config.json, its weights the folder's model.safetensors unchanged, and
`pipe generate` answering chat prompts (the tokenizer's chat template applied) greedily over 2
stages and over 2 processes, token for token as transformers' greedy `generate`, each answer
ending at <|im_end|> (id 2, given as --stop-ids) or after the token limit.

`pipe generate --prompt TEXT` gives the same answers, with libpipe's own tokenizer and chat template,
as text equal to transformers' decode.

The reference runs in a child process where `import gguf` fails, so the folder must stand on its
own as a Hugging Face checkpoint; the trained model must answer the first question right (Paris).
"""

import json
import os
import subprocess
import sys

import pytest

from llm_models import export

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import smollm2  # noqa: E402  (tests/models)

PIPE = os.environ["PIPE_CLI"]
# Two prompts of different lengths: one answer ends at <|im_end|>, the other runs to NEW_TOKENS.
QUESTIONS = ["What is the capital of France?", "Name the three primary colors, please."]
NEW_TOKENS = 20
IM_END = 2
MAX_LEN = 160  # the chat template's system prompt (~30 tokens) + a question + the answer
SLOTS = 4

# transformers' answers, in a child process without gguf.
REFERENCE = r"""
import json, sys
sys.modules["gguf"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, questions, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
prompts, answers, texts = [], [], []
for q in questions:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    prompts.append(ids)
    answers.append(new)
    texts.append(tokenizer.decode(new, skip_special_tokens=True))
print(json.dumps({
    "prompts": prompts, "answers": answers, "texts": texts,
    "eos": model.generation_config.eos_token_id, "dtype": str(model.dtype),
    "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = smollm2.smollm2_folder()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(folder), json.dumps(QUESTIONS), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    reference = json.loads(result.stdout.strip().splitlines()[-1])
    assert reference["eos"] == IM_END and reference["tied"] and reference["dtype"] == "torch.float32", reference
    assert "Paris" in reference["texts"][0], reference["texts"]
    assert len({len(p) for p in reference["prompts"]}) == len(QUESTIONS)
    first, second = reference["answers"]
    assert first[-1] == IM_END and len(second) == NEW_TOKENS and IM_END not in second, reference["texts"]
    skeleton = tmp_path_factory.mktemp("smollm2") / "smollm2.pt"
    exported = export(folder, skeleton, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS)
    assert exported.returncode == 0, exported.stderr
    return folder, skeleton, reference


@pytest.mark.parametrize("hosting", [[], ["--processes", "2"]], ids=["2-stages", "2-processes"])
def test_chat_answers_equal_transformers(model, hosting):
    folder, skeleton, reference = model
    command = [PIPE, "generate", str(skeleton), "--weights", str(folder / "model.safetensors")]
    command += ["--split-at", "model.layers.15:begin", *hosting]
    for p in reference["prompts"]:
        command += ["--prompt-ids", ",".join(map(str, p))]
    command += ["--max-new-tokens", str(NEW_TOKENS), "--stop-ids", str(IM_END), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["outputs"] == reference["answers"]
    assert out["finish_reasons"] == ["stop", "length"]


def test_text_prompts_equal_transformers(model):
    """--prompt TEXT: libpipe's tokenizer applies the folder's chat template and encodes the question,
    the folder's stop ids (generation_config.json) end the first answer, and the replies come back as
    transformers decodes them (special tokens left out)."""
    folder, skeleton, reference = model
    command = [PIPE, "generate", str(skeleton), "--weights", str(folder / "model.safetensors")]
    command += ["--split-at", "model.layers.15:begin"]
    for q in QUESTIONS:
        command += ["--prompt", q]
    result = subprocess.run(
        command + ["--max-new-tokens", str(NEW_TOKENS), "--json"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["outputs"] == reference["answers"]
    assert out["texts"] == reference["texts"]
    assert out["finish_reasons"] == ["stop", "length"]
    # Without --json: the replies as text, one after the other.
    plain = subprocess.run(command + ["--max-new-tokens", str(NEW_TOKENS)], capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "".join(text + "\n" for text in reference["texts"])
