#!/usr/bin/env python3
"""Writes the constant tables of libpipe's Python, Go and Rust bindings from pipe.h, so that the
header is the one place where status codes, enum values, option defaults and the version are
written.

    pipe_constants.py LANG HEADER OUTPUT [--check]

LANG is python, go or rust; HEADER a pipe.h (the generated build/include/pipe/pipe.h, an
installed one, or the template capi/include/pipe/pipe.h.in, whose version is left unknown);
OUTPUT the file to write ("-" for stdout). --check writes nothing and fails, saying how to
regenerate, when OUTPUT differs from what HEADER gives.

What each binding gets and when (see each binding's build):
  python  libpipe/_constants.py: STATUS (value, name, C name, description), the enum groups as
          {NAME: value} dicts, DEFAULTS {struct: {field: value}} from the *_INIT macros and
          VERSION. setup.py writes it into the build, never into the sources.
  go      status_gen.go: the Status constants, the Err sentinels and Status.Description.
          Committed (Go has no build step of its own); run-tests.sh fails when it is stale.
  rust    status.rs in the pipe crate's OUT_DIR (its build.rs runs this with the header
          pipe-sys read): the Status enum and its code/name/description tables.

Only the standard library is used: the bindings' builds run it with whatever python3 they find.
Anything in the header this script does not understand (an integer constant outside the known
groups, an *_INIT macro whose values do not match its struct's fields, a status code without a
comment) is an error, so that a header change cannot silently leave a binding behind.
"""

import argparse
import os
import re
import sys
import tempfile
import textwrap
from collections import namedtuple

# Integer constants of pipe.h by group: PIPE_<GROUP>_<NAME>. A new group must be added here
# (and given a name in each binding) before the generator accepts the header.
ENUM_GROUPS = (
    "DTYPE",
    "CHUNK",
    "TRANSPORT",
    "MICROBATCHING",
    "OUTPUTS",
    "NAMES",
    "LOG",
    "FINISH",
    "MODEL",
    "QUANTIZE_HEAD",
    "QUANTIZE_EMBEDDING",
    "QUANTIZE",
)

# Words Go writes in capitals, as the binding named them before they were generated (StatusOK,
# StatusIO); Rust names are plain camel case (Status::Io).
GO_INITIALISMS = {"OK", "IO"}

# pipe.h documents every failure code; PIPE_OK has no comment of its own.
OK_DESCRIPTION = "Success."

Constant = namedtuple("Constant", "c_name name value doc")  # name: without PIPE_ / PIPE_ERR_ / PIPE_<GROUP>_
Header = namedtuple("Header", "version statuses enums defaults")


class HeaderError(Exception):
    """The header does not have the shape this generator knows."""


def _comment_text(comment):
    """The words of a /* ... */ comment, on one line."""
    body = comment.strip()[2:-2]
    lines = [re.sub(r"^\s*\*(?!/) ?", "", line) for line in body.splitlines()]
    return " ".join(" ".join(lines).split())


# A #define with an integer (or, in the template, @VAR@) value, with the comment right above it
# (no blank line between) or after it on the same line.
_INT_DEFINE = re.compile(
    r"(?:^[ \t]*(?P<above>/\*(?:(?!\*/).)*\*/)[ \t]*\n)?"
    r"^[ \t]*#define[ \t]+(?P<name>PIPE_\w+)[ \t]+(?P<value>-?\d+|@\w+@)[ \t]*"
    r"(?:(?P<after>/\*(?:(?!\*/).)*\*/)[ \t]*)?$",
    re.M | re.S,
)
_INIT_DEFINE = re.compile(r"^[ \t]*#define[ \t]+PIPE_(?P<struct>\w+)_INIT[ \t]+(?P<value>(?:[^\n]*\\\n)*[^\n]*)", re.M)
_STRUCT = re.compile(r"typedef struct (?P<name>pipe_\w+) \{(?P<body>.*?)\} (?P=name);", re.S)


