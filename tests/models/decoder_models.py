"""Generates the decoder fixtures of the generation engine's tests: a tiny Llama-architecture decoder under the
decoder contract (libpipe.decoders.build_decoder) with random weights inside, the greedy tokens that transformers'
LlamaForCausalLM.generate(do_sample=False) gives with the same weights (the independent reference), and gated
variants whose steps a test can hold (tests/gate).

    python decoder_models.py [OUT_DIR]      (default: $PIPE_TEST_MODELS)

writes
    OUT_DIR/tiny_decoder.pt              vocab 128, 2 layers (model.layers.0, model.layers.1; cut with
                                         model.layers.1:begin), 4 slots, max_len 64, float32
    OUT_DIR/tiny_decoder.expected.json   {"prompts": [[ids]], "max_new_tokens": N, "greedy": [[ids]],
                                          "greedy_logprobs": [{"logprob": [x], "top_ids": [[5 ids]],
                                                               "top_logprobs": [[5 x]]}],
                                          "prompt_logprobs": [the same, of prompts[i][1:] given what precedes
                                                               each], "vocab", "slots", "max_len",
                                          "max_len_prompt": [ids], "max_len_greedy": [ids]}
                                         greedy[i]: the N tokens generated after prompts[i], greedy_logprobs[i]
                                         their log-probabilities (log-softmax of transformers' logits) and the
                                         5 likeliest tokens at each; max_len_greedy: every
                                         token a cache of max_len positions has room for after max_len_prompt
                                         (max_len - len(prompt) + 1: the last one is sampled, never fed back)
    OUT_DIR/gated_decoder.pt             the same weights (same outputs when no gate holds), 4 slots, with a
                                         libpipe_test::gate at the start of model.layers.1 (so in the second stage
                                         when cut at model.layers.1:begin), stage name "stage1". Its key: a prefill
                                         row (start == 0) whose first token is id >= 120 holds the step at key
                                         id - 119 (the largest such key of the step); any other step passes. A
                                         prefill row whose first token is 119 makes the forward raise (a failing
                                         step). The reference prompts never start with 119..127.
    OUT_DIR/gated_decoder_1slot.pt       the gated decoder with 1 slot, for tests that need a sequence to hold the
                                         only slot while others queue.

Weights are drawn with a large initializer_range (as tests/llm does) so that the generated tokens vary, and the
seed is the first one for which every greedy choice wins by a clear margin (an engine that batches rows
differently changes logits in the last bits only, which must never flip an argmax). The script checks its own
output: the eager decoder with the same weights must reproduce the reference, and the gated one must raise for 119.
"""

import importlib.util
import json
import os
import sys

import torch

VOCAB = 128
SLOTS = 4
MAX_LEN = 64
NEW_TOKENS = 12
PROMPT_LENGTHS = (1, 3, 7, 20, 33)  # + NEW_TOKENS each fits MAX_LEN
MAX_LEN_PROMPT = 60
GATE_FAIL_ID = 119  # a prefill row starting with it fails; with 120..127 it holds at key id - 119
MIN_MARGIN = 0.01  # top-1 minus top-2 logit at every greedy choice (batching noise is ~1e-5)


