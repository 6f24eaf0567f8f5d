"""Hugging Face checkpoints through `pipe run --weights`. Hugging Face never stores non-persistent
buffers (Llama's rotary `inv_freq`, BERT's `position_ids` and `token_type_ids`); a skeleton saved
with `libpipe.save_skeleton(traced, path, module=model)` keeps exactly those with their data, the
stages take every other tensor (a tied head included) from the model's own `model.safetensors`,
and the output equals eager PyTorch, in one process and over two. A skeleton without them is
refused with one line naming the buffer and the fix."""

import json
import os
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_one_line_error
from conftest import run_pipe as pipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import libpipe

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "distributed"), os.path.join(TESTS, "gate")]
import disthelp  # noqa: E402  (drivers that report their store, process trees that never outlive a test)

MICROBATCHES = 2
# The pipeline runs the same float32 TorchScript kernels on the same micro-batch shapes as the
# eager reference below; only the BLAS thread count may differ, which moves results by a few ulps
# at most (they are bitwise equal on the machines this was written on). A lost or wrong buffer
# moves them by far more (checked when the models are built).
RTOL, ATOL = 1e-5, 1e-6


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaLogits(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    # A tied head, so the checkpoint stores it once, as model.embed_tokens.weight.
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaLogits(cfg)


def hf_bert():
    from transformers import BertConfig, BertModel

    class BertOutputs(BertModel):
        def forward(self, input_ids):
            out = super().forward(input_ids=input_ids)
            return out.last_hidden_state, out.pooler_output

    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    return BertOutputs(cfg)


@dataclass
class Case:
    build: object
    split: list
    buffers: list  # the non-persistent buffers, which the checkpoint lacks
    buffer_stage: int  # the stage that holds buffers[0]


# Llama is cut after its embedding so that stage 1, which holds the rotary buffer and the tied head,
# is the one a worker process serves; BERT reads its buffers in stage 0, the driver's.
CASES = {
    "llama": Case(
        hf_llama,
        ["--split-at", "model.embed_tokens:end"],
        ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"],
        1,
    ),
    "bert": Case(
        hf_bert, ["--split-at", "encoder.layer.0:end"], ["embeddings.position_ids", "embeddings.token_type_ids"], 0
    ),
}


def flatten(out):
    if isinstance(out, torch.Tensor):
        return {"output": out.contiguous()}
    return {f"output.{i}": o.contiguous() for i, o in enumerate(out)}


@dataclass
class Built:
    model: torch.nn.Module
    traced: torch.jit.ScriptModule
    checkpoint: str  # the model.safetensors save_pretrained wrote
    skeleton: str  # saved with the module: its non-persistent buffers keep their data
    inputs: str
    expected: dict


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made = {}
    for name, case in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = case.build().eval()
        model.save_pretrained(folder / "hf")  # safetensors, as Hugging Face publishes models
        ids = torch.randint(0, 256, (4, 12))
        traced = torch.jit.trace(model, (ids,))
        skeleton = str(folder / "skeleton.pt")
        libpipe.save_skeleton(traced, skeleton, module=model)
        save_file({"input_ids": ids}, folder / "inputs.safetensors")
        # Eager PyTorch on the micro-batches the pipeline runs.
        with torch.no_grad():
            parts = [flatten(model(part)) for part in ids.tensor_split(MICROBATCHES)]
            expected = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            # The comparisons can tell a lost buffer: zeroed, the outputs move a hundred times past
            # the tolerance (random weights this small make the rotary embedding's effect small).
            saved = {b: model.get_buffer(b).clone() for b in case.buffers}
            for b in case.buffers:
                model.get_buffer(b).zero_()
            zeroed = flatten(model(ids.tensor_split(MICROBATCHES)[0]))
            for b, t in saved.items():
                model.get_buffer(b).copy_(t)
        first = parts[0]["output" if "output" in parts[0] else "output.0"]
        second = zeroed["output" if "output" in zeroed else "output.0"]
        assert (first - second).abs().max() > 100 * (ATOL + RTOL * first.abs().max())
        made[name] = Built(
            model,
            traced,
            str(folder / "hf" / "model.safetensors"),
            skeleton,
            str(folder / "inputs.safetensors"),
            expected,
        )
    return made


def assert_equals_eager(out, expected):
    got = load_file(out)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    disthelp.kill_all_trees()


@pytest.mark.parametrize("name", CASES)
def test_skeleton_keeps_exactly_what_the_checkpoint_lacks(built, name):
    b, case = built[name], CASES[name]
    with safe_open(b.checkpoint, "pt") as f:
        stored = set(f.keys())
    skeleton = torch.jit.load(b.skeleton)
    tensors = dict(skeleton.named_parameters())
    tensors.update(dict(skeleton.named_buffers()))
    kept = {n for n, t in tensors.items() if not t.is_meta}
    assert kept == set(case.buffers)
    # Every other tensor of the traced model (the tied head under its first name) is in the checkpoint.
    assert set(tensors) - kept == stored
    for n in case.buffers:
        torch.testing.assert_close(tensors[n], b.model.get_buffer(n), rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
def test_hf_checkpoint_in_one_process_equals_eager(built, tmp_path, name):
    b, case = built[name], CASES[name]
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        b.skeleton,
        *case.split,
        "--weights",
        b.checkpoint,
        "--input",
        b.inputs,
        "--output",
        out,
        "--microbatches",
        MICROBATCHES,
    )
    assert result.returncode == 0, result.stderr
    assert_equals_eager(out, b.expected)


@pytest.mark.parametrize("name", CASES)
def test_hf_checkpoint_over_two_processes_equals_eager(built, tmp_path, name):
    b, case = built[name], CASES[name]
    plan = pipe("split", b.skeleton, *case.split, "--json")
    assert plan.returncode == 0, plan.stderr
    stages = json.loads(plan.stdout)["stages"]
    assert len(stages) == 2 and case.buffers[0] in stages[case.buffer_stage]["buffers"]
    out = tmp_path / "out.safetensors"
    # The driver's store takes a free port and reports it; the worker joins there.
    driver, store = disthelp.start_driver(
        "run",
        b.skeleton,
        *case.split,
        "--weights",
        b.checkpoint,
        "--input",
        b.inputs,
        "--output",
        out,
        "--microbatches",
        MICROBATCHES,
        "--world-size",
        2,
        "--comm-timeout-ms",
        disthelp.JOIN_MS,
        name="pipe run",
    )
    worker = disthelp.start_worker(1, 2, store, comm_ms=disthelp.JOIN_MS)
    driver.wait(disthelp.RUN_TIMEOUT_S)
    assert driver.returncode == 0, driver.stderr
    worker.wait(disthelp.FAIL_WITHIN_S)  # the session is over: the worker exits 0
    assert worker.returncode == 0, worker.stderr
    assert_equals_eager(out, b.expected)


@pytest.mark.parametrize("name", CASES)
def test_buffers_named_with_keep_also_run(built, tmp_path, name):
    b, case = built[name], CASES[name]
    skeleton = tmp_path / "kept.pt"
    libpipe.save_skeleton(b.traced, str(skeleton), keep=case.buffers)
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        skeleton,
        *case.split,
        "--weights",
        b.checkpoint,
        "--input",
        b.inputs,
        "--output",
        out,
        "--microbatches",
        MICROBATCHES,
    )
    assert result.returncode == 0, result.stderr
    assert_equals_eager(out, b.expected)


