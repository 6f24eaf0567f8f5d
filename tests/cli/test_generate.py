"""`pipe generate`'s command-line contract, on the generation engine's decoder fixtures
(tests/models/decoder_models.py: a tiny Llama-architecture decoder with its weights inside, and
transformers' greedy tokens for its prompts in tiny_decoder.expected.json):

- the output is one line of generated ids per prompt, in prompt order, equal to transformers';
- more prompts than the generator holds (the 1-slot decoder queues 4 at most, so submitting is
  refused as busy until a sequence finishes): every prompt still comes out right;
- a sequence whose step fails: exit 1, one line naming the prompt and the model's error;
- a model that is not a decoder, a stop id outside the vocabulary: exit 1, one line;
- text prompts without a tokenizer: exit 1 (a folder without tokenizer.json) or 2 (none given);
- usage errors (missing or malformed flags, values out of range, flags that do not apply):
  exit 2, one line naming the flag, before any model is loaded.
(Generation against transformers for real architectures, over stages and processes: tests/llm.)
"""

import json
import os
import subprocess

import pytest
from conftest import MODELS, PIPE, assert_one_line_error
from conftest import run_pipe as pipe

TINY = os.path.join(MODELS, "tiny_decoder.pt")
CUT = ["--split-at", "model.layers.1:begin"]


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(MODELS, "tiny_decoder.expected.json")) as f:
        return json.load(f)


def prompt_args(prompts):
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


def gated_pipe(*args):
    """pipe with the test gate's operator loaded, which the gated decoders call (no gate is held
    here: their prompts never start with a gate key). As tests/gate/gate.py's child_env does:
    in sanitizer builds the preloaded library comes before the sanitizer's runtime."""
    asan = ":".join(p for p in (os.environ.get("ASAN_OPTIONS", ""), "verify_asan_link_order=0") if p)
    env = {**os.environ, "LD_PRELOAD": os.environ["LIBPIPE_TEST_GATE_LIB"], "ASAN_OPTIONS": asan}
    return subprocess.run([PIPE, *map(str, args)], capture_output=True, text=True, timeout=300, env=env)


def test_prints_one_line_of_ids_per_prompt(expected):
    result = pipe(
        "generate", TINY, *CUT, *prompt_args(expected["prompts"]), "--max-new-tokens", expected["max_new_tokens"]
    )
    assert result.returncode == 0, result.stderr
    assert [[int(x) for x in line.split()] for line in result.stdout.splitlines()] == expected["greedy"]


