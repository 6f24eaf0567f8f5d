"""What 8- and 4-bit weights change in SmolLM2-135M-Instruct's greedy chat answers, against libpipe's own float32:
QUESTIONS, each one user turn through the folder's chat template (libpipe's tokenizer), answered greedily by libpipe
over 2 stages, at most NEW_TOKENS tokens ending at <|im_end|>, all the questions submitted at once to one Generator
per precision, in this process (the same batch, threads and cut for every precision).

Per precision, the mean over questions of the share of float32's answer matched before the first difference (the
first index where the two differ, or where the shorter ends, over float32's answer's length; 1.0 if equal) must
reach its bound. float32's answers themselves equal transformers' greedy `generate` token for token
(test_smollm2.py, through `pipe generate`); they are not compared with transformers again here.
bench/greedy_agreement.py measures the same on 32 questions of 64 tokens, beside llama.cpp's Q8_0 and Q4_0 against
its F32 (bench/RESULTS.md).
"""

import os
import statistics
import sys

import pytest

import libpipe
from llm_models import export

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import smollm2  # noqa: E402  (tests/models)

QUESTIONS = [
    "What is the tallest mountain in the world?",
    "How do airplanes fly?",
    "Write a Python function that adds two numbers.",
    "What are three good habits for a healthy life?",
    "Why is the ocean salty?",
    "Who painted the Mona Lisa?",
    "Explain what a computer virus is.",
    "What is the difference between weather and climate?",
    "How many continents are there?",
    "Give me a recipe for a simple salad.",
    "What is the meaning of the word 'ephemeral'?",
    "How does the moon affect the tides?",
    "Write a haiku about winter.",
    "What is 12 plus 30?",
    "Why should I back up my files?",
    "Name a famous composer and one of his works.",
]
NEW_TOKENS = 32
IM_END = 2
MAX_LEN = 96  # the chat template's system prompt (~30 tokens) + a question + the answer
# The bounds, from the answers measured on the AMD EPYC of bench/RESULTS.md (avx512_vnni; at 1c4029c): int8 0.46 (1 of
# 16 answers equal), int4 0.18 (none). Each question's share lies anywhere in 0-1 (standard deviation 0.28 and 0.22),
# so the mean of 16 moves by about 0.07 and 0.06 where another CPU's float32 rounds the reference differently and a
# near tie flips. This model's greedy answers are fragile: bf16 shares 0.66, llama.cpp's own Q8_0 0.44 and Q4_0 0.11
# of its F32's (bench/greedy_agreement.py, 32 questions of 64 tokens). What a broken quantizer gives here, measured
# by scaling the checkpoint's q/k/v/o/gate/up/down weights (as scales off by that factor would: the codes stay the
# same; the tied embedding and head left as they are):
# - int8 with its scales 5% off: 0.24, 10% off: 0.18, 2% off: 0.34; int4's weights instead of int8's: 0.18.
#   INT8_BOUND fails all of them but 2% off, and lies 2.3 standard deviations of the mean below int8's.
# - int4 with its scales off by 2x, 0.5x or the sign: 0.00 (every first token differs). INT4_BOUND fails those and
#   lies 2.1 standard deviations below int4's. The head in 4 bits too (quantize_head="int4") gives 0.11 here,
#   but only because of one short answer, and 0.113 against int4's 0.114 on the benchmark's 32 questions: greedy
#   agreement does not tell it from int4's own rounding; test_quantized_quality.py's perplexity bound does.
INT8_BOUND = 0.30
INT4_BOUND = 0.06


@pytest.fixture(scope="module")
def folder():
    return smollm2.smollm2_folder()


@pytest.fixture(scope="module")
def prompts(folder):
    with libpipe.Tokenizer.load(folder) as tokenizer:
        out = [
            list(tokenizer.apply_chat_template([("user", q)], add_generation_prompt=True, tokenize=True))
            for q in QUESTIONS
        ]
    assert max(map(len, out)) + NEW_TOKENS <= MAX_LEN
    return out


@pytest.fixture(scope="module")
def skeleton(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement") / "smollm2.pt"
    result = export(folder, out, "--max-seq-len", MAX_LEN, "--max-batch", len(QUESTIONS))
    assert result.returncode == 0, result.stderr
    return out


def answers(folder, skeleton, prompts, quantize):
    """Every question's greedy answer, all submitted at once to one Generator."""
    weights = os.path.join(folder, "model.safetensors")
    with libpipe.Generator(skeleton, stages=2, weights=weights, quantize=quantize) as generator:
        generations = [generator.generate(p, max_new_tokens=NEW_TOKENS, stop_ids=[IM_END]) for p in prompts]
        return [list(g.wait()) for g in generations]


def share_before_first_difference(output, reference):
    if output == reference:
        return 1.0
    first = next((k for k, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))
    return first / len(reference)


@pytest.fixture(scope="module")
def float32(folder, skeleton, prompts):
    return answers(folder, skeleton, prompts, None)


@pytest.mark.parametrize("quantize, bound", [("int8", INT8_BOUND), ("int4", INT4_BOUND)])
def test_quantized_greedy_answers_agree_with_float32(folder, skeleton, prompts, float32, quantize, bound):
    got = answers(folder, skeleton, prompts, quantize)
    shares = [share_before_first_difference(o, r) for o, r in zip(got, float32)]
    share = statistics.mean(shares)
    print(
        f"{quantize}: {sum(s == 1.0 for s in shares)} of {len(shares)} answers equal float32's, mean share {share:.3f}"
    )
    assert share >= bound, f"{quantize}: shares before the first difference {shares}"
