#!/usr/bin/env python3
"""Binding parity: every exported pipe_* function and every status code reaches every binding.

    check_binding_parity.py ROOT HEADER SYMBOLS

ROOT is the repository, HEADER the generated pipe.h (build/include/pipe/pipe.h), SYMBOLS
capi/libpipe.symbols (which conformance_exports ties to libpipe.so). Fails unless, for each of the
Python, Go and Rust bindings:

- every function of SYMBOLS (and of HEADER) is used by the binding's code, or is named in
  NOT_BOUND below with the reason it is left out. "Used" means named (called, or passed on as a
  destructor or to a macro) in the code of the binding's own layer, comments and strings left out:
    Python  libpipe/*.py, or the C code of swig/native.i (its typemaps and helpers), %ignore
            lines left out: a function SWIG wraps but nothing calls is not bound;
    Go      capi.Pipe_* in the package's non-test *.go files, or the C code of
            internal/capi/capi.swig, %ignore lines left out;
    Rust    pipe/src/*.rs (the safe crate: pipe-sys declares everything).
  A NOT_BOUND entry for a function the binding does use, or that is no longer exported, fails
  too, so that the list stays true.
- every status code of HEADER is exposed with its own name:
    Python  libpipe.Status is generated from the header (errors.py builds it from
            _constants.STATUS) and errors.py's _BY_NAME gives the code its exception class;
    Go      status_gen.go is what the generator gives for HEADER (checked line for line) and
            has the code's Status constant and Err sentinel;
    Rust    error.rs includes the generated status.rs, whose enum and tables have the code.

Adding a function to pipe.h: bind it in each binding, or add it to NOT_BOUND with the reason
(one line). Run by ctest as conformance_binding_parity.
"""

import ast
import importlib.util
import io
import os
import re
import sys
import tokenize

# Functions a binding deliberately leaves out, with the reason (one line each).
NOT_BOUND = {
    "python": {
        "pipe_status_string": "Status.c_name gives the name, from the table generated from pipe.h",
        "pipe_tensor_list_create": "Python writes safetensors with the safetensors package, not libpipe lists",
        "pipe_tensor_list_append": "Python writes safetensors with the safetensors package, not libpipe lists",
        "pipe_tensor_list_find": "results arrive as a dict, so lookups by name are Python's own",
        "pipe_tensor_list_get": "each output is taken (no copy) into a DLPack capsule, never borrowed",
        "pipe_safetensors_write": "Python writes safetensors with the safetensors package, not libpipe lists",
        "pipe_plan_stage_param_bytes": "Plan.describe() gives every stage's param_bytes",
        "pipe_plan_stage_estimated_ms": "Plan.describe() gives every stage's estimated_ms",
        "pipe_request_on_done": "asyncio watches pipe_request_fd; a callback would run Python on a libpipe thread",
        "pipe_generation_on_event": "iteration polls and asyncio watches pipe_generation_fd; a callback would run "
        "Python on a libpipe thread",
        "pipe_launch_from_environment": "the worker entry point reads torchrun's or srun's environment through pipe_worker_run (rank and world "
        "size 0); a driver program reads its own RANK",
        "pipe_launch_info_init": "pipe_launch_from_environment is not bound (above)",
    },
    "go": {
        "pipe_tensor_list_find": "outputs are copied into a Go TensorList at once, whose Get looks names up",
        "pipe_tensor_list_get": "outputs are taken out of the list and copied, never borrowed",
        "pipe_generation_fd": "tokens reach a Go channel through pipe_generation_on_event, read at once: "
        "a descriptor would tell a poller of nothing left to read",
        "pipe_launch_from_environment": "the worker entry point reads torchrun's or srun's environment through pipe_worker_run (rank and world "
        "size 0); a driver program reads its own RANK",
        "pipe_launch_info_init": "pipe_launch_from_environment is not bound (above)",
    },
    # ---- Generation (0.8, issue 15): the rust binding already used every function when the C ABI landed.
    "rust": {
        "pipe_launch_from_environment": "the worker entry point reads torchrun's or srun's environment through pipe_worker_run (rank and world "
        "size 0); a driver program reads its own RANK",
        "pipe_launch_info_init": "pipe_launch_from_environment is not bound (above)",
    },
}


# ---- reading sources without their comments and strings ------------------------------------------

_C_LIKE = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)
_GO = re.compile(r'"(?:\\.|[^"\\\n])*"|`[^`]*`|//[^\n]*|/\*.*?\*/', re.S)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def c_code(text):
    return _C_LIKE.sub(" ", text)


def go_code(text):
    return _GO.sub(" ", text)


def python_names(text):
    """The identifiers of Python code (comments, strings and docstrings left out)."""
    return {tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.NAME}


def swig_c_code(text):
    """The C code of a SWIG interface, comments and %ignore directives left out."""
    return "\n".join(line for line in c_code(text).splitlines() if not line.lstrip().startswith("%ignore"))


def names(code, function):
    return re.search(rf"\b{function}\b", code) is not None


# ---- what each binding uses ----------------------------------------------------------------------


def python_uses(root):
    folder = os.path.join(root, "bindings", "python")
    identifiers = set()
    for name in sorted(os.listdir(os.path.join(folder, "libpipe"))):
        if name.endswith(".py") and name != "_constants.py":
            identifiers |= python_names(read(os.path.join(folder, "libpipe", name)))
    swig = swig_c_code(read(os.path.join(folder, "swig", "native.i")))
    return lambda f: f in identifiers or names(swig, f)