def test_trace_holds_every_step_with_its_stages_and_operators(expected, tmp_path):
    """--trace --trace-operators: one engine "launch" slice per step, whose tokens are what the
    sequences fed in (each prompt, then each generated token but the last), and one slice per step
    on each stage, holding the time of the stage's linear layers under their weights' shapes."""
    trace_path = tmp_path / "trace.json"
    result = pipe(
        "generate", TINY, *CUT, *prompt_args(expected["prompts"]), "--max-new-tokens", expected["max_new_tokens"],
        "--json", "--trace", trace_path, "--trace-operators",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outputs = json.loads(result.stdout)["outputs"]
    assert outputs == expected["greedy"]
    events = json.loads(trace_path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    launches = [e for e in slices if tracks[e["tid"]] == "engine" and e["name"].startswith("launch step")]
    fed = sum(len(p) for p in expected["prompts"]) + sum(len(o) - 1 for o in outputs)
    assert sum(e["args"]["tokens"] for e in launches) == fed
    # tiny_decoder: hidden 64, 4 heads and 2 key-value heads of 16, MLP 128, vocabulary 128.
    layer = {"64x64", "32x64", "128x64", "64x128"}
    for stage in (0, 1):
        mine = [e for e in slices if tracks[e["tid"]] == f"stage {stage}"]
        assert sorted(e["args"]["request"] for e in mine) == sorted(e["args"]["request"] for e in launches)
        shapes = set()
        for e in mine:
            ops = e["args"]["operators_us"]
            assert sum(ops.values()) <= e["dur"] + 1
            # A group of products of one input (q, k, v; gate, up) is one key: "[64x64+32x64+32x64]".
            for k in ops:
                if k.split(" [")[0].endswith(("linear", "linear_group")):
                    shapes |= set(k.split(" [")[1].rstrip("]").split("+"))
        assert shapes == layer  # the head (128x64, stage 1) has the shape of gate and up


def test_more_prompts_than_the_generator_holds(expected):
    prompts, greedy = expected["prompts"] * 3, expected["greedy"] * 3
    model = os.path.join(MODELS, "gated_decoder_1slot.pt")
    result = gated_pipe(
        "generate", model, *CUT, *prompt_args(prompts), "--max-new-tokens", expected["max_new_tokens"], "--json"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["outputs"] == greedy
    assert out["finish_reasons"] == ["length"] * len(prompts)


def test_a_failed_sequence_names_its_prompt(expected):
    # A prompt starting with id 119 makes the gated decoder's step raise. It is the first prompt,
    # so that it is the first failure reported whichever rows shared its step.
    prompts = [[119, 5, 6], expected["prompts"][0]]
    result = gated_pipe(
        "generate", os.path.join(MODELS, "gated_decoder.pt"), *CUT, *prompt_args(prompts), "--max-new-tokens", 3
    )
    assert result.returncode == 1
    assert_one_line_error(result, "prompt 1 of 2", "starting with token 119", "EXECUTION")
    assert result.stdout == ""


def test_stop_ids_outside_the_vocabulary_are_refused(expected):
    # They would never match: a typo that silently generates to the limit.
    result = pipe(
        "generate", TINY, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--stop-ids", f"3,{expected['vocab']}"
    )
    assert result.returncode == 1
    assert_one_line_error(result, "--stop-ids", str(expected["vocab"]), f"0..{expected['vocab'] - 1}")


def test_a_model_that_is_not_a_decoder_is_refused():
    result = pipe(
        "generate", os.path.join(MODELS, "example_code.scripted.pt"), "--prompt-ids", "1,2", "--max-new-tokens", 2
    )
    assert result.returncode == 1
    assert_one_line_error(result, "cannot create the generator", "decoder", "INVALID_ARGUMENT")


USAGE_ERRORS = [
    (["--max-new-tokens", "2"], ["--prompt-ids"]),
    (["--prompt-ids", "1,2"], ["--max-new-tokens"]),
    (["--prompt-ids", "1,x,3", "--max-new-tokens", "2"], ["--prompt-ids", "'x'"]),
    (["--prompt-ids", "", "--max-new-tokens", "2"], ["--prompt-ids"]),
    (["--prompt-ids", "1,,2", "--max-new-tokens", "2"], ["--prompt-ids", "id 2"]),
    (["--prompt-ids", "1", "--stop-ids", "2;3", "--max-new-tokens", "2"], ["--stop-ids", "'2;3'"]),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
    (["--prompt-ids", "1", "--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "-1"], ["--temperature"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "nan"], ["--temperature", "'nan'"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--top-p", "1.5"], ["--top-p"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--temperature", "1", "--top-k", "-1"], ["--top-k", "at least 0"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--top-k", "5"], ["--top-k", "--temperature"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--seed", "-3"], ["--seed", "'-3'"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--prefill-chunk", "0"], ["--prefill-chunk", "at least 1"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--microbatches", "2"], ["--microbatches", "does not apply"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--stages", "2", "--policy", "time"], ["--policy time"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--input", "in.safetensors"], ["unknown option '--input'"]),
    (["--prompt-ids"], ["--prompt-ids needs a value"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--trace-operators"], ["--trace-operators", "--trace"]),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--trace"], ["--trace needs a value"]),
    (["--prompt", "hi", "--max-new-tokens", "2"], ["--prompt TEXT", "--tokenizer DIR"]),
    (["--prompt"], ["--prompt needs a value"]),
]


@pytest.mark.parametrize("args,needles", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_are_one_line(args, needles):
    result = pipe("generate", TINY, *args)
    assert result.returncode == 2
    assert_one_line_error(result, "generate", *needles)


def test_a_folder_without_a_tokenizer_is_refused(tmp_path):
    # Text prompts (--prompt) need the model folder's tokenizer.json; SmolLM2's replies as text against
    # transformers': tests/llm/test_smollm2.py.
    result = pipe("generate", TINY, "--prompt", "hi", "--max-new-tokens", 2, "--tokenizer", tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, "cannot load the tokenizer", "tokenizer.json", "NOT_FOUND")


def test_model_is_required():
    result = pipe("generate", "--prompt-ids", "1", "--max-new-tokens", "2")
    assert result.returncode == 2
    assert_one_line_error(result, "MODEL is required")
