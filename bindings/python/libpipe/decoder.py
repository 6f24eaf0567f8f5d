"""The decoder contract: a TorchScript causal language model that libpipe drives step by step.

A decoder is a TorchScript module whose forward is

    forward(tokens: int64[B, T], start: int64[B], lengths: int64[B], slots: int64[B]) -> float32[B, vocab]

Row b of a call carries `lengths[b]` (1 .. T) new tokens of one sequence, right-padded to T (the
padding's values are ignored), at positions `start[b]` .. `start[b] + lengths[b] - 1` of that
sequence, whose keys and values live in KV-cache slot `slots[b]`. The result is the logits of
each row's last valid token, in float32 whatever the model's dtype (they are all sampling
needs; no [B, T, vocab] tensor is made). So:

- prefill of a whole prompt is one row with start = 0, lengths = len(prompt); a long prompt may
  be prefilled in chunks (start = tokens already in the cache); a decode step is a row with
  lengths = 1 (T = 1 when every row decodes). Rows of different kinds share a call.
- Rows are independent: a call may be cut into micro-batches along B, in any grouping.
- Within a call, no two rows may name the same slot (checked per micro-batch).

Caches. Every attention layer owns two buffers, `k_cache` and `v_cache`, of shape
[slots, kv_heads, max_len, head_dim] in the model's dtype, registered as non-persistent buffers
(no checkpoint stores them). A skeleton stores each as a zero-stride placeholder
(torch.zeros((), dtype).expand(shape): a few bytes in the file), and libpipe makes the caches
when it builds a stage: every parameter or buffer that a stage's forward updates in place (an
operator that writes its argument, such as index_put_ or copy_, applied to the tensor or to a
view of it) is the stage's own, so that sessions made from one model never share one, and a
placeholder of them (a tensor that covers more elements than it stores) becomes fresh
contiguous zeros (its value) on the stage's device, in the stage's dtype (--dtype converts it
like any floating buffer). A plan that would use such a tensor in two stages is refused
(PIPE_ERR_SPLIT), so each layer's caches live in the stage of its layer; over several
processes a worker receives the placeholder and allocates the caches itself. An eager call or
a libpipe older than this refuses to write into a placeholder (ValueError below), never taking
the writes silently. The forward writes the keys and values of the valid tokens of
each row at positions start .. start+lengths-1 of its slot, in place (padding never writes),
and attends over positions 0 .. start+lengths-1 of the slot with a causal mask (and a sliding
window where the model has one). What a slot holds at positions >= start is overwritten by
the call, so a slot is reused for a new sequence simply by prefilling it from start = 0;
nothing needs clearing. The caller owns the bookkeeping: which slot a sequence uses and how
many of its tokens are cached (start of the next call).

Errors are raised by the module (TorchScript `raise`, an ExecutionError through libpipe) for:
lengths outside 1..T, start < 0, start + lengths > max_len, a slot outside 0..slots-1, two rows
with one slot, a valid token outside 0..vocab-1.

The same modules export with torch.export (export_decoder; `export_llm OUT.pt2`), B and T dynamic
from 1: under export, the checks above are aten._assert_async nodes of the program, which raise the
same messages when it runs (on the CPU), each layer narrows its cache to max(start + lengths) read
with aten.item (an unbacked size in 1 .. max_len), and the cache writes have no data-dependent
shape (every token of a row writes, padding as a copy of the row's last valid token). TorchScript
never compiles those branches: the scripted module is the same as without them.

Costs per call and layer: padding is never computed (the root's `skips_padding = True`, the
contract's optional flag, tells libpipe so): the call's valid tokens are packed into [N, hidden]
(pack_call) for the embedding, every linear layer, norm and rotary embedding, and each token's
keys and values are written at its slot and position; for attention, rows of one token (decode
rows) attend as single queries and the other rows in their padded layout [rows, T] (attend_packed),
so a decode row beside a prompt chunk costs one query. libpipe's generator then puts decode rows
and prompt chunks in one call. The cache is read narrowed to the longest context of the rows
(max(start + lengths), read on the host: one device synchronisation per attention call on a GPU)
and gathered for their slots, a copy of rows x kv_heads x context x head_dim, unless libpipe's
cache attention (CPU) reads it in place. Under torch.export the rows stay padded to T throughout
(no data-dependent shape), and the exported program has no such flag.

Module tree and parameter names are Hugging Face's (model.embed_tokens, model.layers.N.self_attn.
q_proj, ..., model.norm, lm_head; GPT-2: transformer.wte, transformer.h.N.attn.c_attn, ...,
transformer.ln_f), so a Hugging Face checkpoint loads by name; the layers are `model.layers.K`
(GPT-2: `transformer.h.K`), which libpipe cuts between (`--split-at model.layers.K:begin`, or
--stages N). A tied head (`tie_word_embeddings`, always for GPT-2) is the embedding's own tensor.
Rotary frequencies are the non-persistent buffer `model.rotary_emb.inv_freq`, computed as Hugging
Face computes them.

`libpipe.export_llm` builds these from a Hugging Face config.json; build_decoder() here builds one
from a config dict.
"""

