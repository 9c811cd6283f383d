"""Routing traces: which experts each token of a cell was routed to, per forward pass and MoE layer (torch-free).

One file per cell, `<run_dir>/traces/<cell file stem>.npz` (np.savez_compressed), one row per token in execution
order (T rows), L = MoE layers, k = experts used per token:
    ids      int16   (T, L, k)  top-k expert ids, in the order the router ranked them
    weights  float16 (T, L, k)  their gate weights as the router gave them (before a per-expert output scale)
    pos      int32   (T,)       the token's position in the KV cache
    step     int32   (T,)       forward-pass index (a prefill ubatch is one step, each decode its own)
    phase    uint8   (T,)       0 prefill, 1 decode
    segment  int16   (T,)       index into header["segments"]: one per workload, its first run only
    header   0-d str            JSON, see HEADER_KEYS
Written by the reference engine (EngineSettings.extra["trace_routing"] = path; TraceRecorder below) and read by
the cache planner; every file read passes load_trace's checks (it may come from anywhere).
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from engines.errors import UserError

FORMAT = "moebench-routing/1"
PHASES = ("prefill", "decode")
STREAMS = ("random", "correlated")
# header key -> its type; moe_layers/expert_bytes have one entry per MoE layer, segments/streams/token_hash one
# per segment
HEADER_KEYS = {"format": str, "model": str, "fingerprint": str, "arch": str, "n_layers": int, "moe_layers": list,
               "n_expert": int, "k": int, "expert_bytes": list, "n_cpu_moe": int, "n_ubatch": int, "segments": list,
               "streams": list, "token_hash": list}
ROW_ARRAYS = {"ids": np.int16, "weights": np.float16, "pos": np.int32, "step": np.int32, "phase": np.uint8,
              "segment": np.int16}
MAX_ROWS = 1 << 24                 # tokens in one trace (16 M: a pp8192 cell has 8192)
MAX_VALUES = 1 << 31               # ids or weights entries in one trace (4 GiB of int16)
MAX_HEADER = 1 << 20               # characters of header JSON


def token_hash(tokens: Sequence[int]) -> str:
    """sha256 hex of a token stream: the ids as little-endian int32, concatenated."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass
class Trace:
    header: dict
    ids: np.ndarray          # (T, L, k) int16
    weights: np.ndarray      # (T, L, k) float16
    pos: np.ndarray          # (T,) int32
    step: np.ndarray         # (T,) int32
    phase: np.ndarray        # (T,) uint8
    segment: np.ndarray      # (T,) int16

    @property
    def n_layers_moe(self) -> int:
        return len(self.header["moe_layers"])

    @property
    def n_expert(self) -> int:
        return int(self.header["n_expert"])

    @property
    def k(self) -> int:
        return int(self.header["k"])

    @property
    def expert_bytes(self) -> list[int]:
        return [int(b) for b in self.header["expert_bytes"]]

    def __len__(self) -> int:
        return len(self.step)

    def steps(self, phase: int | str | None = None, segment: int | str | None = None
              ) -> Iterator[tuple[int, int, slice]]:
        """(step, phase, rows) of each forward pass in execution order: its rows are contiguous. phase 0/1 or
        "prefill"/"decode", segment an index or a workload name: only those steps."""
        ph, sg = self._phase(phase), self._segment(segment)
        if not len(self.step):
            return
        cut = np.flatnonzero(np.diff(self.step)) + 1
        for lo, hi in zip(np.r_[0, cut], np.r_[cut, len(self.step)]):
            p, s = int(self.phase[lo]), int(self.segment[lo])
            if (ph is None or p == ph) and (sg is None or s == sg):
                yield int(self.step[lo]), p, slice(int(lo), int(hi))

    def request(self, rows: slice, layer: int) -> tuple[list[int], list[int]]:
        """One forward pass x one MoE layer as an expert cache sees it (engines.cache_policies.Policy.request): the
        distinct experts its tokens route to, ascending, and how many token selections each got."""
        e, c = np.unique(self.ids[rows, layer], return_counts=True)
        return e.tolist(), c.tolist()

    def select(self, segment: int | str | None = None, phase: int | str | None = None) -> "Trace":
        """The rows of one segment and/or phase (the header keeps every segment, so indices stay valid)."""
        keep = np.ones(len(self), dtype=bool)
        if (sg := self._segment(segment)) is not None:
            keep &= self.segment == sg
        if (ph := self._phase(phase)) is not None:
            keep &= self.phase == ph
        return replace(self, **{k: getattr(self, k)[keep] for k in ROW_ARRAYS})

    def _phase(self, phase: int | str | None) -> int | None:
        if phase is None:
            return None
        if isinstance(phase, str):
            if phase not in PHASES:
                raise UserError(f"phase {phase!r} is not one of {', '.join(PHASES)}.")
            return PHASES.index(phase)
        return int(phase)

    def _segment(self, segment: int | str | None) -> int | None:
        if segment is None or not isinstance(segment, str):
            return segment
        names = self.header["segments"]
        if segment not in names:
            raise UserError(f"the trace has no segment {segment!r}; it has {', '.join(names) or 'none'}.")
        return names.index(segment)


