"""The decoder contract (libpipe.decoders) and `python -m libpipe.export_llm`, against transformers.

The random-weight Llama, Qwen2, Mistral and GPT-2 models of llm_models.py, exported (conftest.py's
`exported` fixture), must generate token for token what transformers' greedy `generate` does:

- scripted in this process (the contract alone, no libpipe): a batched prefill of prompts of
  different lengths in different slots, then decode steps, and sequences joining mid-flight (a
  prefill row beside decode rows), long prompts prefilled in chunks, a finished sequence's slot
  reused by a new one;
- through libpipe sessions driven step by step from here: two sessions of one plan (and one of
  another plan) must not share caches, and a bfloat16 checkpoint or session dtype decodes as
  transformers or eager PyTorch do in bfloat16 (along their greedy tokens, each of which libpipe
  must choose up to bfloat16's rounding: see assert_decodes_in_bf16).

Generation through libpipe's engine, over 1, 2 and 3 stages and 2 processes, is test_generate.py's
(`pipe generate`). Here also: each layer's caches are buffers of the stage of its layer; errors: an
unsupported model type or rope type fails the export with one line naming what is supported;
positions beyond the caches, token ids outside the vocabulary and one slot twice in a call are
refused by the module itself.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import libpipe
from libpipe.decoders import build_decoder
from llm_models import (
    CHUNK,
    MAX_LEN,
    NEW_TOKENS,
    PROMPTS,
    SLOTS,
    VOCAB,
    common,
    export,
    export_command,
    greedy_reference,
    layer_path,
    num_layers,
    split_points,
)


def pad(rows):
    """[[ids]] -> tokens [B, T] right-padded with an id out of the vocabulary (padding must be
    ignored, never embedded), and lengths [B]."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), VOCAB + 1000, dtype=torch.int64)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.int64)


def greedy_batched(step, prompts, slots):
    """Prefill every prompt in one call (row i in slots[i]), then decode NEW_TOKENS - 1 steps of
    all of them together. `step(tokens, start, lengths, slots)` returns logits [B, vocab]."""
    tokens, lengths = pad(prompts)
    start = torch.zeros(len(prompts), dtype=torch.int64)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    out = [[int(x)] for x in step(tokens, start, lengths, slot_t).argmax(-1)]
    start = lengths.clone()
    ones = torch.ones(len(prompts), dtype=torch.int64)
    for _ in range(NEW_TOKENS - 1):
        last = torch.tensor([[o[-1]] for o in out], dtype=torch.int64)
        for o, x in zip(out, step(last, start, ones, slot_t).argmax(-1)):
            o.append(int(x))
        start += 1
    return out


def greedy_mid_flight(step, prompts, slots):
    """Sequences join and leave between calls: at most `slots` run at once; a sequence joins when a
    slot is free (the slot a finished one left, used again without clearing), its prompt is
    prefilled CHUNK tokens per call in the same calls as the others' decode steps, and it leaves
    after NEW_TOKENS tokens. Returns the generated tokens per prompt."""
    waiting = list(range(len(prompts)))
    free = list(slots)
    running = {}  # prompt index -> [slot, tokens in the cache, generated]
    out = [None] * len(prompts)
    calls = 0
    while waiting or running:
        # One sequence joins per call, so joins happen while others are mid-flight.
        if waiting and free:
            running[waiting.pop(0)] = [free.pop(0), 0, []]
        rows, order = [], []
        for i, (slot, cached, gen) in running.items():
            if cached < len(prompts[i]):
                rows.append(prompts[i][cached : cached + CHUNK])
            else:
                rows.append([gen[-1]])
            order.append(i)
        tokens, lengths = pad(rows)
        start = torch.tensor([running[i][1] for i in order], dtype=torch.int64)
        slot_t = torch.tensor([running[i][0] for i in order], dtype=torch.int64)
        logits = step(tokens, start, lengths, slot_t)
        calls += 1
        for row, i in enumerate(order):
            seq = running[i]
            seq[1] += int(lengths[row])
            if seq[1] >= len(prompts[i]):  # the prompt is in: this row's logits give a token
                seq[2].append(int(logits[row].argmax()))
            if len(seq[2]) == NEW_TOKENS:
                out[i] = seq[2]
                free.append(seq[0])
                del running[i]
    assert calls > NEW_TOKENS  # the sequences did not all run in lockstep
    return out


