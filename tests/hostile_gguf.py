"""Hostile GGUF files for the tests, and a fuzz driver that runs them through the real CLI.

`rewrite` copies a model with changed metadata or tensor names (a consistent file that lies); `mutants`
yields seeded mutations of a model: truncations, header integers, random header bytes, metadata lies and
hostile strings. `python -m tests.hostile_gguf MODEL SEED COUNT WORKDIR` runs each mutant through
`model info`, `plan` and the model-checking path of `sweep` in one process (click's runner: the imports are
paid once, so a few dozen files take seconds) and prints one JSON line per command; the test runs it as a
subprocess with a timeout, so a hang fails the test and the last line names the file it hung on.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

ESC = "\x1b[31mRED\x1b[0m\x1b]0;pwned\x07\x1b[2J"
BIG = 4 << 20                               # a 4 MiB string
INTERESTING = [0, 1, 2, 3, 7, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
               2**64 - 1]
# (key relative to the architecture, value): numbers no consistent model has
LIES: list[tuple[str, object]] = [
    ("block_count", 0), ("block_count", 3), ("block_count", 600), ("block_count", 2**40), ("block_count", "four"),
    ("expert_count", 0), ("expert_count", 1), ("expert_count", 7), ("expert_count", 2000), ("expert_count", 2.5),
    ("expert_used_count", 0), ("expert_used_count", 9), ("expert_used_count", 99), ("expert_used_count", [2, 2, 2]),
    ("expert_used_count", [0, 0, 0, 0]), ("expert_used_count", -1),
    ("attention.head_count", 0), ("attention.head_count", 3), ("attention.head_count", [0, 0, 0, 0]),
    ("attention.head_count", "many"), ("attention.head_count_kv", 0), ("attention.head_count_kv", 3),
    ("attention.head_count_kv", [2, 2, 2, 3]), ("attention.layer_norm_rms_epsilon", -1.0),
    ("attention.layer_norm_rms_epsilon", 0.0), ("attention.layer_norm_rms_epsilon", math.nan),
    ("attention.layer_norm_rms_epsilon", math.inf), ("rope.freq_base", 0.0), ("rope.freq_base", -1e4),
    ("rope.freq_base", math.nan), ("embedding_length", 0), ("embedding_length", 64), ("embedding_length", 2**31),
    ("expert_group_count", 3), ("expert_group_count", 8),
]
DROPS = ["block_count", "expert_count", "expert_used_count", "embedding_length", "attention.head_count"]
STRINGS: list[tuple[str, str]] = [
    ("general.name", "x" * BIG + ESC), ("general.name", ESC), ("general.name", "two\r\nlines\tand\x00nul"),
    ("general.name", "\u202eevil\u2066rtl"), ("general.name", "n" * 300), ("general.description", "d" * (1 << 20)),
    ("tokenizer.ggml.model", ESC), (f"evil{ESC}.key", "v"), ("k" * 70000, "long key"),
]


def rewrite(src: Path, dst: Path, set_: dict | None = None, drop: tuple[str, ...] = (),
            rename: dict[str, str] | None = None) -> Path:
    """A copy of src with metadata keys set (full names; new keys are added) or dropped and tensors renamed."""
    import gguf
    import numpy as np
    from gguf import GGUFValueType as T

    set_, rename = dict(set_ or {}), rename or {}
    r = gguf.GGUFReader(src)
    arch = set_.pop("general.architecture", r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop:
            continue
        if k in set_:
            v = set_.pop(k)
            w.add_key_value(k, v, *_vtype(v))
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == T.ARRAY else None)
    for k, v in set_.items():
        w.add_key_value(k, v, *_vtype(v))
    for t in r.tensors:
        w.add_tensor(rename.get(t.name, t.name), np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _vtype(v):
    """(value type, element type) the writer needs for a Python value."""
    from gguf import GGUFValueType as T

    if isinstance(v, list):
        return T.ARRAY, _vtype(v[0])[0]
    if isinstance(v, bool):
        return T.BOOL, None
    if isinstance(v, int):
        return (T.INT64 if v < -2**31 else T.INT32 if v < 0 else T.UINT32 if v < 2**32 else T.UINT64), None
    if isinstance(v, float):
        return T.FLOAT32, None
    return T.STRING, None


def data_offset(path: Path) -> int:
    """Where the tensor data starts: everything before it is header."""
    import gguf
    return gguf.GGUFReader(path).data_offset


Mutant = tuple[str, Callable[[Path], None]]


def mutants(src: Path, seed: int, count: int) -> Iterator[Mutant]:
    """`count` seeded mutations of src, as (label, write(dst)); the kinds take turns, so any slice mixes them."""
    rng = random.Random(seed)
    raw = src.read_bytes()
    header = data_offset(src)
    arch = "qwen3moe"

    def patched(edits: list[tuple[int, bytes]]) -> Callable[[Path], None]:
        def write(dst: Path) -> None:
            b = bytearray(raw)
            for pos, new in edits:
                b[pos:pos + len(new)] = new
            dst.write_bytes(bytes(b))
        return write

    def truncation() -> Mutant:
        n = rng.randrange(header + 64) if rng.random() < 0.8 else rng.randrange(header, len(raw))
        return f"truncate@{n}", lambda dst: dst.write_bytes(raw[:n])

    def header_int() -> Mutant:
        pos = rng.choice([4, 8, 16]) if rng.random() < 0.3 else rng.randrange(4, header - 8)
        width = rng.choice([4, 8])
        old = int.from_bytes(raw[pos:pos + width], "little")
        value = rng.choice(INTERESTING + [old + 1, max(old - 1, 0)]) % (1 << 8 * width)
        return f"int{8 * width}@{pos}={value}", patched([(pos, value.to_bytes(width, "little"))])

    def header_bytes() -> Mutant:
        edits = [(rng.randrange(4, header), bytes([rng.randrange(256)])) for _ in range(rng.randint(1, 8))]
        return "bytes@" + ",".join(f"{p}={b[0]}" for p, b in edits), patched(edits)

    def lie() -> Mutant:
        if rng.random() < 0.2:
            key = rng.choice(DROPS)
            return f"drop {key}", lambda dst: rewrite(src, dst, drop=(f"{arch}.{key}",))
        key, value = rng.choice(LIES)
        return f"{key}={value!r}", lambda dst: rewrite(src, dst, {f"{arch}.{key}": value})

    def hostile() -> Mutant:
        r = rng.random()
        if r < 0.15:
            name = rng.choice(["blk.0.attn_q.weight" + ESC, "t" * 100, ""])
            return f"tensor name {name[:24]!r}", lambda dst: rewrite(src, dst, rename={"blk.0.attn_q.weight": name})
        if r < 0.25:
            arch_ = rng.choice([ESC, "a" * 5000, "x.y z"])
            return f"architecture {arch_[:24]!r}", lambda dst: rewrite(src, dst, {"general.architecture": arch_})
        if r < 0.35:     # a name that is not UTF-8
            at = raw.index(b"moebench-synth")
            return "name not utf-8", patched([(at, b"\xff\xfe\x1b[31m")])
        key, value = rng.choice(STRINGS)
        return f"{key[:24]!r}={value[:24]!r}+{len(value)}", lambda dst: rewrite(src, dst, {key: value})

    kinds = [truncation, header_int, header_bytes, lie, hostile]
    for i in range(count):
        yield kinds[i % len(kinds)]()


def run_cli(args: list[str]) -> dict:
    """One CLI command in this process: exit code, output, and the traceback of anything that escaped."""
    from click.testing import CliRunner

    from harness.cli import cli

    started = time.perf_counter()
    r = CliRunner().invoke(cli, args, prog_name="moebench")
    out = {"args": args[:1], "exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
           "seconds": round(time.perf_counter() - started, 3), "traceback": ""}
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        out["traceback"] = "".join(traceback.format_exception(*r.exc_info))
    return out


def fuzz(src: Path, seed: int, count: int, workdir: Path) -> Iterator[dict]:
    """Every mutant through `model info`, `plan` and `sweep` (stamp engine, a depth no file has: the sweep
    stops with exit 2 after the model checks, before any cell); one record per command."""
    workdir.mkdir(parents=True, exist_ok=True)
    for label, write in mutants(src, seed, count):
        path = workdir / "mutant.gguf"
        write(path)
        for args in (["model", "info", str(path)],
                     ["plan", "-m", str(path), "--no-calibrate", "--format", "csv"],
                     ["sweep", "-m", str(path), "-e", "stamp", "-w", "pp8", "-r", "1", "--sample-ms", "0",
                      "--n-cpu-moe", "0,65536", "--results-dir", str(workdir / "results"), "--format", "csv"]):
            yield {"mutant": label} | run_cli(args)
        path.unlink()


if __name__ == "__main__":
    model, seed, count, workdir = sys.argv[1:5]
    for record in fuzz(Path(model), int(seed), int(count), Path(workdir)):
        print(json.dumps(record), flush=True)