def save_trace(path: Path, trace: Trace) -> None:
    """Write trace to path (.npz) whole or not at all: a temporary file, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(getattr(trace, k), dtype=t) for k, t in ROW_ARRAYS.items()}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:        # a file object: savez would append .npz to a name
        np.savez_compressed(f, header=np.array(json.dumps(trace.header)), **arrays)
    tmp.replace(path)


def load_trace(path: Path) -> Trace:
    """Read and check a trace file: sizes before anything is allocated, then the header's fields, the shapes and
    types of the arrays and their values. Any problem is one UserError naming the file."""
    path = Path(path)

    def bad(why: str) -> UserError:
        return UserError(f"{path} is not a usable routing trace ({why}); record one with `moebench sweep "
                         f"--trace-routing` (engine reference).")

    try:
        with zipfile.ZipFile(path) as z:
            shapes = _member_shapes(z, bad)
        with np.load(path, allow_pickle=False) as f:
            header_text = f["header"]
            arrays = {k: f[k] for k in ROW_ARRAYS}
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise bad(f"cannot read it: {e}") from None
    if header_text.shape != () or header_text.dtype.kind != "U" or len(str(header_text)) > MAX_HEADER:
        raise bad("its header is not one JSON string")
    try:
        header = json.loads(str(header_text))
    except ValueError:
        raise bad("its header is not JSON") from None
    _check_header(header, bad)
    T = len(arrays["step"])
    L, k, E = len(header["moe_layers"]), header["k"], header["n_expert"]
    for name, t in ROW_ARRAYS.items():
        want = (T, L, k) if name in ("ids", "weights") else (T,)
        if arrays[name].dtype != t or arrays[name].shape != want or shapes[name] != want:
            raise bad(f"{name} is {arrays[name].dtype} {arrays[name].shape}, expected {np.dtype(t)} {want}")
    ids, seg, phase = arrays["ids"], arrays["segment"], arrays["phase"]
    if T and (ids.min() < 0 or ids.max() >= E):
        raise bad(f"expert ids outside 0..{E - 1}")
    if T and (seg.min() < 0 or seg.max() >= len(header["segments"]) or phase.max() > 1):
        raise bad("segment or phase values out of range")
    if T and (np.any(np.diff(arrays["step"]) < 0) or arrays["pos"].min() < 0):
        raise bad("steps out of order or negative positions")
    return Trace(header, **arrays)


def _member_shapes(z: zipfile.ZipFile, bad) -> dict[str, tuple]:
    """Each .npy member's declared shape, read from its own header and checked against the bounds and the size
    the zip directory gives, before numpy allocates anything."""
    out = {}
    for name in ("header", *ROW_ARRAYS):
        try:
            info = z.getinfo(f"{name}.npy")
        except KeyError:
            raise bad(f"it has no {name} array") from None
        with z.open(info) as m:
            version = np.lib.format.read_magic(m)
            if version not in ((1, 0), (2, 0)):
                raise bad(f"{name}: .npy version {version} (1.0 or 2.0 expected)")
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(m)
            if dtype.hasobject or fortran:
                raise bad(f"{name}: object or Fortran-ordered array")
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if len(shape) > 3 or n > MAX_VALUES or (shape and shape[0] > MAX_ROWS) \
                    or n * dtype.itemsize > info.file_size:
                raise bad(f"{name}: shape {shape} is too large or larger than its data")
            out[name] = tuple(shape)
    return out


def _check_header(h, bad) -> None:
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise bad(f"format is not {FORMAT!r}")
    for key, t in HEADER_KEYS.items():
        if not isinstance(h.get(key), t) or (t is int and isinstance(h[key], bool)):
            raise bad(f"header {key!r} is missing or not a {t.__name__}")
    L, E, k = len(h["moe_layers"]), h["n_expert"], h["k"]
    if not (1 <= E <= np.iinfo(np.int16).max and 1 <= k <= E and 1 <= L <= 4096):
        raise bad(f"n_expert {E}, k {k} or {L} MoE layers out of range")
    ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40 for x in xs)
    if not ints(h["moe_layers"]) or not ints(h["expert_bytes"]) or len(h["expert_bytes"]) != L:
        raise bad("moe_layers or expert_bytes are not one whole number per MoE layer")
    n = len(h["segments"])
    if n > 4096 or len(h["streams"]) != n or len(h["token_hash"]) != n or not all(
            isinstance(x, str) and len(x) <= 256 for x in h["segments"] + h["streams"] + h["token_hash"]):
        raise bad("segments, streams and token_hash are not one short string per segment")


@dataclass
class TraceRecorder:
    """What the engine calls while it runs, to build a trace: segment(name, tokens, stream) before a
    workload's first run and segment(None) after it (that writes the file); at(pos, phase) before each prefill or
    decode call; step(n) at the start of each forward pass of n tokens (positions pos, pos+1, ...); record(li, ids,
    weights) once per MoE layer of that pass (li: index into header["moe_layers"]). Outside a segment every call
    returns at once, so an engine keeps one recorder (or None when tracing is off)."""
    path: Path
    header: dict                       # HEADER_KEYS but segments/streams/token_hash (kept here)
    _rows: list[tuple[np.ndarray, ...]] = field(default_factory=list)   # one (ids, weights, pos, step, phase, seg)
    _cur: tuple[np.ndarray, np.ndarray] | None = None                  # the open step's ids, weights (n, L, k)
    _segments: list[tuple[str, str, str]] = field(default_factory=list)  # (name, stream, token hash)
    _on: bool = False
    _pos: int = 0
    _phase: int = 0
    _step: int = 0

    def segment(self, name: str | None, tokens: Sequence[int] = (), stream: str = "random") -> None:
        if name is None:
            if self._on:
                self._close_step()
                self._on = False
                self.save()
            return
        self._close_step()
        self._segments.append((name, stream, token_hash(tokens)))
        self._on = True

    def at(self, pos: int, phase: int) -> None:
        self._close_step()                 # the last pass of the previous call, at its own positions
        self._pos, self._phase = pos, phase

    def step(self, n: int) -> None:
        if not self._on:
            return
        self._close_step()
        L, k = len(self.header["moe_layers"]), self.header["k"]
        self._cur = (np.full((n, L, k), -1, np.int16), np.zeros((n, L, k), np.float16))

    def record(self, li: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """ids, weights: (n, k) of MoE layer li for the open step's n tokens."""
        if self._cur is not None:
            self._cur[0][:, li] = ids
            self._cur[1][:, li] = weights

    def _close_step(self) -> None:
        if self._cur is None:
            return
        n = len(self._cur[0])
        self._rows.append((*self._cur, np.arange(self._pos, self._pos + n, dtype=np.int32),
                           np.full(n, self._step, np.int32), np.full(n, self._phase, np.uint8),
                           np.full(n, len(self._segments) - 1, np.int16)))
        self._pos, self._step, self._cur = self._pos + n, self._step + 1, None

    def trace(self) -> Trace:
        self._close_step()
        L, k = len(self.header["moe_layers"]), self.header["k"]
        cols = list(zip(*self._rows)) or [np.zeros((0, L, k), np.int16), np.zeros((0, L, k), np.float16),
                                          *(np.zeros(0, t) for t in (np.int32, np.int32, np.uint8, np.int16))]
        arrays = {name: np.concatenate(c) if isinstance(c, tuple) else c for name, c in zip(ROW_ARRAYS, cols)}
        names, streams, hashes = (list(x) for x in zip(*self._segments)) if self._segments else ([], [], [])
        header = {"format": FORMAT} | self.header | {"segments": names, "streams": streams, "token_hash": hashes}
        return Trace(header, **arrays)

    def save(self) -> None:
        save_trace(self.path, self.trace())