def scripted_with_weights(exported, cache_dtype=None):
    """The decoder scripted in this process with the checkpoint's tensors copied in by name."""
    decoder = build_decoder(exported.config, MAX_LEN, SLOTS, cache_dtype=cache_dtype)
    missing, unexpected = decoder.load_state_dict(load_file(exported.weights), strict=False)
    tied = exported.config.get("tie_word_embeddings", False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
    return torch.jit.script(decoder)


def test_skeleton_has_no_weights_and_checkpoint_names(exported):
    ts = torch.jit.load(exported.skeleton)
    # The contract's optional flag: the forward computes the valid tokens only, so libpipe mixes decode rows and
    # prompt chunks in one call (test_scripted_decoder_equals_transformers checks such calls against transformers).
    assert ts.skips_padding is True
    params = dict(ts.named_parameters())
    assert params and all(p.is_meta for p in params.values())
    checkpoint = set(load_file(exported.weights))
    # Every checkpoint tensor is a parameter of the same name; a tied head is the embedding.
    assert checkpoint <= set(params) | {"lm_head.weight"}
    assert set(params) - checkpoint <= {"lm_head.weight"}
    buffers = dict(ts.named_buffers())
    caches = [n for n in buffers if n.endswith(("k_cache", "v_cache"))]
    assert len(caches) == 2 * num_layers(exported.config)
    kv_heads = exported.config.get("num_key_value_heads") or exported.config["n_head"]
    for n in caches:
        assert not buffers[n].is_meta
        assert buffers[n].shape == (SLOTS, kv_heads, MAX_LEN, buffers[n].shape[3])
        # A placeholder: one zero seen through zero strides, which libpipe allocates per stage.
        assert set(buffers[n].stride()) == {0} and buffers[n].untyped_storage().nbytes() == buffers[n].element_size()
        assert not buffers[n].any()


def test_skeleton_file_does_not_hold_the_caches(exported, tmp_path):
    """Caches of 3 layers x 16 slots x 2048 tokens (over 8 MiB) cost a few bytes in the file."""
    skeleton = tmp_path / "big.pt"
    result = export(exported.folder, skeleton, "--max-seq-len", 2048, "--max-batch", 16, "--dtype", "fp32")
    if exported.config["model_type"] == "gpt2":  # its position table bounds the length
        assert result.returncode == 1 and "n_positions" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    shapes = build_decoder(exported.config, 2048, 16, placeholder_caches=True).named_buffers()
    cache_bytes = sum(b.numel() * 4 for n, b in shapes if n.endswith(("k_cache", "v_cache")))
    assert f"KV cache {cache_bytes / 2**20:.1f} MiB" in result.stdout
    assert cache_bytes > 8 * 2**20
    assert os.path.getsize(skeleton) < 2**20, os.path.getsize(skeleton)


def test_scripted_decoder_equals_transformers(exported):
    ts = scripted_with_weights(exported)
    with torch.no_grad():
        got = greedy_batched(ts, PROMPTS[:SLOTS], [2, 0, 3, 1])
        assert got == exported.reference[:SLOTS]
        got = greedy_mid_flight(ts, PROMPTS, [1, 3])
    assert got == exported.reference


def libpipe_step(session):
    return lambda *args: session.run(*args)["output"]


def split(model, how, config):
    """1, 2, 3: cut at decoder layers; "params3": 3 stages balanced by libpipe (cuts may fall
    between a layer's attention and MLP, never inside the attention that holds the caches)."""
    if how == "params3":
        return model.split(stages=3, policy="params")
    return model.split(split_at=split_points(config, how) or None)


@pytest.mark.parametrize("stages", [2, 3, "params3"])
def test_caches_live_in_the_stage_of_their_layer(exported, stages):
    with libpipe.Model.load(exported.skeleton) as model:
        assert model.input_names == ("tokens", "start", "lengths", "slots")
        with split(model, stages, exported.config) as plan:
            assert plan.num_stages == (3 if stages == "params3" else stages)
            owners = {}
            for s in plan.describe()["stages"]:
                for b in s["buffers"]:
                    if b.endswith(("k_cache", "v_cache")):
                        assert b not in owners, f"{b} in stages {owners[b]} and {s['index']}"
                        owners[b] = s["index"]
            assert len(owners) == 2 * num_layers(exported.config)
            if stages != "params3":  # cut at layers: each cache in the stage of its layer
                cuts = [int(p.split(":")[0].split(".")[-1]) for p in split_points(exported.config, stages)]
                for name, stage in owners.items():
                    layer = int(name[len(layer_path(exported.config)) + 1 :].split(".")[0])
                    assert stage == sum(layer >= c for c in cuts), name


def greedy_interleaved(steps, prompt_sets, slots):
    """greedy_batched for several sessions at once, their calls interleaved: session k prefills
    prompt_sets[k] (of one length each) in `slots`, then each decode step runs in every session in
    turn. Sessions sharing a cache would overwrite each other's slots. Returns one result per session."""
    slot_t = torch.tensor(slots, dtype=torch.int64)
    ones = torch.ones(len(slots), dtype=torch.int64)
    outs, starts = [], []
    for step, prompts in zip(steps, prompt_sets):
        tokens, lengths = pad(prompts)
        zero = torch.zeros(len(prompts), dtype=torch.int64)
        outs.append([[int(x)] for x in step(tokens, zero, lengths, slot_t).argmax(-1)])
        starts.append(lengths.clone())
    for _ in range(NEW_TOKENS - 1):
        for step, out, start in zip(steps, outs, starts):
            last = torch.tensor([[o[-1]] for o in out], dtype=torch.int64)
            for o, x in zip(out, step(last, start, ones, slot_t).argmax(-1)):
                o.append(int(x))
            start += 1
    return outs


@pytest.mark.parametrize("caches", ["placeholder", "allocated"])
def test_sessions_from_one_model_have_their_own_caches(exported, caches, tmp_path):
    """Two sessions of one plan (and a third of another plan of the same Model) write the same
    slots with different prompts, calls interleaved: each generates what transformers does. Also
    from a skeleton that stores its caches allocated (the model's own tensors, which every session
    must copy rather than share)."""
    skeleton = exported.skeleton
    if caches == "allocated":
        from libpipe.export import save_skeleton

        decoder = build_decoder(exported.config, MAX_LEN, SLOTS, weights_device="meta")
        skeleton = tmp_path / "allocated.pt"
        save_skeleton(torch.jit.script(decoder), str(skeleton), module=decoder)
        assert all(b.stride()[-1] == 1 for n, b in torch.jit.load(skeleton).named_buffers() if n.endswith("k_cache"))
    first, second = PROMPTS[:SLOTS], PROMPTS[SLOTS - 2 : 2 * SLOTS - 2]
    with libpipe.Model.load(skeleton) as model, split(model, 2, exported.config) as plan:
        with split(model, 1, exported.config) as whole:
            a = plan.session(weights=exported.weights, microbatches=2)
            b = plan.session(weights=exported.weights, microbatches=2)
            c = whole.session(weights=exported.weights)
            with a, b, c:
                got = greedy_interleaved([libpipe_step(x) for x in (a, b, c)], [first, second, first], [0, 1, 2, 3])
    assert got[0] == exported.reference[:SLOTS]
    assert got[1] == exported.reference[SLOTS - 2 : 2 * SLOTS - 2]
    assert got[2] == exported.reference[:SLOTS]


def forced_logits(step, prompts, continuations, slots):
    """`step`'s logits [B, NEW_TOKENS, vocab] after each prompt and each prefix of its continuation
    (teacher forcing): a batched prefill, then the continuations' tokens one call at a time."""
    tokens, lengths = pad(prompts)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    out = [step(tokens, torch.zeros(len(prompts), dtype=torch.int64), lengths, slot_t).float()]
    start = lengths.clone()
    ones = torch.ones(len(prompts), dtype=torch.int64)
    for i in range(NEW_TOKENS - 1):
        last = torch.tensor([[c[i]] for c in continuations], dtype=torch.int64)
        out.append(step(last, start, ones, slot_t).float())
        start += 1
    return torch.stack(out, 1)


def hf_logits(hf, prompts, continuations):
    """transformers' logits [B, NEW_TOKENS, vocab] at the same places, one prompt at a time."""
    rows = []
    with torch.no_grad():
        for p, c in zip(prompts, continuations):
            ids = torch.tensor([p + c[:-1]])
            rows.append(hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(p) - 1 :].float())
    return torch.stack(rows)


