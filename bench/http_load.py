"""Load over HTTP: libpipe's go-sse service against llama.cpp's llama-server, on SmolLM2-135M-Instruct.

Both servers speak OpenAI's /v1/chat/completions with streaming (server-sent events) and run the
same float32 weights: go-sse (pipe-serve, serve/) serves the Hugging Face folder of
tests/models/smollm2.py through a decoder skeleton that libpipe.export_llm writes with N cache
slots; llama-server (bench/llamacpp.py builds it) serves the F32 GGUF dequantized from the same
GGUF, with -np N slots, -c N times a slot's context, -t/-tb --llamacpp-threads threads, no web UI.
Both can start a prompt after a prefix of it that a cache slot still holds from an earlier request
and prefill only the rest: go-sse since libpipe's prefix reuse (--servers libpipe-noreuse is the
same service with LIBPIPE_PREFIX_REUSE=0 in its environment, reuse off), llama-server with its
prompt cache, which the single workload turns off (--no-cache-prompt) unless
--llamacpp-cache-prompt and the multi-turn workload leaves on. In the single workload libpipe's
reuse spares it prefill that llama-server does: the model's chat template puts a default system
prompt (about 20 tokens) before every message, and the warm-up sends the first N messages that the
measured requests then send again (found whole in the slots); so the single workload's servers
are libpipe-noreuse and llamacpp by default, both without a prompt cache (like for like). Each server is started afresh for each N, on the loopback,
and stopped (its process group) before the next.

For each N (--concurrency, default 1 8 32) and server: N clients, each sending one request after
another (a closed loop), until --requests requests (default 2 N) were sent or --time-limit seconds
passed (no request starts after it; one in flight gets --request-timeout). The requests are real
chat messages (bench/generate.py's MESSAGES, in turn; one user turn each, no system message: both
servers render the model's own chat template), max_tokens --max-tokens (64), temperature 0,
stream true, stream_options.include_usage true (both servers then end the stream with a chunk
holding the usage). N short requests at once warm each server up first and are not counted.

--workload multi-turn (servers default libpipe libpipe-noreuse llamacpp): each client holds a
conversation instead, the prefix-reuse case: a system message that all conversations share
(SYSTEM, 78 tokens in the template), then --turns user turns (default 4), MESSAGES in turn from message k for
conversation k (Workload.message). Each turn's request sends the whole conversation so far (the
system message, the earlier user turns and the assistant's replies as the server streamed them)
and the new user turn; a turn is sent when the previous reply has ended, and a turn that did not
complete ends its conversation (its later turns count as not sent). --requests defaults to N T (a
conversation per client) and must be a multiple of T. The caches are sized for the longest
conversation with each earlier reply taking max_tokens + REPLY_SLACK tokens. Turn 1 finds
little in the slots (the warm-up's prompts have no system message; the conversations start at
once), so its TTFT is a cold prefill; the later turns find their conversation so far.

Figures per server and N (wall = from the first request sent to the last one's end):
- requests/s: complete requests over the wall time;
- tokens/s: generated tokens of complete requests over the wall time. A request's tokens are its
  usage.completion_tokens (both servers count the end-of-turn token of a reply that stops, which
  sends no content); a stream without usage falls back to its content chunks, which can undercount
  (go-sse sends a character spanning several tokens once it is complete), and the table's "tokens"
  column says which source was used ("usage" for both servers when all went well);
- chunks/s: the content chunks of complete requests over the wall time (what a reader sees arrive);
- TTFT: from sending the request to its first non-empty content delta, p50 and p99 over requests;
- ITL: the gaps between consecutive content chunks of a request, p50 and p99 over all gaps;
- outcomes: every request sent ends in exactly one of: complete (a choice with finish_reason),
  http_error (a status other than 200), error_event (a data: {"error": ...} event), incomplete
  (the stream ended without finish_reason), connection (refused, reset or timed out); requests not
  sent before the time limit are counted apart. The counts add up to --requests, or the run says so.
- same text: of the complete requests, how many got the same reply as the other server gave to the
  same prompt at the same N (greedy on the same weights; batching may flip a near tie). A turn-1
  prompt is its message; a later turn's is its conversation's too (reply_key). With three servers
  each is compared with the first of the others (libpipe with libpipe-noreuse, the rest with
  libpipe), which the table names.
- multi-turn only: TTFT p50 and p99 over turn 1 and over turns 2 and later apart; the cached share:
  the mean over complete turns >= 2 of cached tokens / prompt tokens, from the usage chunk's
  prompt_tokens and prompt_tokens_details.cached_tokens (both servers send them), else from
  llama-server's timings in the last chunk (cache_n cached of prompt_n + cache_n), else "n/a";
  per turn, the mean prompt and cached tokens (--out's by_turn). Each request's turn, TTFT,
  prompt and cached tokens are in --out's records.

    python bench/http_load.py [--workload single|multi-turn] [--turns 4] [--concurrency 1 8 32]
                              [--requests R] [--max-tokens 64]
                              [--servers libpipe libpipe-noreuse llamacpp] [--llamacpp-threads 2]
                              [--split POINT] [--prefix build/stage | --go-sse BIN] [--work DIR]
                              [--out FILE]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/build.sh;
go-sse (pipe-serve, serve/) is built against the libpipe installed at --prefix (default build/stage,
which ctest's bindings_stage fills; or `cmake --install build --prefix DIR`).
The client runs in this process on the same cores as the servers (threads, the standard library).
Exit status 1 when some request did not complete.
"""

