"""Load over HTTP: libpipe's go-sse service against llama.cpp's llama-server, on SmolLM2-135M-Instruct.

Both servers speak OpenAI's /v1/chat/completions with streaming (server-sent events) and run the
same float32 weights: go-sse (pipe-serve, serve/) serves the Hugging Face folder of
tests/models/smollm2.py through a decoder skeleton that libpipe.export_llm writes with N cache
slots; llama-server (bench/llamacpp.py builds it) serves the F32 GGUF dequantized from the same
GGUF, with -np N slots, -c N times a slot's context, -t/-tb --llamacpp-threads threads, no web UI
and, unless --llamacpp-cache-prompt, no prompt cache (go-sse has none: a prompt cached from an
earlier request, or the system prompt that every request shares, would spare llama.cpp prefill
work that libpipe does). Each server is started afresh for each N, on the loopback, and stopped
(its process group) before the next.

For each N (--concurrency, default 1 8 32) and server: N clients, each sending one request after
another (a closed loop), until --requests requests (default 2 N) were sent or --time-limit seconds
passed (no request starts after it; one in flight gets --request-timeout). The requests are real
chat messages (bench/generate.py's MESSAGES, in turn; one user turn each, no system message: both
servers render the model's own chat template), max_tokens --max-tokens (64), temperature 0,
stream true, stream_options.include_usage true (both servers then end the stream with a chunk
holding the usage). N short requests at once warm each server up first and are not counted.

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
  same message at the same N (greedy on the same weights; batching may flip a near tie).

    python bench/http_load.py [--concurrency 1 8 32] [--requests R] [--max-tokens 64]
                              [--servers libpipe llamacpp] [--llamacpp-threads 2] [--split POINT]
                              [--prefix build/stage | --go-sse BIN] [--work DIR] [--out FILE]

Run with the project's virtualenv python (scripts/env.sh: LIBPIPE_PYTHON) after scripts/build.sh;
go-sse (pipe-serve, serve/) is built against the libpipe installed at --prefix (default build/stage,
which ctest's bindings_stage fills; or `cmake --install build --prefix DIR`).
The client runs in this process on the same cores as the servers (threads, the standard library).
Exit status 1 when some request did not complete.
"""

import argparse
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


def start_go_sse(binary, decoder, folder, split, prefix, log):
    env = dict(os.environ)
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


def chat_body(message, max_tokens):
    return {
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_request(port, body, timeout):
    """One streaming chat request: its outcome and timings (perf_counter seconds)."""
    rec = {"outcome": None, "status": None, "error": None, "finish_reason": None, "usage": None, "done": False}
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
    records, _ = wave(port, clients, clients, 4, timeout, timeout)
    bad = [r for r in records if r is None or r["outcome"] != "complete"]
    if bad:
        r = bad[0] or {"outcome": "not sent", "error": None}
        raise LoadError(f"a warm-up request did not complete: {r['outcome']}: {r['error']}")


def wave(port, clients, total, max_tokens, time_limit, timeout):
    """`clients` threads send `total` requests in all, one after another each, message i of
    MESSAGES (in turn) for request i; none starts after `time_limit` s. (records, wall seconds)."""
    records = [None] * total
    lock = threading.Lock()
    state = {"next": 0}
    start = time.perf_counter()
    stop_at = start + time_limit

    def client():
        while True:
            with lock:
                i = state["next"]
                if i >= total or time.perf_counter() > stop_at:
                    return
                state["next"] = i + 1
            m = i % len(MESSAGES)
            rec = stream_request(port, chat_body(MESSAGES[m], max_tokens), timeout)
            rec["index"], rec["message"] = i, m
            records[i] = rec

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


def summarize(records, wall, total):
    sent = [r for r in records if r is not None]
    outcomes = {k: sum(r["outcome"] == k for r in sent) for k in OUTCOMES}
    complete = [r for r in sent if r["outcome"] == "complete"]
    counted = [request_tokens(r) for r in complete]
    sources = sorted({s for _, s in counted})
    tokens = sum(n for n, _ in counted)
    ttft = [1000 * (r["arrivals"][0] - r["sent"]) for r in complete if r["arrivals"]]
    itl = [1000 * (b - a) for r in complete for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    finish = {}
    for r in complete:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    prompt = [r["usage"]["prompt_tokens"] for r in complete if (r.get("usage") or {}).get("prompt_tokens")]
    return {
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
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": mean(ttft)},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99), "mean": mean(itl)},
        "finish_reasons": finish,
        "mean_prompt_tokens_reported": mean(prompt),
        "error_messages": sorted({r["error"] for r in sent if r["error"]})[:10],
    }


def mean(values):
    return statistics.mean(values) if values else None


def same_text(rows):
    """Per N: for each server, its complete requests whose text equals the other server's first
    complete reply to the same message."""
    by_n = {}
    for row in rows:
        by_n.setdefault(row["concurrency"], []).append(row)
    for group in by_n.values():
        if len(group) != 2:
            continue
        replies = []
        for row in group:
            first = {}
            for r in row["records"]:
                if r and r["outcome"] == "complete":
                    first.setdefault(r["message"], r["text"])
            replies.append(first)
        for row, other in zip(group, reversed(replies)):
            ok = [r for r in row["records"] if r and r["outcome"] == "complete" and r["message"] in other]
            row["summary"]["same_text"] = {
                "equal": sum(r["text"] == other[r["message"]] for r in ok),
                "compared": len(ok),
            }


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(rows):
    print(
        "| N | server | requests/s | tokens/s | tokens | chunks/s | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms | complete | errors | not sent | same text |"
    )
    print("| --- " * 14 + "|")
    for row in rows:
        s = row["summary"]
        errors = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items() if k != "complete" and v) or "0"
        same = s.get("same_text")
        same_cell = f"{same['equal']}/{same['compared']}" if same else "-"
        print(
            f"| {row['concurrency']} | {row['server']} | {fmt(s['requests_per_s'], 2)} | {fmt(s['tokens_per_s'])} "
            f"| {s['tokens_source'] or '-'} | {fmt(s['content_chunks_per_s'])} "
            f"| {fmt(s['ttft_ms']['p50'], 0)} | {fmt(s['ttft_ms']['p99'], 0)} "
            f"| {fmt(s['itl_ms']['p50'], 1)} | {fmt(s['itl_ms']['p99'], 1)} "
            f"| {s['outcomes']['complete']}/{s['requests']} | {errors} | {s['not_sent']} "
            f"| {same_cell} |"
        )


# ---- the run ----------------------------------------------------------------------------------


def prompt_lengths(folder):
    """Token counts of MESSAGES as one user turn each through the folder's chat template (what
    go-sse renders), to size the caches."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for text in MESSAGES:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(len(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, help="requests per N (default: 2 N)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--servers", nargs="+", choices=["libpipe", "llamacpp"], default=["libpipe", "llamacpp"])
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

    from smollm2 import gguf_path, smollm2_folder

    work = Path(args.work or tempfile.mkdtemp(prefix="http-load-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    folder = smollm2_folder()
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    split = args.split or f"model.layers.{layers // 2}:begin"
    lengths = prompt_lengths(folder)
    longest = max(lengths)
    max_len = 64 * math.ceil((longest + args.max_tokens) / 64)
    prefix = Path(args.prefix).resolve()
    settings = {
        "concurrency": args.concurrency,
        "requests": args.requests or "2 N",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "time_limit_s": args.time_limit,
        "request_timeout_s": args.request_timeout,
        "prompt_tokens": {"min": min(lengths), "mean": statistics.mean(lengths), "max": longest},
        "machine": machine(),
    }
    print(f"http_load: {settings['machine']}", flush=True)
    print(
        f"http_load: SmolLM2-135M-Instruct float32 ({folder}); {len(MESSAGES)} chat messages of "
        f"{min(lengths)}-{longest} prompt tokens, max_tokens {args.max_tokens}, temperature 0; work folder {work}",
        flush=True,
    )
    servers = {}
    try:
        if "libpipe" in args.servers:
            binary = Path(args.go_sse).resolve() if args.go_sse else build_go_sse(prefix, work)
            servers["libpipe"] = {"binary": str(binary), "prefix": str(prefix), "split": split, "max_seq_len": max_len}
            print(f"http_load: go-sse {binary} (libpipe at {prefix}), -split {split}, caches of {max_len}", flush=True)
        if "llamacpp" in args.servers:
            import llamacpp

            bin_dir = llamacpp.build()
            gguf = llamacpp.f32_gguf(bin_dir, gguf_path())
            servers["llamacpp"] = {
                "package": f"{llamacpp.PACKAGE}=={llamacpp.VERSION}",
                "model": gguf.name,
                "threads": args.llamacpp_threads,
                "cache_prompt": args.llamacpp_cache_prompt,
            }
            print(
                f"http_load: llama-server {llamacpp.PACKAGE} {llamacpp.VERSION} on {gguf.name}, "
                f"-t/-tb {args.llamacpp_threads}, prompt cache {'on' if args.llamacpp_cache_prompt else 'off'}",
                flush=True,
            )
    except (LoadError, RuntimeError) as e:
        sys.exit(f"http_load: error: {e}")

    rows = []
    for n in args.concurrency:
        total = args.requests or 2 * n
        for name in args.servers:
            log = work / f"{name}-N{n}.log"
            server = None
            try:
                if name == "libpipe":
                    decoder = work / f"smollm2-{n}slots-{max_len}.pt"
                    if not decoder.is_file():
                        from libpipe.export_llm import export_llm

                        export_llm(str(folder), str(decoder), max_seq_len=max_len, max_batch=n, dtype="fp32")
                    server = start_go_sse(Path(servers["libpipe"]["binary"]), decoder, folder, split, prefix, log)
                    command = server.cmd
                else:
                    ctx = llamacpp.context_size([n], longest + 16, args.max_tokens)  # 16: another template's extra
                    server = start_llama_server(
                        bin_dir, gguf, n, ctx, args.llamacpp_threads, args.llamacpp_cache_prompt, log
                    )
                    command = server.cmd
                warm_up(server.port, n, args.request_timeout)
                records, wall = wave(server.port, n, total, args.max_tokens, args.time_limit, args.request_timeout)
            except LoadError as e:
                print(f"http_load: {name} at N = {n}: {e}", file=sys.stderr, flush=True)
                rows.append({"concurrency": n, "server": name, "error": str(e)})
                continue
            finally:
                if server is not None:
                    server.stop()
            summary = summarize(records, wall, total)
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
                    rec["ttft_ms"] = 1000 * (rec["arrivals"][0] - rec["sent"]) if rec["arrivals"] else None
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