def assert_decodes_in_bf16(got, want, fp32, tokens):
    """libpipe's bfloat16 logits `got` along the reference's greedy tokens (teacher forcing) against the
    reference's own `want` and float32's `fp32` at the same places. Its attention and element-wise
    kernels round where eager rounds but sum float32 in another order (runtime/cpu), so a near tie may
    break the other way and free-running greedy tokens part from there on: every reference token must
    be libpipe's choice up to bfloat16's rounding of the logits (2^-7 of their scale), and the logits
    must be the bfloat16 computation, nearer the reference's than float32's."""
    ids = torch.tensor(tokens, dtype=torch.int64)
    chosen = got.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    gap = got.max(-1).values - chosen
    tol = 2**-7 * got.abs().amax(-1)
    assert (
        gap <= tol
    ).all(), f"reference tokens libpipe ranks below its best by {gap.max().item()} (> {tol.max().item()})"
    assert (got - want).abs().mean() < (got - fp32).abs().mean()


def test_bf16_checkpoint_equals_transformers_in_bf16(exported, tmp_path):
    """A checkpoint saved in bfloat16: export_llm takes its dtype from config.json, the weights load
    without conversion, and decoding over 2 stages follows transformers' greedy tokens in bfloat16
    (which differ from float32's for these models, checked below), as assert_decodes_in_bf16 says."""
    from transformers import AutoModelForCausalLM

    if exported.config["model_type"] == "gpt2":
        pytest.skip("this random GPT-2 generates the same tokens in bfloat16 as in float32: nothing to tell apart")
    hf = AutoModelForCausalLM.from_pretrained(exported.folder, dtype=torch.bfloat16).eval()
    hf.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    skeleton = tmp_path / "decoder.pt"
    result = export(tmp_path, skeleton, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS)
    assert result.returncode == 0, result.stderr
    prompts = PROMPTS[:SLOTS]
    reference = greedy_reference(hf, prompts)
    fp32 = AutoModelForCausalLM.from_pretrained(exported.folder).eval()
    with libpipe.Model.load(skeleton) as model, split(model, 2, exported.config) as plan:
        with plan.session(weights=tmp_path / "model.safetensors", microbatches=2) as session:
            got = forced_logits(libpipe_step(session), prompts, reference, [0, 1, 2, 3])
    assert_decodes_in_bf16(got, hf_logits(hf, prompts, reference), hf_logits(fp32, prompts, reference), reference)
    # The float32 skeleton and checkpoint run in bfloat16 by the session's dtype, which means eager
    # model.to(bfloat16): the caches are allocated in bfloat16 (a float32 cache would refuse the
    # bfloat16 keys), and the rotary inv_freq is cast too, which transformers keeps in float32 (so
    # Mistral's tokens differ from transformers' there: export with --dtype bf16 for those).
    eager = scripted_with_weights(exported).to(torch.bfloat16)
    eager32 = scripted_with_weights(exported)
    with torch.no_grad():
        expected = greedy_batched(eager, prompts, [0, 1, 2, 3])
        want = forced_logits(eager, prompts, expected, [0, 1, 2, 3])
        want32 = forced_logits(eager32, prompts, expected, [0, 1, 2, 3])
    with libpipe.Model.load(exported.skeleton) as model, split(model, 2, exported.config) as plan:
        with plan.session(weights=exported.weights, dtype="bfloat16") as session:  # as eager: one batch
            got = forced_logits(libpipe_step(session), prompts, expected, [0, 1, 2, 3])
    assert_decodes_in_bf16(got, want, want32, expected)
    # The dtype decides tokens here, so a float32 computation somewhere would be caught.
    assert reference != exported.reference[:SLOTS]


