"""`pipe run --dtype bf16|fp16` on Hugging Face decoders traced in float32. Their RMSNorm and rotary
embedding upcast to float32 and cast back with `.to(input_dtype)`, which a float32 trace records as
casts to float32; libpipe keeps the upcasts and casts back where eager code does
(runtime/stage/dtype_casts.h), so the pipeline computes what `model.to(dtype)` computes eagerly. A
model whose float32 cast cannot be adapted before run time is refused when the session is made
(or the stage saved), never at the first micro-batch.

How close is close: the reference is eager PyTorch running the same model converted with
`model.to(dtype)`, on the same micro-batches (reduced-precision kernels round differently for
different batch sizes). Its own distance from float32 eager is the scale: rounding to the dtype
moves the logits by that much. Converting the trace some other way lands about as far from the
eager bf16 model as bf16 is from float32: rewriting every traced float32 cast to bf16 (RMSNorm
statistics and rotary angles in bf16) gives a mean difference of 1.0x that scale and a largest one
of 1.7x. libpipe runs the same kernels on the same values as eager code, so on the machines this was
written on the outputs are equal bit for bit; the bounds (mean within a quarter of the scale,
largest within the scale) leave room for a kernel that rounds a few logits one step the other way.
"""

import pytest
import torch
from conftest import SANITIZED, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file, save_file

MICROBATCHES = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def decoder(kind):
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]

    class Logits(model_class):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    config = config_class(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return lambda: Logits(config).eval()


def eager(model, ids):
    with torch.no_grad():
        return torch.cat([model(part) for part in ids.tensor_split(MICROBATCHES)])


DTYPE_CASES = [
    ("llama", "bf16", 1),
    ("qwen2", "bf16", 1),
    ("mistral", "bf16", 1),
    ("llama", "fp16", 1),
    # Stage 1 is built on the driver and its weights converted in the worker.
    ("llama", "bf16", 2),
]


# Under the sanitizers (conftest.SANITIZED): one model in one process and over two.
@pytest.mark.parametrize(
    "kind,dtype,processes",
    [c for c in DTYPE_CASES if c[0] == "llama" and c[1] == "bf16"] if SANITIZED else DTYPE_CASES,
)
def test_float32_trace_runs_as_eager_code_in_the_dtype(tmp_path, kind, dtype, processes):
    make = decoder(kind)
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, 256, (4, 12))
    with torch.no_grad():
        traced = torch.jit.trace(model, (ids,))
    traced.save(str(tmp_path / "model.pt"))
    save_file({"input_ids": ids}, str(tmp_path / "in.safetensors"))

    result = pipe(
        "run",
        tmp_path / "model.pt",
        "--split-at",
        "model.layers.0:end",
        "--dtype",
        dtype,
        "--input",
        tmp_path / "in.safetensors",
        "--output",
        tmp_path / "out.safetensors",
        "--microbatches",
        MICROBATCHES,
        *(["--processes", processes] if processes > 1 else []),
    )
    assert result.returncode == 0, result.stderr
    got = load_file(str(tmp_path / "out.safetensors"))["output"]
    assert got.dtype == DTYPES[dtype]

    converted = make()
    converted.load_state_dict(model.state_dict())
    want = eager(converted.to(DTYPES[dtype]), ids).float()
    scale = (want - eager(model, ids)).abs()
    error = (got.float() - want).abs()
    assert scale.max() > 0, "the dtype must round something for the bounds to mean anything"
    assert error.mean() <= scale.mean() / 4, (error.mean(), scale.mean())
    assert error.max() <= scale.max(), (error.max(), scale.max())


class FixedMatmul(torch.nn.Module):
    """A forward argument times a buffer cast to float32: the argument may be converted to bf16 or
    be an integer tensor, so which cast the matmul needs is only known at run time."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(8, 8))

    def forward(self, x):
        return torch.matmul(x, self.table.to(torch.float32))


def test_an_undecidable_float32_cast_is_refused_before_any_micro_batch(tmp_path):
    x = torch.randn(4, 8)
    torch.jit.trace(FixedMatmul().eval(), (x,)).save(str(tmp_path / "model.pt"))
    save_file({"x": x}, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out.safetensors"
    needles = [
        "stage 0",
        "`aten::matmul`",
        "`aten::to`",
        "test_dtype_casts.py:",
        "model.to(torch.bfloat16)",
        "PIPE_ERR_UNSUPPORTED",
    ]

    result = pipe(
        "run", tmp_path / "model.pt", "--dtype", "bf16", "--input", tmp_path / "in.safetensors", "--output", out
    )
    assert result.returncode == 1
    assert_one_line_error(result, *needles)
    assert "micro-batch" not in result.stderr
    assert not out.exists()

    result = pipe("split", tmp_path / "model.pt", "--dtype", "bf16", "--save-stages", tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "stage0.pt").exists()

    # In float32 it runs as traced.
    result = pipe("run", tmp_path / "model.pt", "--input", tmp_path / "in.safetensors", "--output", out)
    assert result.returncode == 0, result.stderr
