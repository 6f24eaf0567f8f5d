"""Builds libpipe._native, the SWIG wrapper of libpipe's C ABI, against the libpipe that
pkg-config finds (set PKG_CONFIG_PATH=<prefix>/lib/pkgconfig for a libpipe outside the default
search path). The extension records an rpath to libpipe's libdir, so it loads without
LD_LIBRARY_PATH. All metadata is in pyproject.toml; this file only describes the extension and
generates libpipe/_constants.py (status codes, enums, option defaults, version) from that
libpipe's pipe.h with bindings/codegen/pipe_constants.py, into the build (never the sources).

Environment: SWIG (the swig executable, default "swig"), PKG_CONFIG (default "pkg-config").
"""

import importlib.util
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def pkg_config(*args):
    tool = os.environ.get("PKG_CONFIG", "pkg-config")
    try:
        result = subprocess.run([tool, *args, "libpipe"], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"libpipe's Python binding needs {tool} to find libpipe; install pkg-config")
    except subprocess.CalledProcessError as e:
        raise SystemExit(
            "pkg-config cannot find libpipe: install libpipe and set "
            "PKG_CONFIG_PATH=<prefix>/lib/pkgconfig (now "
            f"{os.environ.get('PKG_CONFIG_PATH', '<unset>')!r}).\n{e.stderr.strip()}"
        )
    return result.stdout.strip()


def flags(prefix, text):
    return [f[len(prefix) :] for f in shlex.split(text) if f.startswith(prefix)]


class BuildSwigExt(build_ext):
    """Runs SWIG with its outputs in the build folder: setuptools' own SWIG step writes the
    wrapper next to the .i file, in the source tree. SWIG's Python proxy module (native.py) is
    not used: the package calls the extension directly."""

    def swig_sources(self, sources, extension):
        out = []
        for source in sources:
            if not source.endswith(".i"):
                out.append(source)
                continue
            target_dir = os.path.join(self.build_temp, "swig")
            os.makedirs(target_dir, exist_ok=True)
            wrapper = os.path.join(target_dir, os.path.basename(source)[:-2] + "_wrap.c")
            inputs = [source] + list(extension.depends)
            if (
                self.force
                or not os.path.exists(wrapper)
                or any(os.path.getmtime(i) > os.path.getmtime(wrapper) for i in inputs if os.path.exists(i))
            ):
                swig = os.environ.get("SWIG", "swig")
                self.spawn(
                    [swig, "-python", "-threads", *extension.swig_opts, "-outdir", target_dir, "-o", wrapper, source]
                )
            out.append(wrapper)
        return out


include_dirs = [os.path.realpath(d) for d in flags("-I", pkg_config("--cflags-only-I"))]
library_dirs = [os.path.realpath(d) for d in flags("-L", pkg_config("--libs-only-L"))]
libdir = os.path.realpath(pkg_config("--variable=libdir"))
if libdir not in library_dirs:
    library_dirs.append(libdir)
header = next(
    (os.path.join(d, "pipe", "pipe.h") for d in include_dirs if os.path.exists(os.path.join(d, "pipe", "pipe.h"))), None
)


def codegen():
    """bindings/codegen/pipe_constants.py: beside this file in a copy made by install.sh (and in an
    sdist), one folder up in the repository."""
    for path in (
        os.path.join(HERE, "codegen", "pipe_constants.py"),
        os.path.join(HERE, "..", "codegen", "pipe_constants.py"),
    ):
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("pipe_constants", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit("libpipe's Python binding needs bindings/codegen/pipe_constants.py to generate its constants")


class BuildPyWithConstants(build_py):
    """Adds libpipe/_constants.py, generated from the pipe.h the extension is built against, so
    that the Python tables cannot drift from the header (libpipe/_header.py reads it)."""

    def run(self):
        super().run()
        if header is None:
            raise SystemExit(f"pipe/pipe.h is in none of libpipe's include folders {include_dirs}")
        target = os.path.join(self.build_lib, "libpipe", "_constants.py")
        generator = codegen()
        try:
            text = generator.generate("python", header)
        except generator.HeaderError as e:
            raise SystemExit(f"cannot generate libpipe/_constants.py: {e}")
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


native = Extension(
    "libpipe._native",
    sources=["swig/native.i"],
    depends=[header] if header else [],
    include_dirs=include_dirs,
    library_dirs=library_dirs,
    libraries=flags("-l", pkg_config("--libs-only-l")) or ["pipe"],
    runtime_library_dirs=[libdir],  # DT_RUNPATH: found without LD_LIBRARY_PATH
    swig_opts=[f"-I{d}" for d in include_dirs],
    extra_compile_args=["-Wno-unused-parameter", "-Wno-missing-field-initializers"],
)

setup(
    version=pkg_config("--modversion"),
    ext_modules=[native],
    cmdclass={"build_ext": BuildSwigExt, "build_py": BuildPyWithConstants},
)