def go_uses(root):
    folder = os.path.join(root, "bindings", "go")
    code = "".join(
        go_code(read(os.path.join(folder, n)))
        for n in sorted(os.listdir(folder))
        if n.endswith(".go") and not n.endswith("_test.go")
    )
    swig = swig_c_code(read(os.path.join(folder, "internal", "capi", "capi.swig")))
    # SWIG names pipe_model_load Pipe_model_load in Go.
    return lambda f: re.search(rf"\bcapi\.P{f[1:]}\b", code) is not None or names(swig, f)


def rust_uses(root):
    folder = os.path.join(root, "bindings", "rust", "pipe", "src")
    code = "".join(c_code(read(os.path.join(folder, n))) for n in sorted(os.listdir(folder)) if n.endswith(".rs"))
    return lambda f: names(code, f)


USES = {"python": python_uses, "go": go_uses, "rust": rust_uses}


# ---- the status codes each binding exposes -------------------------------------------------------


def python_status_gaps(root, header, codegen):
    errors_py = read(os.path.join(root, "bindings", "python", "libpipe", "errors.py"))
    gaps = []
    if "_constants.STATUS" not in python_names_text(errors_py):
        gaps.append("errors.py no longer builds Status from the generated table (_constants.STATUS)")
    by_name = None
    for node in ast.walk(ast.parse(errors_py)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_BY_NAME" for t in node.targets):
            by_name = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    if by_name is None:
        return gaps + ["errors.py has no _BY_NAME table (status name -> exception class)"]
    generated = codegen.python(header, "pipe.h")
    for s in header.statuses[1:]:
        if f'"{s.name}", "{s.c_name}"' not in generated:
            gaps.append(f"{s.c_name}: the generated libpipe/_constants.py lacks it")
        if s.name not in by_name:
            gaps.append(f"{s.c_name}: errors.py's _BY_NAME gives Status.{s.name} no exception class")
    return gaps


def python_names_text(text):
    """errors.py's code with comments and strings left out, as text."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string)
    return "".join(out)


def go_status_gaps(root, header, codegen):
    path = os.path.join(root, "bindings", "go", "status_gen.go")
    committed = read(path)
    gaps = []
    for s in header.statuses:
        name = "Status" + codegen.camel(s.name, codegen.GO_INITIALISMS)
        if not re.search(rf"^\t{name} Status = Status\(capi\.{s.c_name}\)$", committed, re.M):
            gaps.append(f"{s.c_name}: status_gen.go has no {name}")
        if s.c_name != "PIPE_OK" and not re.search(rf"^\tErr{name[6:]} error = {name}$", committed, re.M):
            gaps.append(f"{s.c_name}: status_gen.go has no Err{name[6:]} sentinel")
    if committed != codegen.go(header, "pipe.h"):
        gaps.append("status_gen.go is not what pipe.h gives: run bindings/go/generate.sh and commit it")
    return gaps


def rust_status_gaps(root, header, codegen):
    error_rs = read(os.path.join(root, "bindings", "rust", "pipe", "src", "error.rs"))
    gaps = []
    if 'include!(concat!(env!("OUT_DIR"), "/status.rs"));' not in re.sub(r"//[^\n]*", "", error_rs):
        gaps.append("error.rs does not include the generated status.rs")
    generated = codegen.rust(header, "pipe.h")
    for s in header.statuses[1:]:
        variant = codegen.camel(s.name)
        if f"sys::{s.c_name} => Status::{variant}," not in generated:
            gaps.append(f"{s.c_name}: the generated status.rs has no Status::{variant}")
    return gaps


STATUS_GAPS = {"python": python_status_gaps, "go": go_status_gaps, "rust": rust_status_gaps}


# ---- the check -----------------------------------------------------------------------------------


def exported_functions(symbols_path, header_text):
    from_symbols = {
        line.strip() for line in read(symbols_path).splitlines() if line.strip() and not line.startswith("#")
    }
    # The header's declarations too: a function declared but missing from the symbols list is
    # conformance_exports' failure, not a reason to skip it here.
    from_header = set(re.findall(r"^PIPE_API\b[^;(]*?\b(pipe_\w+)\s*\(", header_text, re.M))
    return sorted(f for f in from_symbols | from_header if f.startswith("pipe_"))


def main(argv):
    if len(argv) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, header_path, symbols_path = argv[1:]
    spec = importlib.util.spec_from_file_location(
        "pipe_constants", os.path.join(root, "bindings", "codegen", "pipe_constants.py")
    )
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    header_text = read(header_path)
    header = codegen.parse(header_text)
    functions = exported_functions(symbols_path, header_text)

    failures = []
    for binding, uses_of in USES.items():
        uses = uses_of(root)
        exempt = NOT_BOUND[binding]
        for f in functions:
            if uses(f) and f in exempt:
                failures.append(f"{binding}: {f} is bound, but NOT_BOUND says it is not ({exempt[f]}): drop that line")
            elif not uses(f) and f not in exempt:
                failures.append(
                    f"{binding}: {f} is exported by libpipe but not bound: bind it, or add it to NOT_BOUND in "
                    f"{os.path.relpath(__file__, root)} with the reason"
                )
        for f in sorted(set(exempt) - set(functions)):
            failures.append(f"{binding}: NOT_BOUND names {f}, which libpipe does not export: drop that line")
        failures += [f"{binding}: {gap}" for gap in STATUS_GAPS[binding](root, header, codegen)]

    statuses = [s.c_name for s in header.statuses]
    print(f"{len(functions)} exported functions, {len(statuses)} status codes ({statuses[0]} .. {statuses[-1]})")
    for binding in USES:
        left_out = len(NOT_BOUND[binding])
        print(f"{binding}: {len(functions) - left_out} bound, {left_out} not bound on purpose")
    if failures:
        print(f"\nFAILED: {len(failures)} parity gap(s):", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("every binding binds every function (or says why not) and exposes every status code")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