import argparse
import dataclasses
import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from generate import MESSAGES, machine  # noqa: E402  (generate.py also puts tests/models on the path)

HOST = "127.0.0.1"
START_LIMIT_S = 300  # a server that is not healthy by then (model load) is reported as failed
OUTCOMES = ("complete", "http_error", "error_event", "incomplete", "connection")
SERVERS = ("libpipe", "libpipe-noreuse", "llamacpp")
# The multi-turn workload's system message, the same for every conversation (a prefix that every
# prompt shares, as a deployed assistant's instructions are).
SYSTEM = (
    "You are a friendly and knowledgeable assistant for a small public library. Answer the reader's "
    "questions clearly and briefly, in plain language, and say so when you are not sure of something. "
    "When a question is about health, money or the law, give general information only and suggest "
    "asking a professional. Keep every answer under a hundred words unless the reader asks for more."
)
REPLY_SLACK = 8  # tokens a reply may gain when the server tokenizes its text again in the next turn


class LoadError(RuntimeError):
    """A server cannot be built or started; the message says what went wrong and what to do."""


# ---- the servers ------------------------------------------------------------------------------


def free_port():
    """A port free on the loopback now, for llama-server (which needs a number; go-sse takes 0)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def build_go_sse(prefix, work):
    """Builds pipe-serve (serve/) against the libpipe installed at `prefix`."""
    if not (prefix / "lib" / "pkgconfig" / "libpipe.pc").is_file():
        raise LoadError(
            f"no libpipe installed at {prefix} (no lib/pkgconfig/libpipe.pc): run ctest -R bindings_stage, "
            "or `cmake --install build --prefix DIR` and pass --prefix DIR, or give a built --go-sse"
        )
    out = work / "go-sse"
    script = (
        'set -euo pipefail; proxy=$(go env GOPROXY); . "$ROOT/bindings/go/build-env.sh"; export GOPROXY="$proxy"; '
        'cd "$ROOT/serve"; go build -ldflags "-r $PREFIX/lib" -o "$OUT" .'
    )
    env = dict(os.environ, ROOT=str(ROOT), PREFIX=str(prefix), WORKDIR=str(work), OUT=str(out))
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise LoadError(f"building go-sse failed ({r.returncode}):\n{(r.stderr or r.stdout)[-4000:]}")
    return out


class Server:
    """A server process in a process group of its own, its output in a log file."""

    def __init__(self, name, cmd, log, env=None):
        self.name, self.cmd, self.log = name, cmd, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.port = None

    def stop(self):
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # go-sse lets requests in progress finish: there are none
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self):
        try:
            return Path(self.log).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def check_alive(self):
        if self.proc.poll() is not None:
            raise LoadError(f"{self.name} exited with {self.proc.returncode} (log {self.log}):\n{self.tail()}")

    def wait_healthy(self, deadline):
        """Waits until GET /health answers 200 with status ok (llama-server answers 503 while it loads)."""
        while True:
            self.check_alive()
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=10)
                conn.request("GET", "/health")
                r = conn.getresponse()
                body = r.read()
                conn.close()
                if r.status == 200 and json.loads(body).get("status") == "ok":
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise LoadError(f"{self.name}: /health not ok after {START_LIMIT_S} s (log {self.log}):\n{self.tail()}")
            time.sleep(0.2)  # polling an observable condition, bounded by the deadline


def start_go_sse(binary, decoder, folder, split, prefix, log, extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    if prefix:
        env["LD_LIBRARY_PATH"] = f"{prefix / 'lib'}" + (
            f":{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else ""
        )
    cmd = [str(binary), "-decoder", str(decoder), "-model-dir", str(folder), "-split", split, "-addr", f"{HOST}:0"]
    server = Server("go-sse", cmd, log, env)
    deadline = time.monotonic() + START_LIMIT_S
    try:
        marker = "pipe-serve: listening on http://"
        while server.port is None:
            server.check_alive()
            for line in Path(log).read_text(errors="replace").splitlines():
                if line.startswith(marker):
                    server.port = int(line[len(marker) :].rsplit(":", 1)[1])
            if server.port is None:
                if time.monotonic() > deadline:
                    raise LoadError(f"go-sse printed no address after {START_LIMIT_S} s (log {log}):\n{server.tail()}")
                time.sleep(0.2)
        server.wait_healthy(deadline)
    except BaseException:
        server.stop()
        raise
    return server


def start_llama_server(bin_dir, gguf, slots, ctx, threads, cache_prompt, log):
    port = free_port()
    cmd = [
        str(bin_dir / "llama-server"),
        "-m",
        str(gguf),
        "-np",
        str(slots),
        "-c",
        str(ctx),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--host",
        HOST,
        "--port",
        str(port),
        "--no-webui",
    ]
    if not cache_prompt:
        cmd.append("--no-cache-prompt")
    server = Server("llama-server", cmd, log)
    server.port = port
    try:
        server.wait_healthy(time.monotonic() + START_LIMIT_S)
    except BaseException:
        server.stop()
        raise
    return server


# ---- the client -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a client sends: conversations of `turns` user turns, each turn's request holding the
    conversation so far (after the `system` message, if any) and the new user turn. The single
    workload is conversations of one turn without a system message."""

    turns: int = 1
    system: str | None = None
    max_tokens: int = 64

    def message(self, conversation, turn):
        """The index in MESSAGES of a conversation's turn (both from 0): MESSAGES in turn, from
        message k for conversation k, with a stride that grows by one each time the conversations
        have gone round MESSAGES, so that conversations that begin with the same message (every
        len(MESSAGES)-th) go on with different ones."""
        stride = 1 + conversation // len(MESSAGES)
        return (conversation + turn * stride) % len(MESSAGES)

    def conversation(self, k, replies=None):
        """Conversation k's messages: with `replies` (the assistant's, one per earlier turn), up to
        the turn after them; without, all its turns, the replies empty (to count its tokens)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for t in range(self.turns if replies is None else len(replies) + 1):
            if t:
                messages.append({"role": "assistant", "content": replies[t - 1] if replies else ""})
            messages.append({"role": "user", "content": MESSAGES[self.message(k, t)]})
        return messages


def chat_body(messages, max_tokens):
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_request(port, body, timeout):
    """One streaming chat request: its outcome and timings (perf_counter seconds)."""
    rec = {
        "outcome": None,
        "status": None,
        "error": None,
        "finish_reason": None,
        "usage": None,
        "timings": None,
        "done": False,
    }
    rec["sent"] = time.perf_counter()
    arrivals, text = [], []
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
        try:
            payload = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
            conn.request("POST", "/v1/chat/completions", body=payload, headers=headers)
            r = conn.getresponse()
            rec["status"] = r.status
            if r.status != 200:
                rec["outcome"] = "http_error"
                rec["error"] = f"HTTP {r.status}: {r.read(2000).decode(errors='replace')}"
                return rec
            while True:
                line = r.readline()
                if not line:
                    break
                if time.perf_counter() - rec["sent"] > timeout:
                    raise TimeoutError(f"no end of stream after {timeout} s")
                line = line.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank lines end events; ':' lines are comments (llama-server's pings)
                data = line[5:].strip()
                if data == "[DONE]":
                    rec["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["outcome"] = "error_event"
                    rec["error"] = json.dumps(event["error"])[:2000]
                    return rec
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        arrivals.append(time.perf_counter())
                        text.append(piece)
                    if choice.get("finish_reason"):
                        rec["finish_reason"] = choice["finish_reason"]
                if event.get("usage"):
                    rec["usage"] = event["usage"]
                if event.get("timings"):
                    rec["timings"] = event["timings"]  # llama-server's, beside the usage
        finally:
            conn.close()
        rec["outcome"] = "complete" if rec["finish_reason"] else "incomplete"
        if not rec["finish_reason"]:
            rec["error"] = "the stream ended without a finish_reason"
    except (OSError, ValueError, http.client.HTTPException) as e:
        rec["outcome"] = "connection"
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        rec["end"] = time.perf_counter()
        rec["arrivals"] = arrivals
        rec["text"] = "".join(text)
    return rec


def warm_up(port, clients, timeout):
    """N short requests at once (a step over every slot, as the measured wave's), not counted."""
    records, _ = wave(port, clients, clients, Workload(max_tokens=4), timeout, timeout)
    bad = [r for r in records if r is None or r["outcome"] != "complete"]
    if bad:
        r = bad[0] or {"outcome": "not sent", "error": None}
        raise LoadError(f"a warm-up request did not complete: {r['outcome']}: {r['error']}")


def wave(port, clients, conversations, workload, time_limit, timeout):
    """`clients` threads hold `conversations` conversations in all, one after another each, a
    conversation's turns one after another (a turn is sent when the previous reply has ended; a
    turn that did not complete ends its conversation); no request starts after `time_limit` s.
    Request i is turn i % turns of conversation i // turns. (records, wall seconds)."""
    total = conversations * workload.turns
    records = [None] * total
    lock = threading.Lock()
    state = {"next": 0}
    start = time.perf_counter()
    stop_at = start + time_limit

    def client():
        while True:
            with lock:
                k = state["next"]
                if k >= conversations or time.perf_counter() > stop_at:
                    return
                state["next"] = k + 1
            replies = []
            for t in range(workload.turns):
                if t and time.perf_counter() > stop_at:
                    return
                body = chat_body(workload.conversation(k, replies), workload.max_tokens)
                rec = stream_request(port, body, timeout)
                i = k * workload.turns + t
                rec.update(index=i, conversation=k, turn=t + 1, message=workload.message(k, t))
                records[i] = rec
                if rec["outcome"] != "complete":
                    break
                replies.append(rec["text"])

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in records if r is not None]
    wall = (max(r["end"] for r in done) - start) if done else 0.0
    for r in done:
        r["sent"] -= start
        r["end"] -= start
        r["arrivals"] = [a - start for a in r["arrivals"]]
    return records, wall