import math
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")
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


def new_cache(shape, dtype: torch.dtype, placeholder: bool) -> torch.Tensor:
    """Zeros of `shape`: allocated, or a placeholder (one zero seen through zero strides: a few
    bytes in a saved file), which libpipe allocates in the stage that writes it."""
    return torch.zeros((), dtype=dtype).expand(shape) if placeholder else torch.zeros(shape, dtype=dtype)


def write_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
):
    """Writes the valid tokens' keys and values ([B, kv_heads, T, head_dim]) into the caches, in
    place; padding never clobbers a slot."""
    # A cache stored as a zero-stride placeholder (one element seen through every index) would
    # take the writes without an error and return garbage: it must be allocated before use.
    if k_cache.stride(0) == 0 or v_cache.stride(0) == 0:
        raise ValueError("decoder: k_cache/v_cache is a zero-stride placeholder, not an allocated cache")
    if not torch.jit.is_scripting():
        if torch.compiler.is_exporting():
            _write_cache_exported(k_cache, v_cache, k, v, positions, valid, slots)
            return
    rows, cols = valid.nonzero().unbind(1)
    where = slots[rows]
    at = positions[rows, cols]
    k_cache[where, :, at] = k.transpose(1, 2)[rows, cols].to(k_cache.dtype)
    v_cache[where, :, at] = v.transpose(1, 2)[rows, cols].to(v_cache.dtype)


def _write_cache_exported(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    slots: torch.Tensor,
):
    """write_cache under torch.export: the same writes with no data-dependent shape (the valid
    tokens' nonzero() is one). Every token of a row writes, a padding token in place of the row's
    last valid one with that token's keys and values, so that the duplicate writes of one cache
    entry all carry the same data and none can clobber it, whatever their order."""
    t = valid.shape[1]
    last = valid.sum(1, keepdim=True) - 1  # the last valid column of each row [B, 1]
    cols = torch.minimum(torch.arange(t, device=valid.device).unsqueeze(0), last)  # [B, T]
    at = positions.gather(1, cols)
    where = slots.unsqueeze(1).expand_as(cols)
    pick = cols.unsqueeze(-1).unsqueeze(-1)
    keys = k.transpose(1, 2)  # [B, T, kv_heads, head_dim]
    values = v.transpose(1, 2)
    k_cache[where, :, at] = keys.gather(1, pick.expand_as(keys)).to(k_cache.dtype)
    v_cache[where, :, at] = values.gather(1, pick.expand_as(values)).to(v_cache.dtype)


def attend_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    end: torch.Tensor,
    slots: torch.Tensor,
    sliding_window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of q [B, heads, T, head_dim] over the rows' slots, causal (and within the sliding
    window when it is > 0). Returns [B, T, heads * head_dim]."""
    # Only the longest context in the call is read and gathered, never the whole cache.
    if torch.jit.is_scripting():
        context = int(end.max())
    else:
        context = _context(end, k_cache.shape[2])
    # A cache in another dtype than the model's (export_llm --cache-dtype) is read in the model's: a no-op otherwise.
    keys = k_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    values = v_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    kpos = torch.arange(context, device=q.device)
    qpos = positions.unsqueeze(-1)
    allowed = kpos <= qpos
    if sliding_window > 0:
        allowed = allowed & (kpos > qpos - sliding_window)
    # Padding rows may see anything (their results are never used); never an all-masked row,
    # whose softmax would be NaN.
    allowed = (allowed | ~valid.unsqueeze(-1)).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed, dropout_p=0.0, is_causal=False, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(2)


def pack_call(valid: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
    """Where the valid tokens of a call go once packed ([N] rows, row b's tokens at
    first[b] .. first[b] + lengths[b] - 1, in row order). Returns (flat, at, where, single,
    single_at, multi, multi_flat, multi_src):
    flat [N] each packed token's index in the padded B x T; at [N] its position and where [N]
    its slot (the cache entry it writes); single [Bs] the rows of one token and single_at [Bs]
    that token's packed index; multi [Bm] the other rows, whose queries attend in their padded
    layout [Bm, T]: multi_flat the valid tokens' indices in Bm x T, multi_src their packed ones."""
    t = valid.shape[1]
    first = lengths.cumsum(0) - lengths
    flat = valid.flatten().nonzero().squeeze(1)
    at = positions.flatten().index_select(0, flat)
    where = slots.index_select(0, torch.div(flat, t, rounding_mode="floor"))
    single = (lengths == 1).nonzero().squeeze(1)
    multi = (lengths > 1).nonzero().squeeze(1)
    multi_flat = valid.index_select(0, multi).flatten().nonzero().squeeze(1)
    offsets = torch.arange(t, device=valid.device)
    multi_src = (first.index_select(0, multi).unsqueeze(1) + offsets.unsqueeze(0)).flatten().index_select(0, multi_flat)
    return flat, at, where, single, first.index_select(0, single), multi, multi_flat, multi_src


