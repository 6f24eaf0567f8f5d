"""Drives the go-sse service with OpenAI's official Python client (the `openai` package).

    python openai_client_check.py BASE_URL CASES.json

BASE_URL is the service's http://HOST:PORT/v1. CASES.json (server_test.go writes it) holds the
model's name and the expected results of a greedy completion and a greedy chat reply:

  {"model", "completion": {"prompt", "max_tokens", "text", "finish_reason"},
   "chat": {"messages", "max_tokens", "text", "finish_reason"}}

Each is asked for twice, with stream=False and stream=True, through client.completions.create and
client.chat.completions.create; the text (joined from the streamed chunks) and the finish reason
must be the expected ones. Prints one line per call, and exits 1 at the first mismatch.
"""

import json
import sys

import openai


def check(what, text, finish, want):
    if text != want["text"] or finish != want["finish_reason"]:
        print(
            f"openai_client_check: {what}: {text!r} ({finish}), want {want['text']!r} ({want['finish_reason']})",
            file=sys.stderr,
        )
        sys.exit(1)
    print(f"openai_client_check: {what}: {text!r} ({finish})")


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
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **args):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    check("completions, stream=True", text, finish, c)

    c = cases["chat"]
    args = dict(model=model, messages=c["messages"], max_tokens=c["max_tokens"], temperature=0, seed=1)
    r = client.chat.completions.create(**args)
    message = r.choices[0].message
    if message.role != "assistant":
        print(f"openai_client_check: chat: the message's role is {message.role!r}", file=sys.stderr)
        sys.exit(1)
    check("chat.completions", message.content, r.choices[0].finish_reason, c)
    text, finish, roles = "", None, []
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if roles != ["assistant"]:
        print(f"openai_client_check: chat, stream=True: roles {roles}, want ['assistant'] once", file=sys.stderr)
        sys.exit(1)
    check("chat.completions, stream=True", text, finish, c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
