"""The Llama family (Llama, Mistral, Qwen2) under the decoder contract: RMSNorm, the rotary embedding,
the SwiGLU MLP, attention over the layer's caches, the layer, the model and its root DecoderLM, and
what a config decides for them (rope type and frequencies, sliding windows)."""

import math
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

# A scripted method resolves the functions it calls among its own module's globals: the cache
# helpers the layers call are imported here by name.
from .cache import attend_cache, attend_packed, check_call, new_cache, pack_call, write_cache, write_packed

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: statistics in float32, the weight applied in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float, weights):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, **weights), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, as Hugging Face's rotary embedding computes them."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.unsqueeze(-1).to(torch.float32) * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, weights):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, **weights)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, **weights)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, **weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Self-attention over the slot's cache; owns k_cache and v_cache and updates them in place."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        sliding_window: int,
        slots: int,
        max_len: int,
        weights,
        placeholder_caches: bool = False,
        cache_dtype=None,
    ):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window  # 0: none
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias, **weights)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, **weights)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, **weights)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, **weights)
        shape = (slots, kv_heads, max_len, head_dim)
        cache_dtype = cache_dtype or weights["dtype"]
        self.register_buffer("k_cache", new_cache(shape, cache_dtype, placeholder_caches), persistent=False)
        self.register_buffer("v_cache", new_cache(shape, cache_dtype, placeholder_caches), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        end: torch.Tensor,
        slots: torch.Tensor,
        at: torch.Tensor,
        where: torch.Tensor,
        single: torch.Tensor,
        single_at: torch.Tensor,
        multi: torch.Tensor,
        multi_flat: torch.Tensor,
        multi_src: torch.Tensor,
        single_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x is [N, hidden], the call's valid tokens packed (pack_call gives at .. single_mask), or
        under torch.export [B, T, hidden] with padding (at .. single_mask unused)."""
        if not torch.jit.is_scripting():
            if torch.compiler.is_exporting():
                return self.padded(x, cos, sin, positions, valid, end, slots)
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        c = cos.unsqueeze(1)
        s = sin.unsqueeze(1)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        write_packed(self.k_cache, self.v_cache, k, v, at, where)
        out = attend_packed(
            self.k_cache,
            self.v_cache,
            q,
            positions,
            valid,
            end,
            slots,
            single,
            single_at,
            multi,
            multi_flat,
            multi_src,
            single_mask,
            self.sliding_window,
            self.scale,
        )
        return self.o_proj(out)

    @torch.jit.unused
    def padded(self, x, cos, sin, positions, valid, end, slots):
        """The forward under torch.export: padded rows, writes without a data-dependent shape."""
        b, t = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        c = cos.unsqueeze(1)
        s = sin.unsqueeze(1)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        write_cache(self.k_cache, self.v_cache, k, v, positions, valid, slots)
        out = attend_cache(self.k_cache, self.v_cache, q, positions, valid, end, slots, self.sliding_window, self.scale)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, attention: Attention, mlp: MLP, hidden: int, eps: float, weights):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, weights)
        self.post_attention_layernorm = RMSNorm(hidden, eps, weights)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        end: torch.Tensor,
        slots: torch.Tensor,
        at: torch.Tensor,
        where: torch.Tensor,
        single: torch.Tensor,
        single_at: torch.Tensor,
        multi: torch.Tensor,
        multi_flat: torch.Tensor,
        multi_src: torch.Tensor,
        single_mask: torch.Tensor,
    ) -> torch.Tensor:
        a = self.self_attn(
            self.input_layernorm(h),
            cos,
            sin,
            positions,
            valid,
            end,
            slots,
            at,
            where,
            single,
            single_at,
            multi,
            multi_flat,
            multi_src,
            single_mask,
        )
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Hugging Face's `model` submodule: embedding, layers, final norm, rotary frequencies."""

    def __init__(
        self, layers: List[DecoderLayer], vocab: int, hidden: int, eps: float, rotary: RotaryEmbedding, weights
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, **weights)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, weights)
        self.rotary_emb = rotary


class DecoderLM(nn.Module):
    """The root: forward follows the decoder contract (see libpipe.decoders' docstring)."""

    def __init__(self, model: DecoderModel, vocab: int, hidden: int, tied: bool, slots: int, max_len: int, weights):
        super().__init__()
        self.model = model
        self.lm_head = nn.Linear(hidden, vocab, bias=False, **weights)
        if tied:
            self.lm_head.weight = model.embed_tokens.weight
        self.lm_head.weight.requires_grad_(False)
        self.vocab = vocab
        self.num_slots = slots
        self.max_len = max_len
        self.skips_padding = True  # the contract's optional flag: a call costs its valid tokens, not B x T

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        valid, positions, end = check_call(tokens, start, lengths, slots, self.max_len, self.num_slots, self.vocab)
        if not torch.jit.is_scripting():
            if torch.compiler.is_exporting():
                return self.padded(tokens, lengths, slots, valid, positions, end)
        # Only the valid tokens are computed (skips_padding): [N, hidden] through every layer.
        flat, at, where, single, single_at, multi, multi_flat, multi_src, single_mask = pack_call(
            valid, positions, lengths, slots, end
        )
        h = self.model.embed_tokens(tokens.flatten().index_select(0, flat))
        cos, sin = self.model.rotary_emb(at, h.dtype)
        for layer in self.model.layers:
            h = layer(
                h,
                cos,
                sin,
                positions,
                valid,
                end,
                slots,
                at,
                where,
                single,
                single_at,
                multi,
                multi_flat,
                multi_src,
                single_mask,
            )
        last = h.index_select(0, lengths.cumsum(0) - 1)  # each row's last token
        return self.lm_head(self.model.norm(last)).to(torch.float32)

    @torch.jit.unused
    def padded(self, tokens, lengths, slots, valid, positions, end):
        """The forward under torch.export: rows padded to T throughout (no data-dependent shape)."""
        h = self.model.embed_tokens(torch.where(valid, tokens, torch.zeros_like(tokens)))
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        unused = torch.empty(0, dtype=torch.int64, device=tokens.device)
        for layer in self.model.layers:
            h = layer(h, cos, sin, positions, valid, end, slots, *([unused] * 8))
        # Row count from h, not from `b`: an int would cross to the last stage, where only tensors must.
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return self.lm_head(self.model.norm(last)).to(torch.float32)


def _rope_parameters(config):
    """(theta, type, parameters) from a config: transformers 5 writes `rope_parameters`, earlier
    versions `rope_theta` and `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), rope_type, params


def rotary_inv_freq(config, head_dim):
    """inv_freq and the attention scaling, computed with the same float32 operations as
    transformers' ROPE_INIT_FUNCTIONS for the supported rope types."""
    theta, rope_type, params = _rope_parameters(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "its positions would not match the model's"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq, 1.0


def _sliding_windows(config, model_type, layers):
    """The sliding window of each layer (0: full attention), as transformers decides it."""
    window = config.get("sliding_window")
    if model_type == "mistral":
        return [int(window or 0)] * layers
    if model_type == "qwen2":
        if not config.get("use_sliding_window", False) or not window:
            return [0] * layers
        types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention" for i in range(layers)
        ]
        return [int(window) if kind == "sliding_attention" else 0 for kind in types]
    return [0] * layers
