"""Where PyTorch's own pipeline splitter fails and libpipe does not: a tiny Hugging Face Llama
(random weights, returning its logits) cut before its second decoder layer.

torch.distributed.pipelining.pipeline() trips an assertion on it in torch 2.11 ("unexpected
placeholder node", pytorch/pytorch#184361: pipelining any HF model with rotary embeddings fails).
libpipe cuts the same model, exported once with libpipe.export_program (the `.pt2` fixture of
tests/models/exported_models.py), at the same module path, and runs it like eager PyTorch, with
uneven micro-batches too."""

import json
import os
import sys

import pytest
import torch
from conftest import MODELS
from conftest import run_pipe as pipe
from safetensors.torch import load_file

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "models"))
import exported_models  # noqa: E402  (the fixtures' own model builders)

SPLIT = ["--split-at", "model.layers.1:begin"]


def fixture(name):
    return os.path.join(MODELS, "exported", name)


def test_pytorch_pipelining_cannot_split_the_hf_llama():
    from torch.distributed.pipelining import SplitPoint, pipeline

    torch.manual_seed(0)
    model = exported_models.hf_llama().eval()
    input_ids = exported_models.tokens(exported_models.BATCH)["input_ids"]
    try:
        pipeline(model, mb_args=(input_ids,), split_spec={"model.layers.1": SplitPoint.BEGINNING})
    except AssertionError as e:
        assert "unexpected placeholder node" in str(e), f"pipeline() failed otherwise than pytorch#184361: {e!r}"
    else:
        pytest.skip(
            f"torch {torch.__version__}'s pipeline() splits the HF Llama: pytorch#184361 is fixed here, "
            "so this no longer shows PyTorch's splitter failing where libpipe succeeds"
        )


def test_libpipe_splits_the_same_model_at_the_same_place():
    result = pipe("split", fixture("hf_llama.pt2"), *SPLIT, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_stages"] == 2
    first, second = ([*s["parameters"], *s["buffers"]] for s in plan["stages"])
    assert any(p.startswith("model.layers.0.") for p in first), first
    assert not any(p.startswith("model.layers.1.") for p in first), first
    assert any(p.startswith("model.layers.1.") for p in second), second
    assert not any(p.startswith("model.layers.0.") for p in second), second
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in second
    with open(fixture("hf_llama.state_dict.txt")) as f:
        keys = {line.strip() for line in f if line.strip()}
    # Every weight is in some stage; stages may also hold non-persistent buffers (the rotary
    # inv_freq), which a state_dict does not list.
    assert keys <= set(first) | set(second)


# "": the fixture's batch of 4 (2 + 2 rows); ".b3": 3 rows, cut unevenly (2 + 1).
@pytest.mark.parametrize("inputs", ["", ".b3"])
def test_libpipe_runs_it_like_eager(tmp_path, inputs):
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        fixture("hf_llama.pt2"),
        *SPLIT,
        "--input",
        fixture(f"hf_llama{inputs}.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        2,
    )
    assert result.returncode == 0, result.stderr
    got = load_file(out)
    want = load_file(fixture(f"hf_llama{inputs}.expected.safetensors"))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4)
