"""Model.format (pipe_model_format, libpipe >= 0.10): what kind of file a model was loaded from,
decided by the file's content, never its name. The TorchScript case is the demo fixture; the
exported case is a tiny torch.export program written here."""

import shutil

import numpy as np
import pytest
import torch

import libpipe
from libpipe.runtime import MODEL_FORMATS

WIDTH = 8


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = torch.nn.Linear(WIDTH, WIDTH)
        self.lin1 = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.lin1(torch.relu(self.lin0(x)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(path of a .pt2 saved by torch.export.save, the eager model, an example input)."""
    torch.manual_seed(0)
    model = TwoLayers().eval()
    x = torch.randn(4, WIDTH)
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}})
    path = tmp_path_factory.mktemp("exported") / "two_layers.pt2"
    torch.export.save(program, str(path))
    return path, model, x


def test_the_formats_are_pipe_h_s():
    assert MODEL_FORMATS == ("torchscript", "exported")


def test_torchscript_archive(demo_model):
    assert demo_model.format == "torchscript"
    assert "torchscript" in repr(demo_model)


def test_exported_program(exported):
    path, model, x = exported
    with libpipe.Model.load(path) as loaded:
        assert loaded.format == "exported"
        assert "exported" in repr(loaded)
        assert loaded.input_names == ("x",)
        # It is the program torch.export wrote: cut in two, it gives eager PyTorch's result.
        with loaded.split(split_at=["lin1:begin"]) as plan, plan.session(microbatches=2) as session:
            assert plan.num_stages == 2
            got = session.run(x)["output"]
    with torch.no_grad():
        want = model(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_the_content_decides_not_the_name(exported, demo_path, tmp_path):
    program_as_pt = tmp_path / "program.pt"
    shutil.copyfile(exported[0], program_as_pt)
    archive_as_pt2 = tmp_path / "archive.pt2"
    shutil.copyfile(demo_path, archive_as_pt2)
    with libpipe.Model.load(program_as_pt) as m:
        assert m.format == "exported"
    with libpipe.Model.load(archive_as_pt2) as m:
        assert m.format == "torchscript"


def test_format_outlives_close(demo_path):
    model = libpipe.Model.load(demo_path)
    model.close()
    assert model.format == "torchscript"
