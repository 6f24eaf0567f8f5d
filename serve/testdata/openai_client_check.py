"""Drives pipe-serve with OpenAI's official Python client (the `openai` package).

    python openai_client_check.py BASE_URL CASES.json

BASE_URL is the service's http://HOST:PORT/v1. CASES.json (clients_test.go writes it) holds the
model's name and the expected results of a greedy completion and a greedy chat reply, with the
reference's token counts of the prompt and of the completion:

  {"model", "completion": {"prompt", "max_tokens", "text", "finish_reason", "prompt_tokens",
                           "completion_tokens"},
   "chat": {"messages", "max_tokens", "text", "finish_reason", "prompt_tokens", "completion_tokens"}}

Each is asked for three times through client.completions.create and client.chat.completions.create:
with stream=False (its usage must be the expected counts), with stream=True (no chunk may carry
usage), and with stream=True and stream_options={"include_usage": True} (every chunk says "usage":
null but the last, which has no choices and the expected counts). The text (joined from the
streamed chunks) and the finish reason must be the expected ones. Then each once more with log-probabilities
(completions: logprobs=2; chat: logprobs=True, top_logprobs=2), parsed by the client's own types: one entry per
completion token, each at most 0 and, the replies being greedy, the likeliest of its alternatives. Then the
prompt scored alone (completions with echo=True, logprobs=1, max_tokens=0, as lm-evaluation-harness asks): the
prompt's text, an entry per prompt token, None for the first, no completion token. Prints one line per call, and
exits 1 at the first mismatch.
"""

import json
import sys

import openai


def check(what, text, finish, want):
    if text != want["text"] or finish != want["finish_reason"]:
        fail(f"{what}: {text!r} ({finish}), want {want['text']!r} ({want['finish_reason']})")
    print(f"openai_client_check: {what}: {text!r} ({finish})")


def fail(message):
    print(f"openai_client_check: {message}", file=sys.stderr)
    sys.exit(1)


def check_usage(what, usage, want):
    got = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) if usage else None
    wanted = (want["prompt_tokens"], want["completion_tokens"], want["prompt_tokens"] + want["completion_tokens"])
    if got != wanted:
        fail(f"{what}: usage (prompt, completion, total) {got}, want {wanted}")
    print(f"openai_client_check: {what}: usage {got}")


def stream(what, chunks, want, content, include_usage):
    """Reads a stream's chunks: the text of their first choices, its finish reason, the roles the
    chat deltas named. With include_usage the last chunk must hold the expected usage and no choice,
    every other one "usage": null; without it no chunk may hold usage."""
    chunks = list(chunks)
    if include_usage:
        last = chunks.pop() if chunks else None
        if last is None or last.choices or last.usage is None:
            fail(f"{what}: the last chunk is {last}; want one without choices, with the usage")
        check_usage(what, last.usage, want)
    text, finish, roles = "", None, []
    for chunk in chunks:
        if not chunk.choices or chunk.usage is not None or ("usage" in chunk.model_fields_set) != include_usage:
            fail(f"{what}: chunk {chunk} (usage given: {'usage' in chunk.model_fields_set})")
        piece, role = content(chunk.choices[0])
        text += piece
        roles += [role] if role else []
        finish = chunk.choices[0].finish_reason or finish
    return text, finish, roles


def check_logprobs(what, entries, want):
    """entries: (logprob, [alternatives' logprobs]) per token, as the client parsed them."""
    if len(entries) != want["completion_tokens"]:
        fail(f"{what}: {len(entries)} log-probability entries, want one per token ({want['completion_tokens']})")
    for i, (logprob, top) in enumerate(entries):
        if logprob > 0 or len(top) != 2 or max(top) > logprob + 1e-4:
            fail(f"{what}: token {i}: logprob {logprob}, alternatives {top}: want <= 0, the likeliest of 2")
    print(f"openai_client_check: {what}: {len(entries)} tokens' log-probabilities")


def main():
    base_url, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = cases["model"]

    c = cases["completion"]
    args = dict(model=model, prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=0, seed=1)
    r = client.completions.create(**args)
    check("completions", r.choices[0].text, r.choices[0].finish_reason, c)
    check_usage("completions", r.usage, c)
    for include_usage in (False, True):
        what = f"completions, stream=True, include_usage {include_usage}"
        options = dict(stream_options={"include_usage": True}) if include_usage else {}
        chunks = client.completions.create(stream=True, **options, **args)
        text, finish, _ = stream(what, chunks, c, lambda choice: (choice.text, None), include_usage)
        check(what, text, finish, c)
    r = client.completions.create(logprobs=2, **args)
    check("completions, logprobs=2", r.choices[0].text, r.choices[0].finish_reason, c)
    lp = r.choices[0].logprobs
    check_logprobs(
        "completions, logprobs=2", [(x, list(t.values())) for x, t in zip(lp.token_logprobs, lp.top_logprobs)], c
    )
    r = client.completions.create(echo=True, logprobs=1, **{**args, "max_tokens": 0})
    lp, what = r.choices[0].logprobs, "completions, echo=True, max_tokens=0"
    if (
        r.choices[0].text != c["prompt"]
        or r.usage.completion_tokens != 0
        or r.usage.prompt_tokens != c["prompt_tokens"]
    ):
        fail(f"{what}: {r.choices[0].text!r}, usage {r.usage}; want the prompt {c['prompt']!r} and no completion")
    if len(lp.tokens) != c["prompt_tokens"] or lp.token_logprobs[0] is not None or lp.top_logprobs[0] is not None:
        fail(f"{what}: {lp}; want an entry per prompt token, None for the first")
    if any(
        x > 0 or abs(x - t.get(tok, 1)) > 1e-6
        for x, t, tok in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], lp.tokens[1:])
    ):
        fail(f"{what}: {lp}; want log-probabilities at most 0, each token among its alternatives")
    print(f"openai_client_check: {what}: {r.choices[0].text!r}, scored {lp.token_logprobs}")

    c = cases["chat"]
    args = dict(model=model, messages=c["messages"], max_tokens=c["max_tokens"], temperature=0, seed=1)
    r = client.chat.completions.create(**args)
    message = r.choices[0].message
    if message.role != "assistant":
        fail(f"chat: the message's role is {message.role!r}")
    check("chat.completions", message.content, r.choices[0].finish_reason, c)
    check_usage("chat.completions", r.usage, c)
    for include_usage in (False, True):
        what = f"chat.completions, stream=True, include_usage {include_usage}"
        options = dict(stream_options={"include_usage": True}) if include_usage else {}
        chunks = client.chat.completions.create(stream=True, **options, **args)
        text, finish, roles = stream(
            what, chunks, c, lambda choice: (choice.delta.content or "", choice.delta.role), include_usage
        )
        if roles != ["assistant"]:
            fail(f"{what}: roles {roles}, want ['assistant'] once")
        check(what, text, finish, c)
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, **args)
    check("chat.completions, logprobs", r.choices[0].message.content, r.choices[0].finish_reason, c)
    entries = [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in r.choices[0].logprobs.content]
    check_logprobs("chat.completions, logprobs", entries, c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
