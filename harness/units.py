"""Quantities as people type them: memory sizes (16GiB, 16GB, 512MiB, 1.5G (binary), 4096B) and relative amounts
(5% or 0.05)."""
from __future__ import annotations

import re

from engines.errors import UserError

GiB, MiB = 2**30, 2**20
# GB/MB are decimal (what GPU vendors print), GiB/MiB and bare G/M binary (what `free -g` prints)
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int | float, option: str = "size") -> int:
    """'16GiB' -> 17179869184 bytes; raise UserError naming the option on anything else. A number needs its unit
    (16 could be bytes, MiB or GiB; B for bytes), but for 0."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UserError(f"{option} {text!r} is not a size; write it like 16GiB, 16GB, 512MiB or 4096B.")
    value = float(m.group(1))
    if not unit and value:
        n = m.group(1)
        raise UserError(f"{option} {n} has no unit; write {n}GiB, {n}GB or {value * 1024:g}MiB ({n}B for bytes).")
    return int(value * _UNITS[unit])


def parse_fraction(text: str, option: str) -> float:
    """'5%' or '0.05' -> 0.05, in [0, 1); raise UserError naming the option on anything else."""
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = -1
    if not 0 <= value < 1:
        raise UserError(f"{option} {text!r} is not a relative amount; write it as 5% or 0.05.")
    return value
