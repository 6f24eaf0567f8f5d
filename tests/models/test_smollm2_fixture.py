"""The SmolLM2-135M-Instruct fixture (smollm2.py): the cached folder is a Hugging Face checkpoint;
its tensors are the GGUF's, dequantized by the gguf package itself and mapped by hand here
(independently of transformers' GGUF loader); and the cache converts once, publishes only whole
folders and recovers from a converter that failed. That plain transformers loads the folder without
gguf and answers chat prompts as the trained model does is tests/llm/test_smollm2.py's reference
(which `pipe generate` must then equal): one run of the model in transformers for both.
"""

import json
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open

import smollm2

FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def folder():
    return smollm2.smollm2_folder()


def test_folder_is_a_hugging_face_checkpoint(folder):
    for name in FILES + [smollm2.MARKER]:
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}  # no rope scaling
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["dtype"] == "float32"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == "<|im_end|>" and tokenizer["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in tokenizer["chat_template"]
    assert not (folder / "chat_template.jinja").exists()  # one place for the template

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    # Tied head stored once, as in the original checkpoint: the embedding serves as lm_head.
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == 2 + 30 * 9  # embedding, final norm, 9 tensors per layer
    assert dtypes == {"F32"}


def unpermute(w, heads):
    """llama.cpp's converter interleaves the halves of each q/k head's rows for its rotary kernel;
    this puts them back in the Hugging Face order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF name -> (checkpoint name, heads to unpermute by, or 0)
PAIRS = {
    "token_embd.weight": ("model.embed_tokens.weight", 0),  # Q8_0
    "output_norm.weight": ("model.norm.weight", 0),  # F32
    "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", 0),
    "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 9),  # Q4_1
    "blk.5.attn_k.weight": ("model.layers.5.self_attn.k_proj.weight", 3),
    "blk.17.attn_v.weight": ("model.layers.17.self_attn.v_proj.weight", 0),
    "blk.29.ffn_down.weight": ("model.layers.29.mlp.down_proj.weight", 0),
}


def test_tensors_equal_the_dequantized_gguf(folder):
    reader = gguf.GGUFReader(smollm2.gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # the GGUF ties the head too
    with safe_open(folder / "model.safetensors", "pt") as f:
        for gguf_name, (name, heads) in PAIRS.items():
            t = tensors[gguf_name]
            want = gguf.dequantize(t.data, t.tensor_type)
            if heads:
                want = unpermute(want, heads)
            assert torch.equal(f.get_tensor(name), torch.from_numpy(want.copy())), name


def test_reuses_the_cached_folder(folder):
    def refuse(gguf_file, dest):
        raise AssertionError("converted again although the cache is complete")

    assert smollm2.smollm2_folder(converter=refuse) == folder


# --- the cache itself, with a stand-in converter (the real one takes a minute) ---


def fake_converter(calls, final=None):
    def convert(gguf_file, dest):
        calls.append(dest)
        # Published only when whole: while converting, the final folder does not exist.
        assert final is None or not final.exists()
        (dest / "config.json").write_text("{}")
        (dest / smollm2.MARKER).write_text(json.dumps(smollm2.marker(smollm2.sha256(gguf_file))))

    return convert


def cache_folder(cache):
    return cache / f"smollm2-135m-instruct-{smollm2.sha256(smollm2.gguf_path())[:12]}"


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LIBPIPE_MODEL_CACHE", str(tmp_path))
    final = cache_folder(tmp_path)
    calls, results, errors = [], [], []

    def call():
        try:
            results.append(smollm2.smollm2_folder(converter=fake_converter(calls, final)))
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(calls) == 1
    assert results == [final] * 4
    assert (final / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, f".{final.name}.lock"])


def test_failed_conversion_leaves_nothing_and_is_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("LIBPIPE_MODEL_CACHE", str(tmp_path))
    final = cache_folder(tmp_path)

    def broken(gguf_file, dest):
        (dest / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    with pytest.raises(RuntimeError, match="half way"):
        smollm2.smollm2_folder(converter=broken)
    assert [p.name for p in tmp_path.iterdir()] == [f".{final.name}.lock"]
    calls = []
    assert smollm2.smollm2_folder(converter=fake_converter(calls)) == final
    assert len(calls) == 1


def test_folder_of_another_format_is_converted_again(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / smollm2.MARKER).write_text(json.dumps({**smollm2.marker("x"), "format": smollm2.FORMAT - 1}))
    calls = []
    assert smollm2.smollm2_folder(out, converter=fake_converter(calls)) == out
    assert len(calls) == 1 and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]


def test_missing_package_says_what_to_do(monkeypatch):
    def absent(name):
        raise smollm2.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "distribution", absent)
    with pytest.raises(smollm2.FixtureError, match="install-deps.sh"):
        smollm2.gguf_path()


def test_command_line_prints_the_folder(folder):
    script = Path(smollm2.__file__)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(folder)