def attend_packed(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    end: torch.Tensor,
    slots: torch.Tensor,
    single: torch.Tensor,
    single_at: torch.Tensor,
    multi: torch.Tensor,
    multi_flat: torch.Tensor,
    multi_src: torch.Tensor,
    sliding_window: int,
    scale: float,
) -> torch.Tensor:
    """attend_cache for packed queries q [N, heads, head_dim] (pack_call): rows of one token
    attend as [Bs, heads, 1, head_dim], the others in their padded layout, so that a decode row
    beside a prompt chunk costs one query, not T. Returns [N, heads * head_dim]."""
    n, heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    t = valid.shape[1]
    if multi.shape[0] == 0 and single.shape[0] == n:  # every row one token (a decode step): q is in row order
        out = attend_cache(
            k_cache, v_cache, q.unsqueeze(2), positions[:, :1], valid[:, :1], end, slots, sliding_window, scale
        )
        return out.view(n, heads * head_dim)
    out = q.new_empty(n, heads * head_dim)
    if single.shape[0] > 0:
        one = attend_cache(
            k_cache,
            v_cache,
            q.index_select(0, single_at).unsqueeze(2),
            positions.index_select(0, single)[:, :1],
            valid.index_select(0, single)[:, :1],
            end.index_select(0, single),
            slots.index_select(0, single),
            sliding_window,
            scale,
        )
        out.index_copy_(0, single_at, one.flatten(0, 1))
    if multi.shape[0] > 0:
        b = multi.shape[0]
        padded = q.new_zeros(b * t, heads, head_dim).index_copy_(0, multi_flat, q.index_select(0, multi_src))
        chunks = attend_cache(
            k_cache,
            v_cache,
            padded.view(b, t, heads, head_dim).transpose(1, 2),
            positions.index_select(0, multi),
            valid.index_select(0, multi),
            end.index_select(0, multi),
            slots.index_select(0, multi),
            sliding_window,
            scale,
        )
        out.index_copy_(0, multi_src, chunks.flatten(0, 1).index_select(0, multi_flat))
    return out


def write_packed(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at, where):
    """Writes packed keys and values [N, kv_heads, head_dim] at their slots and positions, in place."""
    if k_cache.stride(0) == 0 or v_cache.stride(0) == 0:
        raise ValueError("decoder: k_cache/v_cache is a zero-stride placeholder, not an allocated cache")
    k_cache[where, :, at] = k.to(k_cache.dtype)
    v_cache[where, :, at] = v.to(v_cache.dtype)


def _context(end: torch.Tensor, max_len: int) -> int:
    """max(end) read on the host; under torch.export an unbacked size in 1 .. max_len (check_call
    has refused calls outside it with its own message before any layer reads it)."""
    if not torch.compiler.is_exporting():
        return int(end.max())
    context = end.max().item()
    torch._check(context >= 1)
    torch._check(context <= max_len)
    return context