def load_decoders_package():
    """The package libpipe/decoders by path: it needs only torch, not the native module `import libpipe` would look
    for. Registered in sys.modules before it runs, so that its files' relative imports of each other resolve."""
    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(here, "..", "..", "bindings", "python", "libpipe", "decoders")
    spec = importlib.util.spec_from_file_location(
        "libpipe_decoders", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return package


decoders = load_decoders_package()


class GatedLayer(torch.nn.Module):
    """A DecoderLayer (same submodules, same parameter names) that first passes the test gate with `key`."""

    def __init__(self, layer):
        super().__init__()
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(
        self,
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
        key,
    ):
        h = torch.ops.libpipe_test.gate(h, key, "stage1")
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


class GatedDecoderLM(torch.nn.Module):
    """DecoderLM (2 layers) whose second layer is gated; the key and the failure come from prefill rows' first
    tokens, so a test picks them with its prompt. Without DecoderLM's skips_padding, so that the engine gives
    prompts and decode rows steps of their own and a failing prompt's step holds no other sequence."""

    def __init__(self, base):
        super().__init__()
        self.model = base.model
        self.model.layers[1] = GatedLayer(base.model.layers[1])
        self.lm_head = base.lm_head
        self.vocab = base.vocab
        self.num_slots = base.num_slots
        self.max_len = base.max_len

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        valid, positions, end = decoders.check_call(
            tokens, start, lengths, slots, self.max_len, self.num_slots, self.vocab
        )
        first = tokens[:, 0]
        prefill = start == 0
        if bool((prefill & (first == 119)).any()):
            raise RuntimeError("gated_decoder: a prompt starting with token 119 fails its step (test fixture)")
        key = torch.where(prefill & (first >= 120), first - 119, torch.zeros_like(first)).max()
        flat, at, where, single, single_at, multi, multi_flat, multi_src, single_mask = decoders.pack_call(
            valid, positions, lengths, slots, end
        )
        h = self.model.embed_tokens(tokens.flatten().index_select(0, flat))
        cos, sin = self.model.rotary_emb(at, h.dtype)
        h = self.model.layers[0](
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
        h = self.model.layers[1](
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
            key,
        )
        last = h.index_select(0, lengths.cumsum(0) - 1)
        return self.lm_head(self.model.norm(last)).to(torch.float32)


def hf_model(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_LEN,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def hf_greedy(hf, prompt, new_tokens):
    """transformers' greedy tokens after `prompt`, and the smallest top-1/top-2 logit gap among them."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = [step[0].topk(2).values for step in out.logits]
    margin = min(float(t[0] - t[1]) for t in top2)
    return out.sequences[0, len(prompt) :].tolist(), margin, [step[0] for step in out.logits]


def logprobs_of(tokens, logits, top=5):
    """Each token's log-probability (log-softmax of its step's logits, in float64) and the top ids and theirs."""
    lp, top_ids, top_lp = [], [], []
    for token, row in zip(tokens, logits):
        log_p = torch.log_softmax(row.double(), 0)
        values, indices = log_p.topk(top)
        lp.append(float(log_p[token]))
        top_ids.append(indices.tolist())
        top_lp.append(values.tolist())
    return {"logprob": lp, "top_ids": top_ids, "top_logprobs": top_lp}


def prompt_logprobs_of(hf, prompt, top=5):
    """Each prompt token's log-probability given those before it (positions 1.., from transformers' logits of one
    forward over the prompt), as logprobs_of gives them."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return logprobs_of(prompt[1:], logits[:-1], top)


def make_prompt(n, generator):
    """n random ids, never starting with the gated decoder's marker ids 119..127."""
    p = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
    p[0] %= GATE_FAIL_ID
    return p


def reference(seed):
    """(hf model, prompts, greedy, max_len prompt, its greedy) for `seed`, or None when a greedy choice is too close
    to call or a generation repeats itself (it would not tell a broken cache)."""
    hf = hf_model(seed)
    generator = torch.Generator().manual_seed(seed)
    prompts = [make_prompt(n, generator) for n in PROMPT_LENGTHS]
    long_prompt = make_prompt(MAX_LEN_PROMPT, generator)
    greedy, logprobs = [], []
    for p in prompts:
        tokens, margin, logits = hf_greedy(hf, p, NEW_TOKENS)
        if margin < MIN_MARGIN or len(set(tokens)) < 3:
            return None
        greedy.append(tokens)
        logprobs.append(logprobs_of(tokens, logits))
    long_greedy, margin, _ = hf_greedy(hf, long_prompt, MAX_LEN - MAX_LEN_PROMPT + 1)
    if margin < MIN_MARGIN:
        return None
    return hf, prompts, greedy, logprobs, long_prompt, long_greedy


def decoder_with(hf, slots, placeholder_caches):
    """The contract's decoder with hf's weights, copied by name (the names are Hugging Face's)."""
    dec = decoders.build_decoder(hf.config.to_dict(), MAX_LEN, slots, placeholder_caches=placeholder_caches)
    dec.load_state_dict(hf.state_dict(), strict=True)
    return dec


def eager_greedy(step, prompt, new_tokens, slot):
    """Greedy decoding through the contract: one prefill row, then one token per call."""
    one = torch.ones(1, dtype=torch.int64)
    slot_t = torch.tensor([slot])
    logits = step(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), torch.tensor([len(prompt)]), slot_t)
    out = [int(logits.argmax())]
    while len(out) < new_tokens:
        start = torch.tensor([len(prompt) + len(out) - 1])
        out.append(int(step(torch.tensor([[out[-1]]]), start, one, slot_t).argmax()))
    return out