@pytest.mark.parametrize("name", CASES)
def test_skeleton_without_the_buffers_is_refused_naming_the_buffer_and_the_fix(built, tmp_path, name):
    b, case = built[name], CASES[name]
    skeleton = tmp_path / "all_meta.pt"
    libpipe.save_skeleton(b.traced, str(skeleton))  # as before: every tensor on the meta device
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        skeleton,
        *case.split,
        "--weights",
        b.checkpoint,
        "--input",
        b.inputs,
        "--output",
        out,
        "--microbatches",
        MICROBATCHES,
    )
    assert result.returncode == 1, result.stderr
    assert_one_line_error(
        result,
        f"tensor '{case.buffers[0]}' (stage {case.buffer_stage}) is not in checkpoint",
        "no data for it",
        "add it to the checkpoint",
        "save_skeleton",
        "module=",
        "keep=",
        "PIPE_ERR_NOT_FOUND",
    )
    assert not out.exists()


def test_save_skeleton_refuses_names_the_module_does_not_have(built, tmp_path):
    llama, bert = built["llama"], built["bert"]
    with pytest.raises(ValueError, match="model.rotary_emb.inv_fre'"):
        libpipe.save_skeleton(llama.traced, str(tmp_path / "x.pt"), keep=["model.rotary_emb.inv_fre"])
    # BERT's buffers are not Llama's: the module given is not the one traced.
    with pytest.raises(ValueError, match="embeddings.position_ids.*traced or scripted from"):
        libpipe.save_skeleton(llama.traced, str(tmp_path / "x.pt"), module=bert.model)
    assert not (tmp_path / "x.pt").exists()
