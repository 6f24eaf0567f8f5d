"""pipe.h's constants (status codes, enum values, option defaults, version) as `constants`.

A built package has them in libpipe/_constants.py, which setup.py generates from the pipe.h it
builds against (bindings/codegen/pipe_constants.py), so they cannot drift from the header. A
source checkout used without a build (PYTHONPATH=bindings/python, as the repository's tests and
model scripts use pipe_split) has no such file: the same generator then reads the checkout's
header template, capi/include/pipe/pipe.h.in, in memory. Nothing is written either way.
"""

import importlib.util
import os
import types


def _from_checkout():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    generator = os.path.join(root, "bindings", "codegen", "pipe_constants.py")
    header = os.path.join(root, "capi", "include", "pipe", "pipe.h.in")
    if not (os.path.isfile(generator) and os.path.isfile(header)):
        raise ImportError(
            "libpipe/_constants.py is missing and this is not a libpipe source checkout: install the "
            "package with `pip install bindings/python` (its build generates the file from pipe.h)"
        )
    spec = importlib.util.spec_from_file_location("libpipe._pipe_constants_generator", generator)
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    module = types.ModuleType("libpipe._constants")
    exec(compile(codegen.generate("python", header), header, "exec"), module.__dict__)
    return module


try:
    constants = importlib.import_module(f"{__package__}._constants")
except ModuleNotFoundError as e:
    if e.name != f"{__package__}._constants":
        raise
    constants = _from_checkout()