def parse(text):
    """The constants of a pipe.h as a Header."""
    version = {}
    statuses, enums = [], {group: [] for group in ENUM_GROUPS}
    values = {}
    for m in _INT_DEFINE.finditer(text):
        c_name, raw = m.group("name"), m.group("value")
        doc = _comment_text(m.group("after") or m.group("above") or "/**/")
        value = None if raw.startswith("@") else int(raw)
        if c_name.startswith("PIPE_VERSION_"):
            version[c_name[len("PIPE_VERSION_") :]] = value
            continue
        if value is None:
            raise HeaderError(f"{c_name} has no value ({raw})")
        values[c_name] = value
        if c_name == "PIPE_OK":
            statuses.append(Constant(c_name, "OK", value, doc or OK_DESCRIPTION))
        elif c_name.startswith("PIPE_ERR_"):
            if not doc:
                raise HeaderError(f"{c_name} has no comment saying what it means: document it in pipe.h")
            statuses.append(Constant(c_name, c_name[len("PIPE_ERR_") :], value, doc))
        else:
            group = next((g for g in ENUM_GROUPS if c_name.startswith(f"PIPE_{g}_")), None)
            if group is None:
                raise HeaderError(
                    f"{c_name} is in none of the groups {', '.join(ENUM_GROUPS)}: add its group to "
                    "ENUM_GROUPS in bindings/codegen/pipe_constants.py and name it in each binding"
                )
            enums[group].append(Constant(c_name, c_name[len(f"PIPE_{group}_") :], value, doc))
    if not statuses or statuses[0].c_name != "PIPE_OK":
        raise HeaderError("no PIPE_OK: is this pipe.h?")
    for group, members in enums.items():
        if not members:
            raise HeaderError(f"no PIPE_{group}_* constants in the header")
    if set(version) != {"MAJOR", "MINOR", "PATCH"}:
        raise HeaderError(f"PIPE_VERSION_MAJOR/MINOR/PATCH are not all defined (found {sorted(version)})")
    parts = [version["MAJOR"], version["MINOR"], version["PATCH"]]
    return Header(
        version=None if None in parts else ".".join(map(str, parts)),
        statuses=statuses,
        enums=enums,
        defaults=_defaults(text, values),
    )