# ---- the figures ------------------------------------------------------------------------------


def percentile(values, q):
    """Linear interpolation between the closest ranks (numpy's default); None without values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def request_tokens(rec):
    usage = rec.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"], "usage"
    return len(rec["arrivals"]), "content chunks"


def prompt_cache(rec):
    """(prompt tokens, cached tokens, source) as the server reported them: usage.prompt_tokens and
    usage.prompt_tokens_details.cached_tokens (both servers), else llama-server's timings (prompt_n
    computed + cache_n cached), else (prompt tokens or None, None, "n/a")."""
    usage = rec.get("usage") or {}
    prompt, cached = usage.get("prompt_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(prompt, int) and isinstance(cached, int):
        return prompt, cached, "usage"
    timings = rec.get("timings") or {}
    if isinstance(timings.get("prompt_n"), int) and isinstance(timings.get("cache_n"), int):
        return timings["prompt_n"] + timings["cache_n"], timings["cache_n"], "timings"
    return (prompt if isinstance(prompt, int) else None), None, "n/a"


def ttft_ms(rec):
    return 1000 * (rec["arrivals"][0] - rec["sent"]) if rec["arrivals"] else None


def ttft_figures(complete):
    ttft = [t for t in map(ttft_ms, complete) if t is not None]
    return {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": mean(ttft)}


def turn_figures(complete, turns):
    """The multi-turn figures: TTFT over turn 1 and over the later turns apart, the mean cached
    share of the prompt over the later turns, and per turn its means."""
    later = [r for r in complete if r["turn"] >= 2]
    caches = [prompt_cache(r) for r in later]
    shares = [c / p for p, c, _ in caches if c is not None and p]
    by_turn = []
    for t in range(1, turns + 1):
        these = [r for r in complete if r["turn"] == t]
        counts = [prompt_cache(r) for r in these]
        by_turn.append(
            {
                "turn": t,
                "complete": len(these),
                "ttft_ms": ttft_figures(these),
                "mean_prompt_tokens": mean([p for p, _, _ in counts if p is not None]),
                "mean_cached_tokens": mean([c for _, c, _ in counts if c is not None]),
            }
        )
    return {
        "turns": turns,
        "ttft_ms_turn1": ttft_figures([r for r in complete if r["turn"] == 1]),
        "ttft_ms_later_turns": ttft_figures(later),
        "cached_share_later_turns": mean(shares),
        "cached_tokens_source": "/".join(sorted({src for _, _, src in caches})) or None,
        "by_turn": by_turn,
    }


def summarize(records, wall, total, turns=None):
    """The figures of one wave; with `turns` (the multi-turn workload), turn_figures too."""
    sent = [r for r in records if r is not None]
    outcomes = {k: sum(r["outcome"] == k for r in sent) for k in OUTCOMES}
    complete = [r for r in sent if r["outcome"] == "complete"]
    counted = [request_tokens(r) for r in complete]
    sources = sorted({s for _, s in counted})
    tokens = sum(n for n, _ in counted)
    itl = [1000 * (b - a) for r in complete for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    finish = {}
    for r in complete:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    prompt = [r["usage"]["prompt_tokens"] for r in complete if (r.get("usage") or {}).get("prompt_tokens")]
    summary = {
        "requests": total,
        "sent": len(sent),
        "not_sent": total - len(sent),
        "outcomes": outcomes,
        "errors": len(sent) - outcomes["complete"],
        "wall_s": wall,
        "requests_per_s": len(complete) / wall if wall else None,
        "tokens": tokens,
        "tokens_source": "/".join(sources) if sources else None,
        "content_chunks": sum(len(r["arrivals"]) for r in complete),
        "tokens_per_s": tokens / wall if wall else None,
        "content_chunks_per_s": sum(len(r["arrivals"]) for r in complete) / wall if wall else None,
        "ttft_ms": ttft_figures(complete),
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99), "mean": mean(itl)},
        "finish_reasons": finish,
        "mean_prompt_tokens_reported": mean(prompt),
        "error_messages": sorted({r["error"] for r in sent if r["error"]})[:10],
    }
    if turns:
        summary["multi_turn"] = turn_figures(complete, turns)
    return summary


def mean(values):
    return statistics.mean(values) if values else None


def reply_key(rec):
    """What a reply answers: on turn 1 its message (after the same system message, if any); on a
    later turn its conversation's history too, which the earlier replies make."""
    return rec["message"] if rec["turn"] == 1 else (rec["conversation"], rec["turn"])


