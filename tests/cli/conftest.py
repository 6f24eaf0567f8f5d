"""Shared helpers for the `pipe` command-line tests: where the tool and the fixtures are, how to
run the tool, and what a refused command must look like."""

import os
import subprocess

PIPE = os.environ["PIPE_CLI"]
MODELS = os.environ["PIPE_TEST_MODELS"]
# Under the sanitizers (tests/CMakeLists.txt sets LIBPIPE_SANITIZED for these suites) every pipe process is
# instrumented and several times slower: the model matrices run a representative few there (each suite says
# which), and the plain suite runs them all.
SANITIZED = os.environ.get("LIBPIPE_SANITIZED") == "1"


def run_pipe(*args, timeout=300):
    return subprocess.run([PIPE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *needles):
    """Non-zero exit, exactly one line on stderr starting 'pipe: error: ', naming each needle."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipe: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
