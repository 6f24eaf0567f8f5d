"""The decoder contract's KV caches and calls: caches made or as placeholders, the writes of keys and
values (padded or packed), attention over the rows' slots, a call's valid tokens packed (pack_call), and
the contract's checks of a call (check_call; under torch.export, assertions of the program)."""

from typing import Optional

import torch
import torch.nn.functional as F


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


def attention_mask(
    positions: torch.Tensor, valid: torch.Tensor, end: torch.Tensor, sliding_window: int, max_len: int
) -> torch.Tensor:
    """Which cache positions each query may see [B, 1, T, context], context the longest in the call: causal
    (and within the sliding window when it is > 0)."""
    if torch.jit.is_scripting():
        context = int(end.max())
    else:
        context = _context(end, max_len)
    kpos = torch.arange(context, device=positions.device)
    qpos = positions.unsqueeze(-1)
    allowed = kpos <= qpos
    if sliding_window > 0:
        allowed = allowed & (kpos > qpos - sliding_window)
    # Padding rows may see anything (their results are never used); never an all-masked row,
    # whose softmax would be NaN.
    return (allowed | ~valid.unsqueeze(-1)).unsqueeze(1)


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
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of q [B, heads, T, head_dim] over the rows' slots, causal (and within the sliding
    window when it is > 0). Returns [B, T, heads * head_dim]. mask: attention_mask's answer for these
    rows when the caller has it (pack_call computes the single rows' once for every layer)."""
    if mask is None:
        mask = attention_mask(positions, valid, end, sliding_window, k_cache.shape[2])
    # Only the longest context in the call is read and gathered, never the whole cache.
    context = mask.shape[-1]
    # A cache in another dtype than the model's (export_llm --cache-dtype) is read in the model's: a no-op otherwise.
    keys = k_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    values = v_cache.narrow(2, 0, context).index_select(0, slots).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(2)


def pack_call(
    valid: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, end: torch.Tensor
):
    """Where the valid tokens of a call go once packed ([N] rows, row b's tokens at
    first[b] .. first[b] + lengths[b] - 1, in row order). Returns (flat, at, where, single,
    single_at, multi, multi_flat, multi_src, single_mask):
    flat [N] each packed token's index in the padded B x T; at [N] its position and where [N]
    its slot (the cache entry it writes); single [Bs] the rows of one token and single_at [Bs]
    that token's packed index; multi [Bm] the other rows, whose queries attend in their padded
    layout [Bm, T]: multi_flat the valid tokens' indices in Bm x T, multi_src their packed ones;
    single_mask [Bs, 1, 1, context] what the single rows' queries see without a sliding window,
    computed here once instead of in every layer (a decode step is nothing but single rows)."""
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
    if single.shape[0] > 0:
        single_mask = attention_mask(
            positions.index_select(0, single)[:, :1],
            valid.index_select(0, single)[:, :1],
            end.index_select(0, single),
            0,
            0,
        )
    else:
        single_mask = torch.zeros((0, 1, 1, 1), dtype=torch.bool, device=valid.device)
    return flat, at, where, single, first.index_select(0, single), multi, multi_flat, multi_src, single_mask


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
    single_mask: torch.Tensor,
    sliding_window: int,
    scale: float,
) -> torch.Tensor:
    """attend_cache for packed queries q [N, heads, head_dim] (pack_call): rows of one token
    attend as [Bs, heads, 1, head_dim], the others in their padded layout, so that a decode row
    beside a prompt chunk costs one query, not T. single_mask: pack_call's, used by layers without
    a sliding window. Returns [N, heads * head_dim]."""
    n, heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    t = valid.shape[1]
    # A layer with a sliding window computes its own mask for the single rows.
    mask: Optional[torch.Tensor] = None
    if sliding_window == 0:
        mask = single_mask
    if multi.shape[0] == 0 and single.shape[0] == n:  # every row one token (a decode step): q is in row order
        if mask is None:
            out = attend_cache(
                k_cache, v_cache, q.unsqueeze(2), positions[:, :1], valid[:, :1], end, slots, sliding_window, scale
            )
        else:  # positions and valid unread: not even sliced
            out = attend_cache(k_cache, v_cache, q.unsqueeze(2), positions, valid, end, slots, 0, scale, mask)
        return out.view(n, heads * head_dim)
    if single.shape[0] == 0 and multi.shape[0] == 1 and n == t:
        # One prompt chunk with no padding (a lone prompt's prefill): q is already its padded layout, row order.
        chunk = attend_cache(
            k_cache,
            v_cache,
            q.view(1, t, heads, head_dim).transpose(1, 2),
            positions,
            valid,
            end,
            slots,
            sliding_window,
            scale,
        )
        return chunk.reshape(n, heads * head_dim)
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
            mask,
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
