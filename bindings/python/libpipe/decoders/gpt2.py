"""GPT-2 under the decoder contract: Conv1D, attention with its fused projection over the layer's
caches, the MLP, the block, the `transformer` model and its root GPT2LM, and build_gpt2 from a config."""

import math
from typing import List

import torch
from torch import nn

# A scripted method resolves the functions it calls among its own module's globals: the cache
# helpers the layers call are imported here by name.
from .cache import attend_cache, attend_packed, check_call, new_cache, pack_call, write_cache, write_packed


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 Conv1D: a linear layer whose weight is stored [in, out]."""

    def __init__(self, out_features: int, in_features: int, weights):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, **weights), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **weights), requires_grad=False)
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(list(x.shape[:-1]) + [self.out_features])


class GPT2Attention(nn.Module):
    """GPT-2's attention (fused q/k/v projection c_attn, output c_proj) over the slot's cache."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        scale: float,
        slots: int,
        max_len: int,
        weights,
        placeholder_caches: bool = False,
        cache_dtype=None,
    ):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.hidden = hidden
        self.scale = scale
        self.c_attn = Conv1D(3 * hidden, hidden, weights)
        self.c_proj = Conv1D(hidden, hidden, weights)
        shape = (slots, heads, max_len, self.head_dim)
        cache_dtype = cache_dtype or weights["dtype"]
        self.register_buffer("k_cache", new_cache(shape, cache_dtype, placeholder_caches), persistent=False)
        self.register_buffer("v_cache", new_cache(shape, cache_dtype, placeholder_caches), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
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
        """As llama.Attention.forward: x packed [N, hidden], or padded [B, T, hidden] under torch.export."""
        if not torch.jit.is_scripting():
            if torch.compiler.is_exporting():
                return self.padded(x, positions, valid, end, slots)
        n = x.shape[0]
        q, k, v = self.c_attn(x).split(self.hidden, dim=1)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.heads, self.head_dim)
        v = v.view(n, self.heads, self.head_dim)
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
            0,
            self.scale,
        )
        return self.c_proj(out)

    @torch.jit.unused
    def padded(self, x, positions, valid, end, slots):
        """The forward under torch.export (padded rows)."""
        b, t = x.shape[0], x.shape[1]
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        write_cache(self.k_cache, self.v_cache, k, v, positions, valid, slots)
        return self.c_proj(attend_cache(self.k_cache, self.v_cache, q, positions, valid, end, slots, 0, self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, weights):
        super().__init__()
        self.c_fc = Conv1D(inner, hidden, weights)
        self.c_proj = Conv1D(hidden, inner, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        # gelu_new as transformers writes it (not F.gelu's tanh kernel, which rounds differently).
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.c_proj(h)


class GPT2Block(nn.Module):
    def __init__(self, attention: GPT2Attention, mlp: GPT2MLP, hidden: int, eps: float, weights):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps, **weights)
        self.attn = attention
        self.ln_2 = nn.LayerNorm(hidden, eps=eps, **weights)
        self.mlp = mlp

    def forward(
        self,
        h: torch.Tensor,
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
        a = self.attn(
            self.ln_1(h),
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
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    """Hugging Face's `transformer` submodule: token and position embeddings, blocks, final norm."""

    def __init__(self, blocks: List[GPT2Block], vocab: int, positions: int, hidden: int, eps: float, weights):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden, **weights)
        self.wpe = nn.Embedding(positions, hidden, **weights)
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(hidden, eps=eps, **weights)


class GPT2LM(nn.Module):
    """GPT-2 under the decoder contract; the head is always the token embedding (tied)."""

    def __init__(self, transformer: GPT2Model, vocab: int, hidden: int, slots: int, max_len: int, weights):
        super().__init__()
        self.transformer = transformer
        self.lm_head = nn.Linear(hidden, vocab, bias=False, **weights)
        self.lm_head.weight = transformer.wte.weight
        self.vocab = vocab
        self.num_slots = slots
        self.max_len = max_len
        self.skips_padding = True  # the contract's optional flag: a call costs its valid tokens, not B x T

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        valid, positions, end = check_call(tokens, start, lengths, slots, self.max_len, self.num_slots, self.vocab)
        if not torch.jit.is_scripting():
            if torch.compiler.is_exporting():
                return self.padded(tokens, lengths, slots, valid, positions, end)
        flat, at, where, single, single_at, multi, multi_flat, multi_src, single_mask = pack_call(
            valid, positions, lengths, slots, end
        )
        h = self.transformer.wte(tokens.flatten().index_select(0, flat)) + self.transformer.wpe(at)
        for block in self.transformer.h:
            h = block(
                h, positions, valid, end, slots, at, where, single, single_at, multi, multi_flat, multi_src, single_mask
            )
        last = h.index_select(0, lengths.cumsum(0) - 1)
        return self.lm_head(self.transformer.ln_f(last)).to(torch.float32)

    @torch.jit.unused
    def padded(self, tokens, lengths, slots, valid, positions, end):
        """The forward under torch.export: rows padded to T throughout."""
        zero = torch.zeros_like(tokens)
        # Padding positions may lie past the position table: they look up position 0 instead.
        h = self.transformer.wte(torch.where(valid, tokens, zero)) + self.transformer.wpe(
            torch.where(valid, positions, zero)
        )
        unused = torch.empty(0, dtype=torch.int64, device=tokens.device)
        for block in self.transformer.h:
            h = block(h, positions, valid, end, slots, *([unused] * 8))
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return self.lm_head(self.transformer.ln_f(last)).to(torch.float32)


def build_gpt2(config, max_len, slots, weights, placeholder_caches=False, cache_dtype=None):
    """GPT2LM for a GPT-2 config.json (GPT2LMHeadModel's names: transformer.h.N.attn.c_attn, ...)."""
    if config.get("add_cross_attention"):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention) is not a decoder-only model")
    act = config.get("activation_function", "gelu_new")
    if act != "gelu_new":
        raise ValueError(f"activation_function {act!r} is not supported for gpt2 (only 'gelu_new')")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("scale_attn_by_inverse_layer_idx is not supported")
    hidden = config.get("n_embd") or config["hidden_size"]
    heads = config.get("n_head") or config["num_attention_heads"]
    layers = config.get("n_layer") or config["num_hidden_layers"]
    positions = config.get("n_positions") or config["max_position_embeddings"]
    if max_len > positions:
        raise ValueError(f"max_len {max_len} exceeds GPT-2's position table (n_positions = {positions})")
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    inner = config.get("n_inner") or 4 * hidden
    scale = (hidden // heads) ** -0.5 if config.get("scale_attn_weights", True) else 1.0
    vocab = config["vocab_size"]
    blocks = [
        GPT2Block(
            GPT2Attention(hidden, heads, scale, slots, max_len, weights, placeholder_caches, cache_dtype),
            GPT2MLP(hidden, inner, weights),
            hidden,
            eps,
            weights,
        )
        for _ in range(layers)
    ]
    return GPT2LM(GPT2Model(blocks, vocab, positions, hidden, eps, weights), vocab, hidden, slots, max_len, weights)
