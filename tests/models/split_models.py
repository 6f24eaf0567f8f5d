"""Generates the split-test models: real architectures and the cases PyTorch's splitter gets
wrong, each as TorchScript with inputs and eager PyTorch's reference outputs.

    python split_models.py OUT_DIR

writes, for each model NAME: OUT_DIR/NAME.pt, NAME.inputs.safetensors (one tensor per forward
argument), NAME.expected.safetensors (output / output.<i> / output.<key>) and NAME.state_dict.txt.
Weights are random (nothing is downloaded); configs are small so the suite stays fast.
"""

import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from libpipe import pipe_split

torch.manual_seed(0)


# ---- the no_grad case PyTorch's splitter asserts on ----


class Scaler(nn.Module):
    """A module with a buffer whose forward runs under no_grad (as Llama's rotary embedding)."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    @torch.no_grad()
    def forward(self, x):
        return x * self.scale


class NoGradLayers(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        self.scaler = Scaler(width)

    def forward(self, x):
        for layer in self.layers:
            x = self.scaler(layer(x))
        return x


class ScriptedNoGrad(nn.Module):
    """The same with explicit `with torch.no_grad()` blocks, which scripting keeps in the graph."""

    def __init__(self, width=64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            with torch.no_grad():
                x = x * self.scale
        return x


# ---- a Llama-style decoder ----


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim))

    @torch.no_grad()
    def forward(self, x):
        t = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # In the activations' dtype, as Hugging Face models do, so the model also runs in bf16.
        return emb.cos().type_as(x), emb.sin().type_as(x)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, c))


class GatedMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.post_norm = RMSNorm(dim)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, hidden=128, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim // heads)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, input_ids):
        h = self.embed(input_ids)
        cos, sin = self.rotary(h)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


# ---- control flow and values of every kind crossing the cuts (scripted) ----


class ControlFlow(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.lin0 = nn.Linear(width, width)
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x):
        x = self.lin0(x)
        # A branch decided at run time, but not by the batch: micro-batches must agree on it.
        if bool(self.lin0.weight.sum() > 0):
            x = x * 2.0
        else:
            x = x - 1.0
        pipe_split()
        for _ in range(3):
            x = torch.relu(self.lin1(x)) + x
        pipe_split()
        return self.lin2(x)


class CrossingValues(nn.Module):
    """Sends an int, a float, a bool, a tuple, a list and None across the cut; returns a dict."""

    def __init__(self, width=32):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x) -> Dict[str, Tensor]:
        h = self.lin(x)
        n: int = h.size(1)
        scale: float = float(h.size(1)) / 64.0
        flag: bool = bool(h.size(1) > 1)
        pair: Tuple[Tensor, Tensor] = (h, h * 2.0)
        items: List[Tensor] = [h, h + 1.0]
        nothing: Optional[Tensor] = h if n < 0 else None
        pipe_split()
        y = self.out(pair[0] + pair[1] + items[1] * scale)
        if flag and nothing is None:
            y = y + float(n)
        return {"mixed": y, "first": items[0]}


class DeviceConstant(nn.Module):
    """Tracing bakes device="cpu" into the graph as a Device constant."""

    def __init__(self, width=16):
        super().__init__()
        self.lin0 = nn.Linear(width, width)
        self.lin1 = nn.Linear(width, width)

    def forward(self, x):
        x = self.lin0(x)
        pipe_split()
        return self.lin1(x) + torch.ones(x.shape, device="cpu")


class NestedContainers(nn.Module):
    """Sequential inside Sequential, and ModuleDict children: paths like stack.1.0 and heads.a."""

    def __init__(self, width=16):
        super().__init__()
        self.stack = nn.Sequential(nn.Linear(width, width), nn.Sequential(nn.Linear(width, width), nn.ReLU()))
        self.heads = nn.ModuleDict({"a": nn.Linear(width, width), "b": nn.Linear(width, width)})

    def forward(self, x):
        x = self.stack(x)
        x = self.heads["a"](x)
        return self.heads["b"](x)


# ---- state: buffers updated in place (the pattern of a KV cache) ----


class Store(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("cache", torch.zeros(4, width), persistent=False)
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, x):
        h = self.proj(x)
        self.cache.narrow(0, 0, h.shape[0]).copy_(h)  # written through a view
        self.calls.add_(1)  # written directly
        return h


class StateAcrossCut(nn.Module):
    """`store` writes its buffers in place; the root reads `store.cache` after `head`. A cut between
    the write and the read (head:begin, head:end) must be refused: each stage would hold its own
    copy. A cut inside store before the write (store.proj:end) keeps the state in one stage."""

    def __init__(self, width=8):
        super().__init__()
        self.store = Store(width)
        self.head = nn.Linear(width, width)

    def forward(self, x):
        h = self.head(self.store(x))
        return h + self.store.cache.narrow(0, 0, h.shape[0]) + self.store.calls


# ---- models that must be refused ----


class CallInsideBranch(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.lin0 = nn.Linear(width, width)
        self.lin1 = nn.Linear(width, width)

    def forward(self, x):
        x = self.lin0(x)
        if bool(x.sum() > 0):
            x = self.lin1(x)
        return x


class InsideAutocast(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.lin0 = nn.Linear(width, width)
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x):
        x = self.lin0(x)
        with torch.autocast("cpu", enabled=False):
            x = self.lin1(x)
            x = self.lin2(x)
        return x


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    class GPT2Logits(GPT2LMHeadModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    cfg = GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2Logits(cfg)


def tiny_causal_lm(config_class, model_class, **overrides):
    """A tiny random-weight Hugging Face causal LM (2 layers, hidden 64, 4 heads / 2 KV heads, vocab
    256) whose forward takes input_ids and returns the logits only (no cache)."""

    class Logits(model_class):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    Logits.__name__ = Logits.__qualname__ = model_class.__name__.replace("ForCausalLM", "Logits")
    cfg = config_class(
        **{
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
            **overrides,
        }
    )
    return Logits(cfg)


def hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny_causal_lm(LlamaConfig, LlamaForCausalLM, **overrides)


def resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=16)


def tokens():
    return {"input_ids": torch.randint(0, 256, (4, 12))}


# name -> (builder, form, inputs)
MODELS = {
    "nograd_layers": (NoGradLayers, "traced", lambda: {"x": torch.randn(8, 64)}),
    "nograd_scripted": (ScriptedNoGrad, "scripted", lambda: {"x": torch.randn(8, 64)}),
    "tiny_llama": (TinyLlama, "traced", tokens),
    "control_flow": (ControlFlow, "scripted", lambda: {"x": torch.randn(8, 32)}),
    "crossing_values": (CrossingValues, "scripted", lambda: {"x": torch.randn(8, 32)}),
    "nested_traced": (NestedContainers, "traced", lambda: {"x": torch.randn(4, 16)}),
    "nested_scripted": (NestedContainers, "scripted", lambda: {"x": torch.randn(4, 16)}),
    "device_constant": (DeviceConstant, "traced", lambda: {"x": torch.randn(4, 16)}),
    "state_across_cut": (StateAcrossCut, "scripted", lambda: {"x": torch.randn(4, 8)}),
    "call_inside_branch": (CallInsideBranch, "scripted", lambda: {"x": torch.randn(4, 32)}),
    "inside_autocast": (InsideAutocast, "scripted", lambda: {"x": torch.randn(4, 32)}),
    "resnet18": (resnet18, "traced", lambda: {"x": torch.randn(4, 3, 64, 64)}),
    "gpt2": (hf_gpt2, "traced", tokens),
    "hf_llama": (hf_llama, "traced", tokens),
}


def flatten(value, prefix="output"):
    if isinstance(value, Tensor):
        return {prefix: value.contiguous()}
    if isinstance(value, dict):
        items = value.items()
    else:
        items = enumerate(value)
    out = {}
    for key, v in items:
        out.update(flatten(v, f"{prefix}.{key}"))
    return out


def generate(out_dir, only=None):
    os.makedirs(out_dir, exist_ok=True)
    for name, (build, form, make_inputs) in MODELS.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = build().eval()
        inputs = make_inputs()
        with torch.no_grad():
            expected = model(**inputs)
        ts = torch.jit.script(model) if form == "scripted" else torch.jit.trace(model, tuple(inputs.values()))
        ts.save(os.path.join(out_dir, f"{name}.pt"))
        save_file(inputs, os.path.join(out_dir, f"{name}.inputs.safetensors"))
        save_file(flatten(expected), os.path.join(out_dir, f"{name}.expected.safetensors"))
        # The state_dict of the TorchScript model libpipe receives: TorchScript keeps no record of
        # which buffers were non-persistent (HF Llama's rotary inv_freq), so it lists them too.
        with open(os.path.join(out_dir, f"{name}.state_dict.txt"), "w") as f:
            f.write("\n".join(ts.state_dict().keys()) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: split_models.py OUT_DIR [NAME...]")
    generate(sys.argv[1], set(sys.argv[2:]))
