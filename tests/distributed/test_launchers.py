"""The same `pipe` command on every rank of a launch, as a torch.distributed script: the real torchrun of
the project's virtualenv, and an srun-shaped environment set by the test (SLURM_PROCID, SLURM_NTASKS,
SLURM_JOB_NODELIST, ...). Rank 0 drives, hosts the store and writes the outputs; the other ranks serve their
stages and exit 0 once the session is over. Outputs equal eager PyTorch (the fixtures' expected outputs);
`pipe worker` under a launcher serves a driver outside it; an environment that is half set is refused
naming the variables."""

import json
import os
import socket
import subprocess
import sys

import torch
from disthelp import PIPE, RUN_TIMEOUT_S, assert_one_line_error, seed
from safetensors.torch import load_file

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "LIBPIPE_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port_pair():
    """A port p such that p and p + 1 are free now (torchrun takes p, libpipe's store p + 1)."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def assert_outputs_equal(out, expected, tol=1e-5):
    got, want = load_file(out), load_file(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


def torchrun(ranks, *pipe_args, env=None):
    port = free_port_pair()
    cmd = [
        TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--no-python",
        PIPE,
        *map(str, pipe_args),
    ]
    return subprocess.run(cmd, env=env or clean_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_torchrun_runs_pipe_run_on_every_rank(tmp_path):
    out = tmp_path / "out.safetensors"
    r = torchrun(
        3,
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        2,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert_outputs_equal(out, seed("multi_mlp.expected.safetensors"))
    assert r.stdout.count("pipe: ran") == 1, r.stdout  # rank 0 alone reports and writes


def test_devices_auto_under_torchrun_lets_each_rank_place_its_own_stages(tmp_path):
    """--devices auto over processes: each rank takes its own GPU (cuda:LOCAL_RANK) and tells the driver when it
    joins; a rank that sees none, as here without a GPU, runs its stages on the CPU. Outputs equal eager."""
    out = tmp_path / "out.safetensors"
    r = torchrun(
        2,
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        out,
        "--devices",
        "auto",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert_outputs_equal(out, seed("multi_mlp.expected.safetensors"))


def test_torchrun_runs_pipe_bench_on_every_rank():
    r = torchrun(
        2,
        "bench",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--requests",
        4,
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["samples_per_s"] > 0, r.stdout


def test_torchrun_runs_pipe_generate_on_every_rank():
    models = os.environ["PIPE_TEST_MODELS"]
    expected = json.load(open(os.path.join(models, "tiny_decoder.expected.json")))
    args = ["generate", os.path.join(models, "tiny_decoder.pt"), "--split-at", "model.layers.1:begin", "--json"]
    for prompt in expected["prompts"][:3]:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-new-tokens", expected["max_new_tokens"]]
    r = torchrun(2, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["outputs"] == expected["greedy"][:3]  # transformers' greedy tokens
    assert out["peak_rss_mib"]["driver"] > 0


def srun_env(rank, ntasks, port, **extra):
    return clean_env(
        SLURM_PROCID=rank,
        SLURM_NTASKS=ntasks,
        SLURM_LOCALID=rank,
        SLURM_TASKS_PER_NODE=ntasks,
        SLURM_JOB_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1",  # the job script's, as torch.distributed users set it under srun
        MASTER_PORT=port,
        **extra,
    )


def test_an_srun_shaped_environment_runs_pipe_run_on_every_rank(tmp_path):
    port = free_port_pair()
    out = tmp_path / "out.safetensors"
    args = [
        PIPE,
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        out,
    ]
    ranks = [
        subprocess.Popen(
            list(map(str, args)),
            env=srun_env(r, 3, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    results = [p.communicate(timeout=RUN_TIMEOUT_S) for p in ranks]
    for p, (stdout, stderr) in zip(ranks, results):
        assert p.returncode == 0, stdout + stderr
    assert_outputs_equal(out, seed("multi_mlp.expected.safetensors"))


def test_pipe_worker_under_a_launcher_serves_a_driver_outside_it(tmp_path):
    # Two `pipe worker`s launched as ranks 0 and 1 of their own launch serve ranks 1 and 2 of a driver
    # started apart, whose store they find in LIBPIPE_STORE.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    store = f"127.0.0.1:{store_port}"
    out = tmp_path / "out.safetensors"
    driver = subprocess.Popen(
        list(
            map(
                str,
                [
                    PIPE,
                    "run",
                    seed("multi_mlp.traced.pt"),
                    "--input",
                    seed("multi_mlp.inputs.safetensors"),
                    "--output",
                    out,
                    "--world-size",
                    3,
                    "--store",
                    store,
                ],
            )
        ),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    port = free_port_pair()
    workers = [
        subprocess.Popen(
            [PIPE, "worker"],
            env=clean_env(
                RANK=r,
                WORLD_SIZE=2,
                LOCAL_RANK=r,
                LOCAL_WORLD_SIZE=2,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                LIBPIPE_STORE=store,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    stdout, stderr = driver.communicate(timeout=RUN_TIMEOUT_S)
    assert driver.returncode == 0, stdout + stderr
    for w in workers:
        w_out, w_err = w.communicate(timeout=RUN_TIMEOUT_S)
        assert w.returncode == 0, w_out + w_err
    assert_outputs_equal(out, seed("multi_mlp.expected.safetensors"))


def test_a_half_set_environment_is_refused_naming_the_variables(tmp_path):
    args = [
        PIPE,
        "run",
        seed("multi_mlp.traced.pt"),
        "--input",
        seed("multi_mlp.inputs.safetensors"),
        "--output",
        str(tmp_path / "out.safetensors"),
    ]
    r = subprocess.run(args, env=clean_env(RANK=1), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert_one_line_error(r, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set")
    r = subprocess.run(
        args,
        env=clean_env(RANK=4, WORLD_SIZE=4, MASTER_ADDR="127.0.0.1", MASTER_PORT=1234),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert_one_line_error(r, "RANK=4 is not below WORLD_SIZE=4")
    # Flags win over the environment: an explicit --processes runs as asked.
    r = subprocess.run(
        [*args, "--processes", "2"],
        env=clean_env(RANK=1),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr
