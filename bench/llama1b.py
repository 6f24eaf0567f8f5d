"""A 1B-class Llama for the generation benchmark, so that per-step overhead does not decide.

SmolLM2-135M's decode step is a few milliseconds of weight traffic, where dispatch and hand-overs
weigh as much as the kernels. This model is built from a config with random weights (no hub here):
hidden 2048, 16 layers, 32 query heads and 8 key/value heads of 64, intermediate 8192, SmolLM2's
vocabulary of 49152 and tokenizer (so that the same prompts and chat text serve both models), untied
head: 1.17 B parameters, 4.7 GB in float32. The folder is written once per machine into
$LIBPIPE_MODEL_CACHE (default ~/.cache/libpipe/models) as a Hugging Face checkpoint that libpipe's
export_llm, transformers and llama.cpp's convert_hf_to_gguf.py all read.

    python bench/llama1b.py      # prints the folder, building it if missing
"""

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))

CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
SEED = 0


def _cache():
    base = os.environ.get("LIBPIPE_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "libpipe", "models")
    return base


def llama1b_folder():
    """The model's folder, written first if missing (a minute or two, once)."""
    import hashlib

    digest = hashlib.sha256(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest()[:12]
    folder = os.path.join(_cache(), f"llama-1b-random-{digest}")
    if os.path.isfile(os.path.join(folder, "libpipe-bench-model.json")):
        return folder
    import torch
    from smollm2 import smollm2_folder
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"llama1b: writing a 1B-class Llama with random weights to {folder} (once per machine)", file=sys.stderr)
    tmp = folder + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(SEED)
    with torch.no_grad():
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    smol = smollm2_folder()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smol, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "libpipe-bench-model.json"), "w") as f:
        json.dump({"config": CONFIG, "seed": SEED, "tokenizer": "SmolLM2-135M-Instruct's"}, f)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


if __name__ == "__main__":
    print(llama1b_folder())