def check_call(
    tokens: torch.Tensor,
    start: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    num_slots: int,
    vocab: int,
):
    """Refuses a call that breaks the contract; returns (valid [B, T], positions [B, T], end [B])."""
    if not torch.jit.is_scripting():
        if torch.compiler.is_exporting():
            return _check_call_exported(tokens, start, lengths, slots, max_len, num_slots, vocab)
    b, t = tokens.shape[0], tokens.shape[1]
    if tokens.dim() != 2 or start.dim() != 1 or lengths.dim() != 1 or slots.dim() != 1:
        raise ValueError("decoder: tokens must be [B, T] and start, lengths and slots 1-d [B]")
    if start.shape[0] != b or lengths.shape[0] != b or slots.shape[0] != b:
        raise ValueError("decoder: start, lengths and slots must each have one entry per row of tokens [B, T]")
    if bool((lengths < 1).any()) or bool((lengths > t).any()):
        raise ValueError("decoder: every row needs 1 <= lengths <= T (the width of tokens)")
    end = start + lengths
    if bool((start < 0).any()):
        raise ValueError("decoder: start must be >= 0")
    if bool((end > max_len).any()):
        raise ValueError(
            "decoder: start + lengths exceeds the maximum sequence length the caches were made for "
            "(export_llm --max-seq-len)"
        )
    if bool((slots < 0).any()) or bool((slots >= num_slots).any()):
        raise ValueError("decoder: a slot is outside 0 .. slots-1 (export_llm --max-batch sets the slots)")
    if b > 1 and bool((slots.sort()[0].diff() == 0).any()):
        raise ValueError("decoder: two rows of one call name the same cache slot")
    offsets = torch.arange(t, device=tokens.device)
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)
    if bool(((tokens < 0) | (tokens >= vocab)).logical_and(valid).any()):
        raise ValueError("decoder: a token id is outside the vocabulary (0 .. vocab_size-1)")
    return valid, start.unsqueeze(1) + offsets.unsqueeze(0), end


def _check_call_exported(
    tokens: torch.Tensor,
    start: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    num_slots: int,
    vocab: int,
):
    """check_call under torch.export: the same checks, in the same order and with the same
    messages, as aten._assert_async nodes of the program (a data-dependent `if` cannot be
    exported), which raise them when the program runs. The ranks and the rows of the arguments are
    the program's input shapes. Nothing here depends on B or T being above 1, so that both stay
    dynamic with min 1 (a decode step is T = 1, a micro-batch may be one row)."""
    t = tokens.shape[1]
    torch._assert_async(
        ((lengths >= 1) & (lengths <= t)).all(), "decoder: every row needs 1 <= lengths <= T (the width of tokens)"
    )
    end = start + lengths
    torch._assert_async((start >= 0).all(), "decoder: start must be >= 0")
    torch._assert_async(
        (end <= max_len).all(),
        "decoder: start + lengths exceeds the maximum sequence length the caches were made for "
        "(export_llm --max-seq-len)",
    )
    torch._assert_async(
        ((slots >= 0) & (slots < num_slots)).all(),
        "decoder: a slot is outside 0 .. slots-1 (export_llm --max-batch sets the slots)",
    )
    # Each row's slot against every row's ([B, B], B <= slots): a sorted slots[1:] != slots[:-1]
    # would make export guard on B (and specialize it).
    same = slots.unsqueeze(0) == slots.unsqueeze(1)
    torch._assert_async((same.sum(1) == 1).all(), "decoder: two rows of one call name the same cache slot")
    offsets = torch.arange(t, device=tokens.device)
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)
    torch._assert_async(
        ~((tokens < 0) | (tokens >= vocab)).logical_and(valid).any(),
        "decoder: a token id is outside the vocabulary (0 .. vocab_size-1)",
    )
    return valid, start.unsqueeze(1) + offsets.unsqueeze(0), end


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
    ) -> torch.Tensor:
        """x is [N, hidden], the call's valid tokens packed (pack_call gives at .. multi_src), or
        under torch.export [B, T, hidden] with padding (at .. multi_src unused)."""
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
    """The root: forward follows the decoder contract (see the module docstring)."""

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
        flat, at, where, single, single_at, multi, multi_flat, multi_src = pack_call(valid, positions, lengths, slots)
        h = self.model.embed_tokens(tokens.flatten().index_select(0, flat))
        cos, sin = self.model.rotary_emb(at, h.dtype)
        for layer in self.model.layers:
            h = layer(
                h, cos, sin, positions, valid, end, slots, at, where, single, single_at, multi, multi_flat, multi_src
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
            h = layer(h, cos, sin, positions, valid, end, slots, *([unused] * 7))
        # Row count from h, not from `b`: an int would cross to the last stage, where only tensors must.
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return self.lm_head(self.model.norm(last)).to(torch.float32)


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
    ) -> torch.Tensor:
        """As Attention.forward: x packed [N, hidden], or padded [B, T, hidden] under torch.export."""
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
    ) -> torch.Tensor:
        a = self.attn(
            self.ln_1(h), positions, valid, end, slots, at, where, single, single_at, multi, multi_flat, multi_src
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
        flat, at, where, single, single_at, multi, multi_flat, multi_src = pack_call(valid, positions, lengths, slots)
        h = self.transformer.wte(tokens.flatten().index_select(0, flat)) + self.transformer.wpe(at)
        for block in self.transformer.h:
            h = block(h, positions, valid, end, slots, at, where, single, single_at, multi, multi_flat, multi_src)
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
            h = block(h, positions, valid, end, slots, *([unused] * 7))
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


_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def config_dtype(config):
    """The dtype the checkpoint was saved in (config's `dtype`, or `torch_dtype` before
    transformers 5), float32 if it says nothing."""
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)