def same_text(rows):
    """Per N: for each server, its complete requests whose text equals the first complete reply
    to the same prompt (reply_key) of the other server (the first of the others, when more than
    two ran; `against` names it)."""
    by_n = {}
    for row in rows:
        by_n.setdefault(row["concurrency"], []).append(row)
    for group in by_n.values():
        if len(group) < 2:
            continue
        replies = []
        for row in group:
            first = {}
            for r in row["records"]:
                if r and r["outcome"] == "complete":
                    first.setdefault(reply_key(r), r["text"])
            replies.append(first)
        for i, row in enumerate(group):
            j = 1 if i == 0 else 0
            other = replies[j]
            ok = [r for r in row["records"] if r and r["outcome"] == "complete" and reply_key(r) in other]
            row["summary"]["same_text"] = {
                "equal": sum(r["text"] == other[reply_key(r)] for r in ok),
                "compared": len(ok),
                "against": group[j]["server"],
            }


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(rows):
    """A Markdown table, a row per N and server; with the multi-turn figures, TTFT is given over
    turn 1 and over the later turns apart, with the cached share of the later turns' prompts."""

    def errors(s):
        return ", ".join(f"{k} {v}" for k, v in s["outcomes"].items() if k != "complete" and v) or "0"

    def same(s):
        same = s.get("same_text")
        if not same:
            return "-"
        return f"{same['equal']}/{same['compared']}" + (f" ({same['against']})" if many_servers else "")

    def share(m):
        if m["cached_share_later_turns"] is None:
            return "n/a"
        return f"{100 * m['cached_share_later_turns']:.0f}% ({m['cached_tokens_source']})"

    multi = any("multi_turn" in row["summary"] for row in rows)
    many_servers = len({row["server"] for row in rows}) > 2
    ttft = [
        ("TTFT p50 ms", lambda s: fmt(s["ttft_ms"]["p50"], 0)),
        ("TTFT p99 ms", lambda s: fmt(s["ttft_ms"]["p99"], 0)),
    ]
    if multi:
        ttft = [
            ("TTFT turn 1 p50 ms", lambda s: fmt(s["multi_turn"]["ttft_ms_turn1"]["p50"], 0)),
            ("TTFT turn 1 p99 ms", lambda s: fmt(s["multi_turn"]["ttft_ms_turn1"]["p99"], 0)),
            ("TTFT turns 2+ p50 ms", lambda s: fmt(s["multi_turn"]["ttft_ms_later_turns"]["p50"], 0)),
            ("TTFT turns 2+ p99 ms", lambda s: fmt(s["multi_turn"]["ttft_ms_later_turns"]["p99"], 0)),
            ("cached, turns 2+", lambda s: share(s["multi_turn"])),
        ]
    columns = [
        ("requests/s", lambda s: fmt(s["requests_per_s"], 2)),
        ("tokens/s", lambda s: fmt(s["tokens_per_s"])),
        ("tokens", lambda s: s["tokens_source"] or "-"),
        ("chunks/s", lambda s: fmt(s["content_chunks_per_s"])),
        *ttft,
        ("ITL p50 ms", lambda s: fmt(s["itl_ms"]["p50"], 1)),
        ("ITL p99 ms", lambda s: fmt(s["itl_ms"]["p99"], 1)),
        ("complete", lambda s: f"{s['outcomes']['complete']}/{s['requests']}"),
        ("errors", errors),
        ("not sent", lambda s: str(s["not_sent"])),
        ("same text", same),
    ]
    print("| N | server | " + " | ".join(h for h, _ in columns) + " |")
    print("| --- " * (2 + len(columns)) + "|")
    for row in rows:
        s = row["summary"]
        print(f"| {row['concurrency']} | {row['server']} | " + " | ".join(cell(s) for _, cell in columns) + " |")


