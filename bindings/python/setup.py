"""Builds libpipe._native, the SWIG wrapper of libpipe's C ABI, against the libpipe that
pkg-config finds (set PKG_CONFIG_PATH=<prefix>/lib/pkgconfig for a libpipe outside the default
search path). The extension records an rpath to libpipe's libdir, so it loads without
LD_LIBRARY_PATH. All metadata is in pyproject.toml; this file only describes the extension.

Environment: SWIG (the swig executable, default "swig"), PKG_CONFIG (default "pkg-config").
"""
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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
    return [f[len(prefix):] for f in shlex.split(text) if f.startswith(prefix)]


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
            if self.force or not os.path.exists(wrapper) or any(
                os.path.getmtime(i) > os.path.getmtime(wrapper) for i in inputs if os.path.exists(i)
            ):
                swig = os.environ.get("SWIG", "swig")
                self.spawn([swig, "-python", "-threads", *extension.swig_opts, "-outdir", target_dir, "-o", wrapper, source])
            out.append(wrapper)
        return out


include_dirs = [os.path.realpath(d) for d in flags("-I", pkg_config("--cflags-only-I"))]
library_dirs = [os.path.realpath(d) for d in flags("-L", pkg_config("--libs-only-L"))]
libdir = os.path.realpath(pkg_config("--variable=libdir"))
if libdir not in library_dirs:
    library_dirs.append(libdir)
header = next((os.path.join(d, "pipe", "pipe.h") for d in include_dirs if os.path.exists(os.path.join(d, "pipe", "pipe.h"))), None)

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
    cmdclass={"build_ext": BuildSwigExt},
)
