"""A ctypes binding's struct layouts held to the C header they were written for, read from the header's text.

A binding whose Structure classes are written by hand (ik-llama-cpp-python's) runs on a wrong memory layout, silently,
when its header changes; header_struct lays a C struct out by the C rules from the header itself and
layout_difference names the first field where a binding's differs. Header text is untrusted input: every read and
every pattern is bounded.
"""
from __future__ import annotations

import ctypes
import itertools
import re
from pathlib import Path

from engines.gguf_meta import clean_text


class LayoutError(ValueError):
    """The header cannot be read as this check reads headers, or holds something it does not know."""


HEADER_LIMIT = 1 << 20          # bytes per header file read
MAX_FIELDS = 256
_SCALARS = {"bool": ctypes.c_bool, "char": ctypes.c_char, "int": ctypes.c_int, "float": ctypes.c_float,
            "double": ctypes.c_double, "size_t": ctypes.c_size_t,
            **{f"{u}int{n}_t": getattr(ctypes, f"c_{u}int{n}") for u in ("", "u") for n in (8, 16, 32, 64)}}
_CODES = {**dict.fromkeys("bhilq", "int"), **dict.fromkeys("BHILQ", "uint"), **dict.fromkeys("fdg", "float"),
          "?": "bool", "c": "char"}
# every pattern bounds what one match attempt may scan, so no header text makes a search quadratic
_COMMENT = re.compile(r"/[*/]")
_INCLUDE = re.compile(r'^#include "([\w.-]{1,64}\.h)"', re.M)
_STRUCT = re.compile(r"\b(?:typedef\s+)?struct\s+(\w{0,64})\s*\{([^{}]*)\}\s*(\w{0,64})\s*;")
# one field: [const] [enum|struct] TYPE [*...] NAME [[N]]
_DECL = re.compile(r"(?:const\s+)?(enum\s+|struct\s+)?(\w{1,64})\s*((?:\*\s*)*)\b(\w{1,64})\s*(?:\[\s*(\d{1,6})\s*\])?")
_FN_TYPEDEF = re.compile(r"\btypedef\s+(\w{1,64})[\w\s*]{0,64}?\(\s*\*\s*(\w{1,64})\s*\)\s*\(([^()]{0,1000})\)\s*;")
_PTR_TYPEDEF = re.compile(r"\btypedef\s+(?:const\s+)?struct\s+\w{1,64}\s*\*\s*(\w{1,64})\s*;")
_ALIAS = re.compile(r"\btypedef\s+(\w{1,64})\s+(\w{1,64})\s*;")


def header_text(include: Path) -> str:
    """llama.h and the project headers it includes (one level of quotes includes, each file bounded), comments and
    preprocessor lines removed."""
    texts, todo, seen = [], ["llama.h"], set()
    while todo and len(seen) < 8:
        name = todo.pop()
        if name in seen or not (include / name).is_file():
            continue
        seen.add(name)
        with open(include / name, "rb") as f:
            raw = f.read(HEADER_LIMIT + 1)
        if len(raw) > HEADER_LIMIT:
            raise LayoutError(f"{include / name} is larger than {HEADER_LIMIT} bytes, not the header its binding was "
                          f"written for")
        text = raw.decode("utf-8", errors="replace")
        todo += _INCLUDE.findall(text)
        texts.append(text)
    return "\n".join(line for line in _uncommented("\n".join(texts)).splitlines() if not line.lstrip().startswith("#"))


def _uncommented(text: str) -> str:
    """C text without its /* */ and // comments, in one pass (an unterminated /* ends the text)."""
    out, i = [], 0
    while (m := _COMMENT.search(text, i)) is not None:
        out.append(text[i:m.start()])
        end = text.find("*/" if m.group() == "/*" else "\n", m.end())
        if end < 0:
            return "".join(out)
        i = end + 2 if m.group() == "/*" else end
    return "".join(out) + text[i:]


def kind(t) -> str:
    """What a ctypes type is, in words that a layout comparison can tell apart: int32, uint32, float32, bool8,
    pointer, char8[128], or a struct's name."""
    if issubclass(t, ctypes.Array):
        return f"{kind(t._type_)}[{t._length_}]"
    if issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)) or t in (ctypes.c_void_p, ctypes.c_char_p):
        return "pointer"
    code = getattr(t, "_type_", None)
    if isinstance(code, str) and code in _CODES:
        return f"{_CODES[code]}{8 * ctypes.sizeof(t)}"
    return t.__name__


class Types:
    """C type names of a header as ctypes types: scalars, enums (int), pointers, and its typedefs of those."""

    def __init__(self, text: str):
        self.callbacks = {name: (ret, params) for ret, name, params in _FN_TYPEDEF.findall(text)}
        self.pointers = set(_PTR_TYPEDEF.findall(text)) | set(self.callbacks)
        self.aliases = {new: old for old, new in _ALIAS.findall(text)}

    def ctype(self, decl: str, what: str):
        m = _DECL.fullmatch(decl.strip())
        if not m:
            raise LayoutError(f"{what}: cannot read the declaration {clean_text(decl, 80)!r}")
        tag, name, stars, _, dim = m.groups()
        if stars or name in self.pointers:
            t = ctypes.c_void_p
        elif tag and tag.strip() == "enum":
            t = ctypes.c_int
        else:
            for _ in range(8):          # typedef chains (llama_token -> int32_t), bounded
                name = name if name in _SCALARS else self.aliases.get(name, name)
            if tag or name not in _SCALARS:
                raise LayoutError(f"{what}: the type {clean_text(name, 80)!r} is not one this check knows")
            t = _SCALARS[name]
        return (m.group(4), t * int(dim) if dim else t)


def header_struct(text: str, types: Types, name: str) -> type[ctypes.Structure]:
    """The C struct (or typedef'd struct) `name` of the header as a ctypes Structure, laid out by the C rules."""
    bodies = [body for tag, body, alias in _STRUCT.findall(text) if name in (tag, alias)]
    if len(bodies) != 1:
        raise LayoutError(f"The header defines struct {name} {len(bodies)} times, not once")
    decls = [d for d in bodies[0].split(";") if d.strip()]
    if len(decls) > MAX_FIELDS:
        raise LayoutError(f"struct {name} of the header has over {MAX_FIELDS} fields")
    return type(name, (ctypes.Structure,), {"_fields_": [types.ctype(d, f"struct {name}") for d in decls]})


def layout_difference(binding: type[ctypes.Structure], header: type[ctypes.Structure]) -> str:
    """"" when the two structs agree (field names, kinds, offsets, sizes, total size), else the first difference."""
    def fields(s):
        return [(n, kind(t), getattr(s, n).offset, ctypes.sizeof(t)) for n, t, *_ in s._fields_]
    show = lambda f: f"`{f[0]}` ({f[1]} at offset {f[2]})" if f else "nothing"     # noqa: E731
    for i, (a, b) in enumerate(itertools.zip_longest(fields(binding), fields(header))):
        if a != b:
            return f"field {i}: the binding has {show(a)}, the header {show(b)}"
    a, b = ctypes.sizeof(binding), ctypes.sizeof(header)
    return f"size: the binding's is {a} bytes, the header's {b}" if a != b else ""


