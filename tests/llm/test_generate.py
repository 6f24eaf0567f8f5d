"""`pipe generate` on the exported random-weight models (conftest.py's `exported`), against
transformers' greedy `generate`, through libpipe's generation engine:

- greedy `--json` output equals transformers token for token over 1, 2 and 3 stages and over 2
  processes, with every prompt of llm_models.PROMPTS in one call: more prompts than the decoder's
  cache slots and of different lengths, so that sequences are batched together, wait for a slot,
  join while others decode and leave when done, and the longest is prefilled in chunks;
- seeded sampling is reproducible (prompt i samples with seed S + i, so a prompt gets the same
  tokens wherever its seed is the same, and different ones with another seed);
- --stop-ids ends a sequence with that id (finish reason "stop");
- a token id outside the vocabulary and a prompt that leaves no room in the cache fail with one
  line on stderr naming the prompt;
- the same decoders exported as torch.export programs (`export_llm OUT.pt2`, run by nativert) give
  the same tokens over 2 stages and 2 processes.
"""

import json
import os
import subprocess

import pytest

from llm_models import CHUNK, MAX_LEN, NEW_TOKENS, PROMPTS, SLOTS, VOCAB, export, split_points

PIPE = os.environ["PIPE_CLI"]  # run-tests.sh: the pipe installed with the libpipe under test


# How the model is cut and hosted: pipe arguments for a config.json.
def cuts(config, stages):
    return [a for p in split_points(config, stages) for a in ("--split-at", p)]


MODES = {
    "1-stage": lambda config: [],
    "2-stages": lambda config: cuts(config, 2),
    "3-stages": lambda config: cuts(config, 3),
    "2-processes": lambda config: cuts(config, 2) + ["--processes", "2"],
}


def pipe_generate(exported, prompts, *args, timeout=300, skeleton=None):
    command = [PIPE, "generate", skeleton or exported.skeleton, "--weights", exported.weights]
    for p in prompts:
        command += ["--prompt-ids", ",".join(map(str, p))]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def generated(result):
    """The --json output, checked for its form."""
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {
        "outputs",
        "tokens_per_s",
        "time_to_first_token_ms",
        "finish_reasons",
        "steps_in_flight",
        "peak_rss_mib",
    }, out
    assert len(out["finish_reasons"]) == len(out["outputs"])
    assert out["tokens_per_s"] > 0 and out["time_to_first_token_ms"] > 0, out
    assert out["steps_in_flight"]["now"] >= 1, out
    assert out["steps_in_flight"]["one_at_a_time"] + out["steps_in_flight"]["pipelined"] > 0, out
    assert out["peak_rss_mib"]["driver"] > 0, out
    return out


def test_more_prompts_than_slots():
    # What makes sequences wait for a slot and join mid-flight below.
    assert len(PROMPTS) > SLOTS and len({len(p) for p in PROMPTS}) == len(PROMPTS)
    assert max(len(p) for p in PROMPTS) > 2 * CHUNK


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_transformers(exported, mode):
    args = MODES[mode](exported.config)
    result = pipe_generate(exported, PROMPTS, *args, "--max-new-tokens", NEW_TOKENS, "--prefill-chunk", CHUNK, "--json")
    out = generated(result)
    assert out["outputs"] == exported.reference
    assert out["finish_reasons"] == ["length"] * len(PROMPTS)
    # A worker's peak memory is known once it exited (getrusage of the waited-for children).
    assert (out["peak_rss_mib"]["largest_worker"] > 0) == ("--processes" in args), out


# The tests below are about the command, not the architecture: the Llama model is enough.
llama_only = pytest.mark.parametrize("exported", ["llama"], indirect=True)

SAMPLING = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--max-new-tokens", NEW_TOKENS]


@llama_only
def test_seeded_sampling_is_reproducible(exported):
    first, second = PROMPTS[0], PROMPTS[2]
    # Seeds 7, 8, 9 for the three prompts.
    one = generated(pipe_generate(exported, [first, first, second], *SAMPLING, "--seed", 7, "--json"))["outputs"]
    # Sampled, not greedy; another seed, other tokens (the same prompt with seeds 7 and 8).
    assert one[0] != exported.reference[0]
    assert one[0] != one[1]
    # The same seeds again give the same tokens, printed one line per prompt without --json.
    again = pipe_generate(exported, [first, first, second], *SAMPLING, "--seed", 7)
    assert again.returncode == 0, again.stderr
    assert [[int(x) for x in line.split()] for line in again.stdout.splitlines()] == one
    # Seeds 8 and 9 for the same prompts, now at index 0 and 1 of another call: the same tokens.
    shifted = generated(pipe_generate(exported, [first, second], *SAMPLING, "--seed", 8, "--json"))["outputs"]
    assert shifted == one[1:]


@llama_only
def test_stop_ids_end_a_sequence(exported):
    ref = exported.reference[0]
    # A token the first prompt generates after others, and an id none generates.
    k = next(k for k in range(2, NEW_TOKENS) if ref[k] not in ref[:k])
    stop, never = ref[k], next(i for i in range(VOCAB) if all(i not in r for r in exported.reference))
    out = generated(
        pipe_generate(exported, PROMPTS, "--max-new-tokens", NEW_TOKENS, "--stop-ids", f"{never},{stop}", "--json")
    )
    want, reasons = [], []
    for r in exported.reference:
        end = r.index(stop) + 1 if stop in r else len(r)
        want.append(r[:end])
        reasons.append("stop" if stop in r else "length")
    assert out["outputs"] == want
    assert out["finish_reasons"] == reasons
    assert out["outputs"][0] == ref[: k + 1] and reasons[0] == "stop"


def one_error_line(result, *needles):
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipe: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


@llama_only
def test_bad_prompts_are_refused_naming_them(exported):
    one_error_line(
        pipe_generate(exported, [PROMPTS[0], [5, VOCAB, 7]], "--max-new-tokens", 4),
        "prompt 2 of 2",
        str(VOCAB),
        "INVALID_ARGUMENT",
    )
    one_error_line(
        pipe_generate(exported, [list(range(MAX_LEN))], "--max-new-tokens", 4), "prompt 1 of 1", "INVALID_ARGUMENT"
    )


# The decoder as a torch.export program: export_llm writes a .pt2 skeleton (empty weight and cache
# records), libpipe fills it from the same checkpoint and runs its stages with nativert.
@pytest.mark.parametrize("exported", ["llama", "qwen2", "gpt2"], indirect=True)
@pytest.mark.parametrize("mode", ["2-stages", "2-processes"])
def test_exported_program_decoder_equals_transformers(exported, mode):
    program = os.path.join(exported.folder, "decoder.pt2")
    if not os.path.exists(program):  # once per model: the modes share it
        made = export(exported.folder, program, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS, "--dtype", "fp32")
        assert made.returncode == 0, made.stderr
    args = MODES[mode](exported.config)
    result = pipe_generate(
        exported,
        PROMPTS,
        *args,
        "--max-new-tokens",
        NEW_TOKENS,
        "--prefill-chunk",
        CHUNK,
        "--json",
        skeleton=program,
    )
    out = generated(result)
    assert out["outputs"] == exported.reference
    assert out["finish_reasons"] == ["length"] * len(PROMPTS)