def test_caches_in_bf16_for_a_float32_model(exported, tmp_path):
    """export_llm --cache-dtype bf16: the caches are bfloat16 buffers (half the bytes), the weights stay float32,
    and libpipe over 2 stages decodes as the eager decoder with the same caches: keys and values rounded once
    when written, attention in float32."""
    skeleton = tmp_path / "bf16-caches.pt"
    result = export(exported.folder, skeleton, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS, "--cache-dtype", "bf16")
    assert result.returncode == 0, result.stderr
    buffers = dict(torch.jit.load(skeleton).named_buffers())
    caches = [b for n, b in buffers.items() if n.endswith(("k_cache", "v_cache"))]
    assert caches and all(b.dtype == torch.bfloat16 for b in caches)
    assert all(p.dtype == torch.float32 for p in torch.jit.load(skeleton).parameters())
    prompts = PROMPTS[:SLOTS]
    with torch.no_grad():
        expected = greedy_batched(scripted_with_weights(exported, torch.bfloat16), prompts, [0, 1, 2, 3])
    with libpipe.Model.load(skeleton) as model, split(model, 2, exported.config) as plan:
        with plan.session(weights=exported.weights, microbatches=2) as session:
            assert greedy_batched(libpipe_step(session), prompts, [0, 1, 2, 3]) == expected