def build_decoder(
    config, max_len, slots, dtype=torch.float32, weights_device="cpu", placeholder_caches=False, cache_dtype=None
):
    """An eager DecoderLM for a Hugging Face config dict (config.json), with caches of
    [slots, kv_heads, max_len, head_dim] per attention layer. ValueError for what it cannot build
    exactly: another model type, rope type, activation, or a max_len or slots below 1.
    weights_device "meta" makes the parameters without memory (for a skeleton); the caches and
    rotary frequencies are always made on the CPU. placeholder_caches makes each cache a
    zero-stride placeholder (see the module docstring: libpipe allocates it; eager calls refuse it).
    cache_dtype (a torch.dtype; default `dtype`) stores keys and values in another dtype than the
    model's, e.g. bfloat16 caches for a float32 model: half the bytes attention reads, each key and
    value rounded once when written, read back in the model's dtype."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported are the Llama-family causal LMs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if max_len < 1 or slots < 1:
        raise ValueError(f"max_len and slots must be at least 1 (got {max_len} and {slots})")
    weights = {"dtype": dtype, "device": torch.device(weights_device)}
    if model_type == "gpt2":
        return build_gpt2(config, max_len, slots, weights, placeholder_caches, cache_dtype).eval()
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    eps = float(config.get("rms_norm_eps", 1e-6))
    layers_n = config["num_hidden_layers"]
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
    else:
        qkv_bias = o_bias = mlp_bias = False
    windows = _sliding_windows(config, model_type, layers_n)
    inv_freq, scaling = rotary_inv_freq(config, head_dim)
    layers = [
        DecoderLayer(
            Attention(
                hidden,
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
                o_bias,
                windows[i],
                slots,
                max_len,
                weights,
                placeholder_caches,
                cache_dtype,
            ),
            MLP(hidden, config["intermediate_size"], mlp_bias, weights),
            hidden,
            eps,
            weights,
        )
        for i in range(layers_n)
    ]
    model = DecoderModel(layers, vocab, hidden, eps, RotaryEmbedding(inv_freq, scaling), weights)
    tied = bool(config.get("tie_word_embeddings", False))
    return DecoderLM(model, vocab, hidden, tied, slots, max_len, weights).eval()


def script_decoder(decoder):
    """torch.jit.script of a DecoderLM."""
    return torch.jit.script(decoder)


def export_decoder(decoder, path=None):
    """torch.export of a DecoderLM or GPT2LM for libpipe's .pt2 front-end, as
    libpipe.export_program makes programs (eval, no_grad, not decomposed, so that the caches'
    index_put_ stay in place and persist across runs), with the batch B and the width T of tokens
    both dynamic from 1 (a decode step is T = 1; a micro-batch may be one row). With `path`, also
    saves it there (torch.export.save: every tensor with its data; libpipe.export_llm writes a
    skeleton instead). Returns the ExportedProgram.

    The example call has B = T = 2 (export specializes a dimension whose example is 1); its
    values are never run, so any decoder exports, whatever its slots and max_len. The contract's
    checks are aten._assert_async nodes that raise check_call's messages when the program runs
    (on the CPU; on a CUDA device _assert_async is a device-side assertion, fatal to the
    process's CUDA context), and each attention layer reads max(start + lengths) with
    aten.item into an unbacked size in 1 .. max_len that narrows its cache."""
    from torch.export import Dim

    from .exported import export_program

    tokens = torch.zeros(2, 2, dtype=torch.int64)
    start = torch.zeros(2, dtype=torch.int64)
    lengths = torch.tensor([2, 1], dtype=torch.int64)
    slots = torch.tensor([0, 1], dtype=torch.int64)
    return export_program(
        decoder, (tokens, start, lengths, slots), dynamic_shapes={"tokens": {1: Dim("T", min=1)}}, path=path
    )


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "build_decoder",
    "config_dtype",
    "export_decoder",
    "script_decoder",
]