def check(step, prompts, greedy, long_prompt, long_greedy, what):
    with torch.no_grad():
        for i, (p, want) in enumerate(zip(prompts, greedy)):
            got = eager_greedy(step, p, len(want), i % SLOTS)
            assert got == want, f"{what}: prompt {i}: {got} != transformers' {want}"
        got = eager_greedy(step, long_prompt, len(long_greedy), 0)
        assert got == long_greedy, f"{what}: max_len prompt: {got} != transformers' {long_greedy}"


def generate(out_dir):
    torch.ops.load_library(os.environ["LIBPIPE_TEST_GATE_LIB"])  # the gated decoders call libpipe_test::gate
    os.makedirs(out_dir, exist_ok=True)
    for seed in range(100):
        found = reference(seed)
        if found:
            break
    else:
        sys.exit("decoder_models.py: no seed in 0..99 gives greedy choices with a clear margin")
    hf, prompts, greedy, logprobs, long_prompt, long_greedy = found

    # The files hold placeholder caches (as `export_llm` writes them): libpipe allocates each stage's own.
    torch.jit.script(decoder_with(hf, SLOTS, True)).save(os.path.join(out_dir, "tiny_decoder.pt"))
    torch.jit.script(GatedDecoderLM(decoder_with(hf, SLOTS, True))).save(os.path.join(out_dir, "gated_decoder.pt"))
    torch.jit.script(GatedDecoderLM(decoder_with(hf, 1, True))).save(os.path.join(out_dir, "gated_decoder_1slot.pt"))
    expected = {
        "prompts": prompts,
        "max_new_tokens": NEW_TOKENS,
        "greedy": greedy,
        "greedy_logprobs": logprobs,
        "prompt_logprobs": [prompt_logprobs_of(hf, p) for p in prompts],
        "vocab": VOCAB,
        "slots": SLOTS,
        "max_len": MAX_LEN,
        "max_len_prompt": long_prompt,
        "max_len_greedy": long_greedy,
    }
    with open(os.path.join(out_dir, "tiny_decoder.expected.json"), "w") as f:
        json.dump(expected, f)

    # The fixtures agree with the reference: the contract's decoder (eager, allocated caches) and its gated form.
    check(decoder_with(hf, SLOTS, False), prompts, greedy, long_prompt, long_greedy, "decoder")
    gated = GatedDecoderLM(decoder_with(hf, SLOTS, False))
    check(gated, prompts, greedy, long_prompt, long_greedy, "gated decoder")
    try:
        gated(
            torch.tensor([[GATE_FAIL_ID, 5]]), torch.zeros(1, dtype=torch.int64), torch.tensor([2]), torch.tensor([0])
        )
    except RuntimeError as e:
        assert "119" in str(e), e
    else:
        raise AssertionError("the gated decoder did not fail a prefill row starting with 119")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: decoder_models.py [OUT_DIR] (default: $PIPE_TEST_MODELS)")
    target = sys.argv[1] if len(sys.argv) == 2 else os.environ.get("PIPE_TEST_MODELS")
    if not target:
        sys.exit("decoder_models.py: give OUT_DIR or set PIPE_TEST_MODELS")
    generate(target)
