"""The decoder as a torch.export program: `python -m libpipe.export_llm HF_DIR OUT.pt2` against
transformers, run with LibTorch's runtime for exported programs (nativert) directly, no libpipe.

The .pt2 skeleton holds no weights and no caches (empty records; libpipe fills them from the
checkpoint and with zeros): here they are filled the same way into a copy of the archive, which
torch._C._nativert.PyModelRunner runs as libpipe's stages would. A batched prefill and decode
steps, and sequences joining mid-flight (prompts prefilled in chunks beside decode rows, calls of
one row and of one token), must give transformers' greedy tokens, the caches persisting across
runs; calls that break the contract raise the decoder's own messages at run time.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter

from llm_models import MAX_LEN, PROMPTS, SLOTS, VOCAB, export, make_exported, num_layers
from test_decoder import greedy_batched, greedy_mid_flight, pad

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C, "_nativert"), reason="this LibTorch has no nativert (torch._C._nativert)"
)

MODELS = ["llama", "qwen2", "gpt2"]  # a tied head, q/k/v biases, GPT-2's own layout (tied)
WEIGHTS = "data/weights/model_weights_config.json"
CONSTANTS = "data/constants/model_constants_config.json"
MESSAGES = [
    "decoder: every row needs 1 <= lengths <= T (the width of tokens)",
    "decoder: start must be >= 0",
    "decoder: start + lengths exceeds the maximum sequence length the caches were made for (export_llm --max-seq-len)",
    "decoder: a slot is outside 0 .. slots-1 (export_llm --max-batch sets the slots)",
    "decoder: two rows of one call name the same cache slot",
    "decoder: a token id is outside the vocabulary (0 .. vocab_size-1)",
]


def read_archive(path):
    with PT2ArchiveReader(str(path)) as reader:
        return {r: reader.read_bytes(r) for r in reader.get_file_names()}


def records_of(archive):
    """{fqn: (record, tensor_meta)} of the weights and constants configs."""
    out = {}
    for config in (WEIGHTS, CONSTANTS):
        folder = config.rsplit("/", 1)[0]
        for fqn, entry in json.loads(archive[config])["config"].items():
            out[fqn] = (f"{folder}/{entry['path_name']}", entry["tensor_meta"])
    return out


def filled(skeleton, checkpoint, out):
    """A copy of `skeleton` with each empty record filled as libpipe's stages fill it: from the
    checkpoint under any name of its record (a tied head is the embedding's record), else zeros
    (the caches)."""
    archive = read_archive(skeleton)
    weights = load_file(checkpoint)
    names_of = {}
    for fqn, (record, meta) in records_of(archive).items():
        names_of.setdefault(record, []).append((fqn, meta))
    for record, names in names_of.items():
        if archive[record]:
            continue
        fqn, meta = names[0]
        shape = [d["as_int"] for d in meta["sizes"]]
        found = [weights[n] for n, _ in names if n in weights]
        tensor = found[0] if found else torch.zeros(shape)
        assert list(tensor.shape) == shape, (fqn, tensor.shape, shape)
        archive[record] = tensor.contiguous().numpy().tobytes()
    with PT2ArchiveWriter(str(out)) as writer:
        for record, data in archive.items():
            if not record.startswith(".data/"):
                writer.write_bytes(record, data)
    return out


@pytest.fixture(scope="module", params=MODELS)
def pt2(request, tmp_path_factory):
    """(Exported of llm_models with the .pt2 skeleton as .skeleton, a runner of it filled)."""
    folder = tmp_path_factory.mktemp(request.param)
    exported = make_exported(request.param, folder)
    exported.skeleton = str(folder / "decoder.pt2")
    result = export(folder, exported.skeleton, "--max-seq-len", MAX_LEN, "--max-batch", SLOTS, "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert "KV cache" in result.stdout
    return exported


def runner(exported, tmp_path):
    path = filled(exported.skeleton, exported.weights, tmp_path / "filled.pt2")
    return torch._C._nativert.PyModelRunner(str(path), "model")


def test_skeleton_has_empty_records_for_weights_and_caches(pt2):
    archive = read_archive(pt2.skeleton)
    records = records_of(archive)
    checkpoint = set(load_file(pt2.weights))
    params = set(json.loads(archive[WEIGHTS])["config"])
    # Every checkpoint tensor is a parameter of that name, and no parameter has data here.
    assert checkpoint <= params and params - checkpoint <= {"lm_head.weight"}
    assert all(archive[records[n][0]] == b"" for n in params)
    # A tied head is one record under both names, which the checkpoint's embedding fills.
    if pt2.config.get("tie_word_embeddings", pt2.config["model_type"] == "gpt2"):
        embedding = "transformer.wte.weight" if pt2.config["model_type"] == "gpt2" else "model.embed_tokens.weight"
        assert records["lm_head.weight"][0] == records[embedding][0]
    caches = [n for n in records if n.endswith(("k_cache", "v_cache"))]
    assert len(caches) == 2 * num_layers(pt2.config)
    for n in caches:
        record, meta = records[n]
        assert archive[record] == b""
        sizes = [d["as_int"] for d in meta["sizes"]]
        assert sizes[0] == SLOTS and sizes[2] == MAX_LEN
        strides = [d["as_int"] for d in meta["strides"]]
        assert strides == [sizes[1] * sizes[2] * sizes[3], sizes[2] * sizes[3], sizes[3], 1]
    # The rotary frequencies (no checkpoint holds them) keep their data.
    for n, (record, _) in records.items():
        if n.endswith("inv_freq"):
            assert len(archive[record]) > 0


def test_big_caches_cost_nothing_in_the_file(pt2, tmp_path):
    if pt2.config["model_type"] == "gpt2":
        pytest.skip("GPT-2's position table bounds max_len at 64")
    out = tmp_path / "big.pt2"
    result = export(pt2.folder, out, "--max-seq-len", 4096, "--max-batch", 64, "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size < 2**20  # caches of 96 MiB


def test_program_checks_dims_and_cache_writes(pt2):
    program = json.loads(read_archive(pt2.skeleton)["models/model.json"])
    graph = program["graph_module"]["graph"]
    targets = [n["target"] for n in graph["nodes"]]
    asserts = [n for n in graph["nodes"] if n["target"] == "torch.ops.aten._assert_async.msg"]
    assert [a["inputs"][1]["arg"]["as_string"] for a in asserts] == MESSAGES
    layers = num_layers(pt2.config)
    # Each layer writes its caches in place (no buffer_mutation output: nativert keeps the writes)
    # and reads the longest context with item(), an unbacked size that narrows the caches.
    assert targets.count("torch.ops.aten.index_put_.default") == 2 * layers
    assert targets.count("torch.ops.aten.item.default") == layers
    assert targets.count("torch.ops.aten.narrow.default") == 2 * layers
    assert "torch.ops.aten.nonzero.default" not in targets
    assert not any("higher_order" in t for t in targets)
    assert [list(s) for s in program["graph_module"]["signature"]["output_specs"]] == [["user_output"]]
    # B and T dynamic from 1, unbounded; the context of each layer in 1 .. max_len.
    ranges = program["range_constraints"]
    dims = {k: v for k, v in ranges.items() if k.startswith("s")}
    contexts = {k: v for k, v in ranges.items() if k.startswith("u")}
    assert sorted(dims.values(), key=str) == [{"min_val": 1, "max_val": None}] * 2
    assert list(contexts.values()) == [{"min_val": 1, "max_val": MAX_LEN}] * layers
    sizes = [d["as_expr"]["expr_str"] for d in graph["tensor_values"]["tokens"]["sizes"]]  # B, T
    assert sorted(name for name in dims if any(f"'{name}'" in s for s in sizes)) == sorted(dims)
    for name in ("start", "lengths", "slots"):
        assert graph["tensor_values"][name]["sizes"] == [{"as_expr": {"expr_str": sizes[0], "hint": {"as_int": 2}}}]


def test_nativert_equals_transformers(pt2, tmp_path):
    model = runner(pt2, tmp_path)

    def step(*args):
        return model.run(*args)

    with torch.no_grad():
        assert greedy_batched(step, PROMPTS[:SLOTS], [2, 0, 3, 1]) == pt2.reference[:SLOTS]
        # B from 1 to 2, T from 1 to the chunk, prefill rows beside decode rows, slots reused.
        assert greedy_mid_flight(step, PROMPTS, [1, 3]) == pt2.reference


def test_bad_calls_raise_the_decoders_messages(pt2, tmp_path):
    model = runner(pt2, tmp_path)
    one = torch.ones(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    two_rows = (torch.tensor([[1], [2]]), torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64))
    cases = [
        ((torch.tensor([[1]]), zero, zero, zero), MESSAGES[0]),
        ((torch.tensor([[1]]), zero, torch.tensor([2]), zero), MESSAGES[0]),
        ((torch.tensor([[1]]), torch.tensor([-1]), one, zero), MESSAGES[1]),
        ((torch.tensor([[1]]), torch.tensor([MAX_LEN]), one, zero), MESSAGES[2]),
        ((torch.tensor([[1, 2, 3]]), torch.tensor([MAX_LEN - 2]), torch.tensor([3]), zero), MESSAGES[2]),
        ((torch.tensor([[1]]), zero, one, torch.tensor([SLOTS])), MESSAGES[3]),
        ((torch.tensor([[1]]), zero, one, torch.tensor([-1])), MESSAGES[3]),
        ((*two_rows, torch.tensor([1, 1])), MESSAGES[4]),
        ((torch.tensor([[VOCAB]]), zero, one, zero), MESSAGES[5]),
        ((torch.tensor([[-1]]), zero, one, zero), MESSAGES[5]),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError) as e:
            model.run(*args)
        # nativert's text: the node, its arguments, then the message itself on a line of its own.
        assert f"\n{message}\n" in str(e.value), str(e.value)
    # A refused call wrote nothing: slot 0 still gives the reference, and padding (ids outside the
    # vocabulary) is still ignored.
    tokens, lengths = pad([PROMPTS[0]])
    logits = model.run(tokens, zero, lengths, zero)
    assert int(logits.argmax()) == pt2.reference[0][0]