def test_bad_calls_are_refused_by_the_module(exported):
    with libpipe.Model.load(exported.skeleton) as model, model.split() as plan:
        with plan.session(weights=exported.weights) as session:
            one = torch.ones(1, dtype=torch.int64)
            zero = torch.zeros(1, dtype=torch.int64)
            cases = [
                ((torch.tensor([[1]]), torch.tensor([MAX_LEN]), one, zero), "maximum sequence length"),
                ((torch.tensor([[1, 2, 3]]), torch.tensor([MAX_LEN - 2]), torch.tensor([3]), zero), "maximum"),
                ((torch.tensor([[VOCAB]]), zero, one, zero), "outside the vocabulary"),
                ((torch.tensor([[-1]]), zero, one, zero), "outside the vocabulary"),
                (
                    (
                        torch.tensor([[1], [2]]),
                        torch.zeros(2, dtype=torch.int64),
                        torch.ones(2, dtype=torch.int64),
                        torch.tensor([1, 1]),
                    ),
                    "same cache slot",
                ),
                ((torch.tensor([[1]]), zero, one, torch.tensor([SLOTS])), "slot"),
                ((torch.tensor([[1]]), zero, torch.tensor([2]), zero), "lengths"),
                ((torch.tensor([[1]]), torch.tensor([-1]), one, zero), "start must be >= 0"),
            ]
            for args, needle in cases:
                with pytest.raises(libpipe.ExecutionError) as e:
                    session.run(*args)
                assert needle in str(e.value), str(e.value)
            # The session keeps serving, and a refused call wrote nothing: slot 0 still works.
            tokens, lengths = pad([PROMPTS[0]])
            logits = session.run(tokens, torch.zeros(1, dtype=torch.int64), lengths, zero)["output"]
            assert int(logits.argmax()) == exported.reference[0][0]


def write_config(folder, **changes):
    from transformers import LlamaConfig

    folder.mkdir()
    LlamaConfig(**common()).save_pretrained(folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return folder


def one_error_line(result, *needles):
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export_llm: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unsupported_model_type_is_refused(tmp_path):
    folder = write_config(tmp_path / "gpt_neox", model_type="gpt_neox")
    result = export(folder, tmp_path / "out.pt")
    one_error_line(result, "'gpt_neox'", "llama", "mistral", "qwen2")
    assert not (tmp_path / "out.pt").exists()


def test_unsupported_rope_is_refused(tmp_path):
    folder = write_config(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    one_error_line(export(folder, tmp_path / "out.pt"), "'yarn'", "default", "llama3")


def test_missing_config_is_refused(tmp_path):
    """Through the command itself (`python -m`); every other export here calls its main()."""
    one_error_line(export_command(tmp_path, tmp_path / "out.pt"), "config.json")


def test_bad_sizes_and_output_are_refused(tmp_path):
    folder = write_config(tmp_path / "llama")
    one_error_line(export(folder, tmp_path / "out.pt", "--max-batch", 0), "at least 1")
    one_error_line(export(folder, tmp_path / "no" / "such" / "out.pt", "--max-seq-len", 8), "cannot write")