# ---- the run ----------------------------------------------------------------------------------


def prompt_lengths(folder, workload, conversations):
    """Token counts of the conversations' last turns through the folder's chat template (what
    go-sse renders) with the earlier replies empty, to size the caches; and of the system message's
    part of them (0 without one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))

    def count(messages, generation_prompt=True):
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
        return len(ids["input_ids"] if isinstance(ids, dict) else ids)

    system = count(workload.conversation(0)[:1], False) if workload.system else 0
    return [count(workload.conversation(k)) for k in range(conversations)], system


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--workload", choices=["single", "multi-turn"], default="single")
    ap.add_argument("--turns", type=int, default=4, help="user turns per conversation (multi-turn)")
    ap.add_argument(
        "--requests", type=int, help="requests per N (default: 2 N; multi-turn: N T, a conversation per client)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--servers",
        nargs="+",
        choices=SERVERS,
        help="default: libpipe-noreuse llamacpp (both without a prompt cache); multi-turn: libpipe libpipe-noreuse llamacpp",
    )
    ap.add_argument("--time-limit", type=float, default=600, help="seconds per N and server after which none starts")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds one request may take")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    ap.add_argument("--llamacpp-cache-prompt", action="store_true", help="leave llama-server's prompt cache on")
    ap.add_argument("--split", help="go-sse's -split (default: model.layers.<half the layers>:begin)")
    ap.add_argument("--prefix", default=str(ROOT / "build" / "stage"), help="the libpipe install go-sse builds on")
    ap.add_argument("--go-sse", help="a built go-sse binary (default: build it against --prefix)")
    ap.add_argument("--work", help="folder for the skeletons, the go-sse binary and the servers' logs")
    ap.add_argument("--out", help="write every figure and request as JSON")
    args = ap.parse_args()
    # A TERM (a timeout's, a job's end) unwinds like an interrupt, so that the servers' process
    # groups are stopped in the finally blocks instead of left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if min(args.concurrency) < 1 or (args.requests is not None and args.requests < 1) or args.max_tokens < 1:
        ap.error("--concurrency, --requests and --max-tokens must be at least 1")
    multi = args.workload == "multi-turn"
    if multi and args.turns < 1:
        ap.error("--turns must be at least 1")
    if multi and args.requests is not None and args.requests % args.turns:
        ap.error("--requests must be a multiple of --turns (whole conversations)")
    if multi:
        workload = Workload(turns=args.turns, system=SYSTEM, max_tokens=args.max_tokens)
    else:
        workload = Workload(max_tokens=args.max_tokens)
    if args.servers is None:
        args.servers = list(SERVERS) if multi else ["libpipe-noreuse", "llamacpp"]
    args.servers = list(dict.fromkeys(args.servers))
    # llama-server keeps its prompt cache for the multi-turn workload: it is what it would run with.
    cache_prompt = args.llamacpp_cache_prompt or multi

    def conversations(n):
        return (args.requests or (n * args.turns if multi else 2 * n)) // workload.turns

    from smollm2 import gguf_path, smollm2_folder

    work = Path(args.work or tempfile.mkdtemp(prefix="http-load-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    folder = smollm2_folder()
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    split = args.split or f"model.layers.{layers // 2}:begin"
    # Single: every message once. Multi-turn: each conversation's last turn, the earlier replies
    # empty; a reply takes up to max_tokens (and REPLY_SLACK) more.
    count = max(map(conversations, args.concurrency)) if multi else len(MESSAGES)
    lengths, system_tokens = prompt_lengths(folder, workload, count)
    longest = max(lengths) + (workload.turns - 1) * (args.max_tokens + REPLY_SLACK)
    max_len = 64 * math.ceil((longest + args.max_tokens) / 64)
    prefix = Path(args.prefix).resolve()
    settings = {
        "workload": args.workload,
        "concurrency": args.concurrency,
        "requests": args.requests or ("N T" if multi else "2 N"),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "time_limit_s": args.time_limit,
        "request_timeout_s": args.request_timeout,
        "prompt_tokens": {"min": min(lengths), "mean": statistics.mean(lengths), "max": max(lengths)},
        "machine": machine(),
    }
    if multi:
        settings["turns"] = workload.turns
        settings["system_message"] = SYSTEM
        settings["system_tokens"] = system_tokens
        settings["prompt_tokens"]["note"] = "the last turn's, the earlier replies empty"
        settings["longest_prompt_bound"] = longest
    print(f"http_load: {settings['machine']}", flush=True)
    if multi:
        what = (
            f"multi-turn: conversations of {workload.turns} user turns after a system message of {system_tokens} "
            f"tokens; the last turn {min(lengths)}-{max(lengths)} prompt tokens without the replies"
        )
    else:
        what = f"{len(MESSAGES)} chat messages of {min(lengths)}-{max(lengths)} prompt tokens"
    print(
        f"http_load: SmolLM2-135M-Instruct float32 ({folder}); {what}, max_tokens {args.max_tokens}, "
        f"temperature 0; work folder {work}",
        flush=True,
    )
    servers = {}
    try:
        if {"libpipe", "libpipe-noreuse"} & set(args.servers):
            binary = Path(args.go_sse).resolve() if args.go_sse else build_go_sse(prefix, work)
            go_sse = {"binary": str(binary), "prefix": str(prefix), "split": split, "max_seq_len": max_len}
            for name, env in (("libpipe", {}), ("libpipe-noreuse", {"LIBPIPE_PREFIX_REUSE": "0"})):
                if name in args.servers:
                    servers[name] = {**go_sse, "env": env}
            print(f"http_load: go-sse {binary} (libpipe at {prefix}), -split {split}, caches of {max_len}", flush=True)
        if "llamacpp" in args.servers:
            import llamacpp

            bin_dir = llamacpp.build()
            gguf = llamacpp.f32_gguf(bin_dir, gguf_path())
            servers["llamacpp"] = {
                "package": f"{llamacpp.PACKAGE}=={llamacpp.VERSION}",
                "model": gguf.name,
                "threads": args.llamacpp_threads,
                "cache_prompt": cache_prompt,
            }
            print(
                f"http_load: llama-server {llamacpp.PACKAGE} {llamacpp.VERSION} on {gguf.name}, "
                f"-t/-tb {args.llamacpp_threads}, prompt cache {'on' if cache_prompt else 'off'}",
                flush=True,
            )
    except (LoadError, RuntimeError) as e:
        sys.exit(f"http_load: error: {e}")

    rows = []
    for n in args.concurrency:
        total = conversations(n) * workload.turns
        for name in args.servers:
            log = work / f"{name}-N{n}.log"
            server = None
            try:
                if name in ("libpipe", "libpipe-noreuse"):
                    decoder = work / f"smollm2-{n}slots-{max_len}.pt"
                    if not decoder.is_file():
                        from libpipe.export_llm import export_llm

                        export_llm(str(folder), str(decoder), max_seq_len=max_len, max_batch=n, dtype="fp32")
                    binary, env = Path(servers[name]["binary"]), servers[name]["env"]
                    server = start_go_sse(binary, decoder, folder, split, prefix, log, env)
                    command = [*(f"{k}={v}" for k, v in env.items()), *server.cmd]
                else:
                    ctx = llamacpp.context_size([n], longest + 16, args.max_tokens)  # 16: another template's extra
                    server = start_llama_server(bin_dir, gguf, n, ctx, args.llamacpp_threads, cache_prompt, log)
                    command = server.cmd
                warm_up(server.port, n, args.request_timeout)
                records, wall = wave(server.port, n, conversations(n), workload, args.time_limit, args.request_timeout)
            except LoadError as e:
                print(f"http_load: {name} at N = {n}: {e}", file=sys.stderr, flush=True)
                rows.append({"concurrency": n, "server": name, "error": str(e)})
                continue
            finally:
                if server is not None:
                    server.stop()
            summary = summarize(records, wall, total, workload.turns if multi else None)
            rows.append(
                {
                    "concurrency": n,
                    "server": name,
                    "command": command,
                    "log": str(log),
                    "summary": summary,
                    "records": records,
                }
            )
            print(json.dumps({"concurrency": n, "server": name, **summary}), flush=True)

    measured = [r for r in rows if "summary" in r]
    same_text(measured)
    print()
    print_table(measured)
    if args.out:
        for r in measured:
            for rec in r["records"]:
                if rec is not None:
                    rec["ttft_ms"] = ttft_ms(rec)
                    rec["prompt_tokens"], rec["cached_tokens"], rec["cached_tokens_source"] = prompt_cache(rec)
                    rec["content_chunks"] = len(rec.pop("arrivals"))
        with open(args.out, "w") as f:
            json.dump({"settings": settings, "servers": servers, "rows": rows}, f, indent=1)
            f.write("\n")
    failed = [r for r in rows if "error" in r] + [
        r for r in measured if r["summary"]["errors"] or r["summary"]["not_sent"]
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
