"""The Python binding with stages on a GPU: CUDA torch tensors in and out through DLPack without
copies, CUDA streams ordered with the caller's, each stage's weights only on its own device, a
stage running out of GPU memory failing only its call, and many callers at once."""

import threading

import libpipe
import pytest
import torch
from conftest import assert_close_outputs, model
from libpipe import pipe_split

TOL = 1e-4
GPU = torch.device("cuda:0")


def session_for(case, **options):
    plan = libpipe.Model.load(case.path).split(case.split or None)
    return plan, plan.session(**options)


def gpu_inputs(case):
    return {k: v.to(GPU) for k, v in case.inputs.items()}


@pytest.mark.parametrize("name", ["example_code.traced", "multi_mlp.traced", "tiny_llama", "hf_llama"])
def test_cuda_tensors_in_and_out(name):
    case = model(name)
    _, session = session_for(case, microbatches=2, devices="cuda:0", outputs="device")
    out = session.run(**gpu_inputs(case))
    for t in out.values():
        assert t.device == GPU
    assert_close_outputs(out, case.eager_on_gpu(), TOL)


def test_outputs_are_adopted_without_a_copy():
    case = model("multi_mlp.traced")
    _, session = session_for(case, devices="cuda:0", outputs="device")
    out = session.run(**gpu_inputs(case), output_type="dlpack")["output"]
    address = out.data_ptr
    adopted = torch.from_dlpack(out)
    assert adopted.device == GPU and adopted.data_ptr() == address


def test_cuda_inputs_to_a_cpu_pipeline():
    case = model("param_alias.scripted")
    _, session = session_for(case, microbatches=2)
    out = session.run(**gpu_inputs(case))
    assert out["output"].device.type == "cpu"
    assert_close_outputs(out, case.eager_on_gpu(), TOL)


@pytest.mark.parametrize("devices", ["cpu,cuda:0", "cuda:0,cpu"])
def test_outputs_stay_on_the_last_stages_device(devices):
    case = model("tuple_output.traced")
    _, session = session_for(case, devices=devices, outputs="device")
    out = session.run(**gpu_inputs(case))
    last = devices.split(",")[-1]
    assert all(t.device.type == torch.device(last).type for t in out.values())
    assert_close_outputs(out, case.eager_on_gpu(), TOL)


def test_inputs_written_on_a_side_stream_are_waited_for():
    # The input is still being computed on the caller's current stream (a side stream) when the
    # call starts; libpipe must wait for that work, as PyTorch would.
    case = model("multi_mlp.traced")
    _, session = session_for(case, microbatches=2, devices="cuda:0,cpu,cuda:0,cpu", outputs="device")
    want = case.eager_on_gpu()
    side = torch.cuda.Stream()
    x_cpu, y = case.inputs["x"], case.inputs["y"].to(GPU)
    big = torch.randn(4096, 4096, device=GPU)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        slow = big
        for _ in range(20):  # keeps the side stream busy well past the call's start
            slow = torch.tanh(slow @ big)
        x = x_cpu.to(GPU, non_blocking=False) + 0 * slow[0, 0]
        out = session.run(x=x, y=y)
        got = {k: v.cpu() for k, v in out.items()}
    assert_close_outputs(got, want, TOL)


def test_each_stages_weights_only_on_its_own_device():
    case = model("multi_mlp.traced")
    plan = libpipe.Model.load(case.path).split()
    stage_bytes = [s["param_bytes"] for s in plan.describe()["stages"]]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(GPU)
    session = plan.session(devices="cpu,cpu,cpu,cuda:0")
    after = torch.cuda.memory_allocated(GPU)
    # Stage 3's weights and nothing of the others' (the caching allocator rounds each up).
    assert stage_bytes[3] <= after - before < stage_bytes[3] + min(stage_bytes[:3]) // 2
    session.close()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(GPU)
    session = plan.session(devices="cuda:0")
    after = torch.cuda.memory_allocated(GPU)
    assert sum(stage_bytes) <= after - before < sum(stage_bytes) + min(stage_bytes) // 2
    session.close()


class Blowup(torch.nn.Module):
    """Stage 1 allocates `rows` MiB on its device: a large `rows` runs out of GPU memory."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, rows):
        x = self.lin(x)
        pipe_split()
        big = torch.ones(int(rows.item()), 1 << 18, device=x.device)
        return x + big.sum() * 0


def test_running_out_of_gpu_memory_fails_only_that_call(tmp_path):
    path = tmp_path / "blowup.pt"
    torch.jit.script(Blowup().eval()).save(str(path))
    plan = libpipe.Model.load(path).split()
    session = plan.session(devices="cuda:0")
    x = torch.randn(4, 16, device=GPU)
    too_much = torch.tensor(1 << 30)  # 2^30 MiB
    with pytest.raises(libpipe.OutOfMemoryError) as err:
        session.run(x=x, rows=too_much)
    assert "stage 1" in str(err.value)
    out = session.run(x=x, rows=torch.tensor(4))
    eager = torch.jit.load(str(path), map_location=GPU)
    torch.testing.assert_close(out["output"], eager(x, torch.tensor(4)).cpu())


def test_many_callers_at_once_on_two_gpu_stages():
    case = model("hf_llama")
    _, session = session_for(case, microbatches=2, devices="cuda:0,cuda:0", outputs="device")
    want = case.eager_on_gpu()
    errors = []

    def caller():
        try:
            for _ in range(10):
                assert_close_outputs(session.run(**gpu_inputs(case)), want, TOL)
        except Exception as e:  # reported below, with the thread's own error
            errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    stats = session.stats()
    assert all(s["microbatches"] > 0 and s["failures"] == 0 for s in stats)
