"""Strangers at a session's door, through the `pipe` tool: while a driver waits for its worker, a process
without the session's token, one with another token, and one that speaks another protocol try to join; each
is refused (the driver logs it) and learns nothing, and the real worker then joins and the run's outputs
equal eager PyTorch. `--processes` needs no token from the user: it makes one for its own workers."""

import os
import socket

from disthelp import JOIN_MS, RUN_TIMEOUT_S, error_lines, run_pipe, seed, start_driver, start_worker
from safetensors.torch import load_file
from storeport import CLI_LINE

import torch


def env_with_token(token):
    env = dict(os.environ)
    if token is None:
        env.pop("LIBPIPE_TOKEN", None)
    else:
        env["LIBPIPE_TOKEN"] = token
    return env


def test_strangers_are_refused_while_the_session_starts_and_runs(tmp_path):
    out = tmp_path / "out.safetensors"
    driver, store = start_driver(
        "run",
        seed("example_code.traced.pt"),
        "--input",
        seed("example_code.inputs.safetensors"),
        "--output",
        out,
        "--world-size",
        2,
        "--comm-timeout-ms",
        JOIN_MS,
    )
    host, port = store.rsplit(":", 1)
    # Another protocol (an HTTP request, a c10d TCPStore client's first bytes): closed unanswered.
    for probe in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x3c\x85\xf7\xce" * 4):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(probe)
            s.settimeout(30)
            assert s.recv(1024) == b"", "the store answered a stranger"
    # Workers without the token, and with another one: refused, saying why; the session goes on.
    no_token = start_worker(1, 2, store, comm_ms=JOIN_MS, env=env_with_token(None)).wait(RUN_TIMEOUT_S)
    assert no_token.returncode != 0
    assert any("LIBPIPE_TOKEN" in line for line in error_lines(no_token.stderr)), no_token.stderr
    wrong = start_worker(1, 2, store, comm_ms=JOIN_MS, env=env_with_token("not the session's token at all")).wait(
        RUN_TIMEOUT_S
    )
    assert wrong.returncode != 0
    assert any("does not hold this session's token" in line for line in error_lines(wrong.stderr)), wrong.stderr
    # The real worker joins, and the run is what eager PyTorch computes.
    worker = start_worker(1, 2, store, comm_ms=JOIN_MS)
    driver.wait(RUN_TIMEOUT_S)
    worker.wait(RUN_TIMEOUT_S)
    assert driver.returncode == 0, driver.stderr
    assert worker.returncode == 0, worker.stderr
    got, want = load_file(out), load_file(seed("example_code.expected.safetensors"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    # The driver printed its store line and refused the strangers; no error.
    assert CLI_LINE.match(driver.stderr.splitlines()[0]), driver.stderr
    assert "refused a connection" in driver.stderr, driver.stderr
    assert not error_lines(driver.stderr), driver.stderr


def test_local_processes_need_no_token_from_the_user(tmp_path):
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        out,
        "--processes",
        2,
        env=env_with_token(None),
    )
    assert result.returncode == 0, result.stderr
    got, want = load_file(out), load_file(seed("multi_mlp.expected.safetensors"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_a_driver_without_a_token_says_how_to_give_one(tmp_path):
    result = run_pipe(
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        tmp_path / "out.safetensors",
        "--world-size",
        2,
        "--store",
        "127.0.0.1:0",
        env=env_with_token(None),
    )
    assert result.returncode != 0
    (line,) = error_lines(result.stderr)
    assert "LIBPIPE_TOKEN" in line and "--token-file" in line, line
