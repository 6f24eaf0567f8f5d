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
a libpipe older than this refuses to write into a placeholder (ValueError, from write_cache and
write_packed in cache.py), never taking the writes silently. The forward writes the keys and
values of the valid tokens of each row at positions start .. start+lengths-1 of its slot, in
place (padding never writes), and attends over positions 0 .. start+lengths-1 of the slot
with a causal mask (and a sliding window where the model has one). What a slot holds at
positions >= start is overwritten by the call, so a slot is reused for a new sequence simply
by prefilling it from start = 0; nothing needs clearing. The caller owns the bookkeeping:
which slot a sequence uses and how many of its tokens are cached (start of the next call).

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
rows) attend as single queries and the other rows in their padded layout [rows, T] (attend_packed;
a call of one unpadded prompt chunk, a lone prompt's prefill, attends from the packed queries as
they are), so a decode row beside a prompt chunk costs one query; what those single rows may see
(the causal mask) is computed once per call by pack_call and handed to every layer, not rebuilt in
each (layers with a sliding window build their own). libpipe's generator then puts decode rows
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

The package, one concern per file: `cache.py` (the caches, their writes and the attention that reads
them, pack_call, attend_packed, check_call), `llama.py` (the Llama family: Llama, Mistral, Qwen2, with
their rope and sliding-window settings), `gpt2.py` (GPT-2, build_gpt2), `make.py` (config_dtype,
build_decoder, script_decoder, export_decoder). A scripted method resolves the functions it calls in
its own module, so each layer's file imports the cache helpers it calls by name.
"""

from .make import SUPPORTED_MODEL_TYPES, build_decoder, config_dtype, export_decoder, script_decoder
from .cache import check_call, pack_call
from .llama import SUPPORTED_ROPE_TYPES

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "build_decoder",
    "check_call",
    "config_dtype",
    "export_decoder",
    "pack_call",
    "script_decoder",
]