def _split_top_level(text):
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _defaults(text, values):
    """{struct name: {field: default}} from each PIPE_<STRUCT>_INIT macro and its struct."""
    fields = {}
    for m in _STRUCT.finditer(text):
        body = re.sub(r"/\*.*?\*/", " ", m.group("body"), flags=re.S)
        decls = [d.strip() for d in body.split(";") if d.strip()]
        # A field's name ends its declaration, before an array's size (char store[288]).
        fields[m.group("name")] = [re.search(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", d).group(1) for d in decls]
    defaults = {}
    for m in _INIT_DEFINE.finditer(text):
        struct = "pipe_" + m.group("struct").lower()
        macro = f"PIPE_{m.group('struct')}_INIT"
        if struct not in fields:
            raise HeaderError(f"{macro} initialises {struct}, which the header does not define")
        value = m.group("value").replace("\\\n", " ").strip()
        if not (value.startswith("{") and value.endswith("}")):
            raise HeaderError(f"{macro} is not a braced initialiser: {value}")
        items = _split_top_level(value[1:-1])
        if len(items) != len(fields[struct]):
            raise HeaderError(
                f"{macro} has {len(items)} values but {struct} has {len(fields[struct])} fields "
                f"({', '.join(fields[struct])})"
            )
        out = {}
        for field, item in zip(fields[struct], items):
            if field == "struct_size":
                if not re.fullmatch(rf"\(uint32_t\)\s*sizeof\({struct}\)", item):
                    raise HeaderError(f"{macro}: struct_size is {item}, not (uint32_t)sizeof({struct})")
                continue
            out[field] = _value(item, values, macro)
        defaults[struct] = out
    for struct, names in fields.items():
        if names and names[0] == "struct_size" and struct not in defaults:
            raise HeaderError(f"{struct} is versioned (struct_size) but has no {struct.upper()}_INIT macro")
    return defaults


def _value(item, values, macro):
    if item == "NULL":
        return None
    if item == '""':
        return ""
    if re.fullmatch(r"-?\d+", item):
        return int(item)
    if re.fullmatch(r"-?\d+\.\d*(?:[eE][-+]?\d+)?", item):
        return float(item)
    if item in values:
        return values[item]
    raise HeaderError(f"{macro}: cannot evaluate {item!r} (a literal, NULL or an integer PIPE_* constant)")


# ---- names ------------------------------------------------------------------------------------


def camel(name, initialisms=()):
    """INVALID_ARGUMENT -> InvalidArgument; words in `initialisms` stay in capitals."""
    return "".join(w if w in initialisms else w.capitalize() for w in name.split("_"))


def _quote(s):
    """A double-quoted string literal valid in Python, Go and Rust (the text is plain ASCII or
    UTF-8 prose: only backslashes and quotes need escaping)."""
    if any(ord(c) < 0x20 for c in s):
        raise HeaderError(f"control character in {s!r}")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _wrap(text, prefix, width=100):
    return [prefix + line for line in textwrap.wrap(text, width - len(prefix.expandtabs(4)))]


def _banner(comment, source):
    return f"{comment} Code generated by bindings/codegen/pipe_constants.py from {source}; DO NOT EDIT."


# ---- Python -------------------------------------------------------------------------------------


def python(header, source):
    out = [
        _banner("#", source),
        '"""pipe.h\'s constants for the pure-Python layer (libpipe.errors, libpipe.runtime)."""',
        "",
        "# MAJOR.MINOR.PATCH of the header; None when generated from the unconfigured template.",
        f"VERSION = {_quote(header.version) if header.version else None}",
        "",
        "# Every status code: (value, name in libpipe.Status, C name, what it means).",
        "STATUS = (",
    ]
    out += [f"    ({s.value}, {_quote(s.name)}, {_quote(s.c_name)}, {_quote(s.doc)})," for s in header.statuses]
    out += [")", ""]
    for group, members in header.enums.items():
        out.append(f"# PIPE_{group}_*")
        out.append(f"{group} = {{")
        out += [f"    {_quote(m.name)}: {m.value}," for m in members]
        out += ["}", ""]
    out.append("# Each versioned struct's fields as its *_INIT macro sets them (struct_size left out).")
    out.append("DEFAULTS = {")
    for struct, fields in header.defaults.items():
        out.append(f"    {_quote(struct)}: {{")
        out += [f"        {_quote(f)}: {v!r}," for f, v in fields.items()]
        out.append("    },")
    out.append("}")
    return "\n".join(out) + "\n"


# ---- Go -----------------------------------------------------------------------------------------


def go(header, source):
    names = [(s, "Status" + camel(s.name, GO_INITIALISMS)) for s in header.statuses]
    out = [
        _banner("//", source),
        "//",
        "// Regenerate with bindings/go/generate.sh (or go generate) after pipe.h gains a status code:",
        "// run-tests.sh and the binding parity test fail until then.",
        "",
        "package pipe",
        "",
        'import "github.com/libpipe/libpipe/bindings/go/internal/capi"',
        "",
        "// The status codes of pipe.h; every one but StatusOK is also an error (a sentinel for errors.Is).",
        "const (",
    ]
    for s, go_name in names:
        out += _wrap(f"{go_name} is {s.c_name}: {s.doc}", "\t// ")
        out.append(f"\t{go_name} Status = Status(capi.{s.c_name})")
    out += [")", "", "// Sentinels for errors.Is, one per failure status.", "var ("]
    for s, go_name in names[1:]:
        err = "Err" + go_name[len("Status") :]
        out.append(f"\t// {err} matches every error of status {go_name}.")
        out.append(f"\t{err} error = {go_name}")
    out += [
        ")",
        "",
        '// Description is what the code means, as pipe.h\'s comment on it says ("" for a code this',
        "// binding does not know).",
        "func (s Status) Description() string {",
        "\tswitch s {",
    ]
    for s, go_name in names:
        out.append(f"\tcase {go_name}:")
        # Long descriptions as "..." + "..." so that lines stay within 120 columns.
        pieces = textwrap.wrap(s.doc, 90, drop_whitespace=False, break_on_hyphens=False)
        pieces = [_quote(p) for p in (pieces if "".join(pieces) == s.doc else [s.doc])]
        out.append(f"\t\treturn {pieces[0]}" + (" +" if len(pieces) > 1 else ""))
        out += [f"\t\t\t{p}" + (" +" if i < len(pieces) - 1 else "") for i, p in enumerate(pieces[1:], 1)]
    out += ["\t}", '\treturn ""', "}"]
    return "\n".join(out) + "\n"


# ---- Rust ---------------------------------------------------------------------------------------


def rust(header, source):
    failures = [(s, camel(s.name)) for s in header.statuses[1:]]
    out = [
        _banner("//", source),
        "",
        "/// Why a call failed: a `PIPE_ERR_*` code of `pipe.h`.",
        "#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]",
        "#[non_exhaustive]",
        "pub enum Status {",
    ]
    for s, variant in failures:
        out += _wrap(s.doc, "    /// ")
        out += ["    ///", f"    /// `{s.c_name}` ({s.value}).", f"    {variant},"]
    out += [
        "    /// A code this binding does not know (a newer libpipe).",
        "    Unknown(i32),",
        "}",
        "",
        "impl Status {",
        "    /// Every failure status of the `pipe.h` this crate was built with, in code order.",
        "    pub const ALL: &'static [Status] = &[" + ", ".join(f"Status::{v}" for _, v in failures) + "];",
        "",
        "    /// The status for a `pipe_status` code; `None` for `PIPE_OK`.",
        "    pub fn from_code(code: i32) -> Option<Status> {",
        "        Some(match code {",
        "            sys::PIPE_OK => return None,",
    ]
    out += [f"            sys::{s.c_name} => Status::{v}," for s, v in failures]
    out += [
        "            other => Status::Unknown(other),",
        "        })",
        "    }",
        "",
        "    /// The `pipe_status` code.",
        "    pub fn code(self) -> i32 {",
        "        match self {",
    ]
    out += [f"            Status::{v} => sys::{s.c_name}," for s, v in failures]
    out += [
        "            Status::Unknown(code) => code,",
        "        }",
        "    }",
        "",
        "    /// What the code means, as `pipe.h`'s comment on it says.",
        "    pub fn description(self) -> &'static str {",
        "        match self {",
    ]
    out += [f"            Status::{v} => {_quote(s.doc)}," for s, v in failures]
    out += [
        '            Status::Unknown(_) => "A status code this binding does not know (a newer libpipe).",',
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(out) + "\n"


GENERATORS = {"python": python, "go": go, "rust": rust}


def generate(lang, header_path):
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    try:
        header = parse(text)
    except HeaderError as e:
        raise HeaderError(f"{header_path}: {e}") from None
    # The output names "pipe.h" whichever copy it was read from, so that it does not change with the
    # header's path (the Go file is committed).
    return GENERATORS[lang](header, "pipe.h")


def _write(path, text):
    """Replaces `path` at once, so that a concurrent reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pipe_constants.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lang", choices=sorted(GENERATORS))
    parser.add_argument("header", help="pipe.h (or the template pipe.h.in)")
    parser.add_argument("output", help='the file to write, "-" for stdout')
    parser.add_argument("--check", action="store_true", help="fail if OUTPUT is not what HEADER gives")
    args = parser.parse_args(argv)
    try:
        text = generate(args.lang, args.header)
    except (OSError, HeaderError) as e:
        print(f"pipe_constants.py: {e}", file=sys.stderr)
        return 1
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        except OSError as e:
            current = f"<{e}>"
        if current != text:
            print(
                f"pipe_constants.py: {args.output} is not what {args.header} gives (a status code added or "
                f"changed?): regenerate it with\n  python3 {os.path.relpath(__file__)} {args.lang} "
                f"{args.header} {args.output}",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.output == "-":
        sys.stdout.write(text)
    else:
        _write(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
