"""The package imports without its native module; the native part loads on first use."""

import os
import subprocess
import sys

from conftest import SOURCE


def python(code, **env):
    full = dict(os.environ)
    full.pop("PYTHONPATH", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd="/")


def test_import_does_not_load_the_native_module():
    r = python(
        "import sys, libpipe; assert 'libpipe._native' not in sys.modules; libpipe.version(); "
        "assert 'libpipe._native' in sys.modules"
    )
    assert r.returncode == 0, r.stderr


def test_source_tree_works_without_a_build():
    # Tests elsewhere use pipe_split from the source tree with nothing compiled.
    code = (
        "import sys, libpipe\n"
        f"assert libpipe.__file__.startswith({str(SOURCE)!r}), libpipe.__file__\n"
        "from libpipe import pipe_split, save_checkpoint, save_skeleton\n"
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        x = x + 1\n"
        "        pipe_split()\n"
        "        return x * 2\n"
        "g = str(torch.jit.trace(M(), torch.ones(2)).graph)\n"
        "assert 'pipe::split' in g, g\n"
        "try:\n"
        "    libpipe.version()\n"
        "except ImportError as e:\n"
        "    assert 'pkg-config' in str(e)\n"
        "    print('no native module')\n"
    )
    r = python(code, PYTHONPATH=str(SOURCE))
    assert r.returncode == 0, r.stderr
    built_in_place = any(n.startswith("_native") for n in os.listdir(SOURCE / "libpipe"))
    assert ("no native module" in r.stdout) != built_in_place


def test_extension_finds_libpipe_without_library_path():
    r = python("import libpipe; print(libpipe.version())", LD_LIBRARY_PATH="")
    assert r.returncode == 0, r.stderr


def test_set_log_level_silences_warnings(fixtures_dir):
    # A batch smaller than the micro-batch count runs with a logged warning (stderr by default).
    code = (
        "import sys, libpipe\n"
        f"s = libpipe.Model.load({str(fixtures_dir / 'demo.pt')!r}).split().session(microbatches=4)\n"
        f"x = libpipe.load_safetensors({str(fixtures_dir / 'demo.inputs.safetensors')!r})['x'][:2]\n"
        "print('--default', file=sys.stderr, flush=True); s.run(x)\n"
        "libpipe.set_log_level(libpipe.LOG_ERROR)\n"
        "print('--quiet', file=sys.stderr, flush=True); s.run(x)\n"
    )
    r = python(code)
    assert r.returncode == 0, r.stderr
    default, quiet = r.stderr.split("--default", 1)[1].split("--quiet", 1)
    assert "smaller than the 4 micro-batches" in default
    assert "micro-batches" not in quiet
