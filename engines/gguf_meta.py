"""Read and validate a GGUF file's header and tensor table (no weights are loaded).

GGUF files are untrusted input: every count, length, size and offset is checked against the file before anyone
allocates memory for it, and every string is cut and cleaned (clean_text) before anyone prints or stores it.
Used by the runner (depth checks, fingerprints), the engines and `plan`.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import expert_layer
from engines.errors import UserError

GGUF_MAGIC = b"GGUF"
MAX_DIM = 1 << 40
GGML_MAX_NAME, GGML_MAX_DIMS = 64, 4          # ggml.h: a tensor name is < 64 bytes; at most 4 dimensions
GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # value type -> bytes
GGUF_STRING, GGUF_ARRAY = 8, 9
# Strings from a model file are untrusted: names and other metadata strings are cut to TEXT_LIMIT characters
# (a 4 MiB general.name once broke every CSV reader) and lose their control characters (terminal escapes).
TEXT_LIMIT = 256
ARRAY_LIMIT = 4096            # numeric arrays up to this length are kept (per-layer counts); longer: their length
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_BREAKS = re.compile("[\t\n\r\x0b\x0c\x85\u2028\u2029]")
# tensors of 2+ dimensions that no product multiplies: read a row at a time (embeddings) or convolved
NOT_PRODUCT = re.compile(r"(^|\.)(token_embd|per_layer_token_embd|pos_embd|ssm_conv1d)\.")
# Architecture-relative keys every reader does arithmetic with: whole numbers (or one per layer), real numbers.
# A string or a bool there is refused by read_meta, so no caller's int()/float() ever meets one.
COUNT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "expert_count",
              "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
              "rope.dimension_count", "vocab_size")
REAL_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
             "rope.freq_base_swa")
# ggml type name -> (ggml type id, values per block, bytes per block): ggml/include/ggml.h, ggml-common.h.
# The types moebench writes, reads or computes with: those of the published files, and the 32-value types
# llama.cpp's quantizer falls back to when a row is not whole 256-value blocks.
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "IQ4_NL": (20, 32, 18), "MXFP4": (39, 32, 17),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "IQ4_XS": (23, 256, 136),
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ne: tuple[int, ...]        # ggml order (fastest-varying first): numpy shape is reversed(ne)
    ggml_type: str             # F32, F16, BF16, Q8_0, Q4_K, ...
    n_bytes: int               # bytes as stored in the file
    offset: int                # absolute file offset of the data
    layer: int | None          # block index of a routed-expert tensor, else None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


@dataclass
class ModelMeta:
    path: Path
    arch: str
    n_layers: int
    n_expert: int
    n_expert_used: int
    fields: dict                # every metadata key -> python value (strings cleaned; arrays as lists, not huge ones)
    tensors: list[TensorEntry]
    file_bytes: int
    fingerprint: str
    name: str = ""
    moe_layers: list[int] = field(default_factory=list)

    def get(self, key: str, default=None):
        """Metadata by arch-relative key (`block_count`) or full key (`general.name`)."""
        return self.fields.get(f"{self.arch}.{key}", self.fields.get(key, default))

    def expert_bytes(self, n_cpu_moe: int | None = None) -> int:
        """File bytes of routed-expert tensors, all of them or only those of layers < n_cpu_moe."""
        return sum(t.n_bytes for t in self.tensors
                   if t.layer is not None and (n_cpu_moe is None or t.layer < n_cpu_moe))

    def product_weights(self) -> list[TensorEntry]:
        """The weight matrices products multiply activations with (ggml's MUL_MAT / MUL_MAT_ID weights; what an
        engine's compute_dtype describes): every tensor of 2+ dimensions but embeddings and convolutions, and the
        token embedding where the file has no output.weight (the head reads it)."""
        tied = not any(t.name == "output.weight" for t in self.tensors)
        return [t for t in self.tensors if len(t.ne) >= 2
                and (not NOT_PRODUCT.search(t.name) or tied and t.name == "token_embd.weight")]

    @property
    def n_vocab(self) -> int:
        emb = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        return int(self.get("vocab_size") or (emb.ne[1] if emb else 0))


def clean_text(value, limit: int | None = TEXT_LIMIT, lines: bool = False) -> str:
    """`value` as text that is safe to print, store and render: no control characters (a terminal escape starts
    with ESC or CSI), no bidirectional overrides, at most `limit` characters (a cut ends in "…"). Line breaks
    and tabs become spaces, unless `lines` keeps them (multi-line error text; carriage returns still go).
    Every string read from a model file passes here once (read_meta); the writers and renderers again."""
    text = value if isinstance(value, str) else str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"          # cut first: cleaning then costs O(limit), not O(4 MiB)
    if not lines:
        text = _BREAKS.sub(" ", text)
    return _UNSAFE.sub("", text)


def _value(f) -> object:
    """A reader field as a Python value: strings decoded leniently and cleaned, small arrays as lists (per-layer
    arrays of up to ARRAY_LIMIT numbers, up to 64 strings), longer ones (token lists) as `<array of N>`."""
    import gguf

    text = lambda part: clean_text(bytes(part).decode("utf-8", errors="replace"))
    kind = f.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return text(f.parts[f.data[0]])
    if kind != gguf.GGUFValueType.ARRAY:
        return f.contents()
    n = len(f.data)
    sub = f.types[1] if len(f.types) > 1 else None
    if n == 0:
        return []
    if sub == gguf.GGUFValueType.STRING:
        return [text(f.parts[i]) for i in f.data] if n <= 64 else f"<array of {n}>"
    return f.contents() if n <= ARRAY_LIMIT and sub != gguf.GGUFValueType.ARRAY else f"<array of {n}>"


def _check_types(fields: dict, arch: str, path: Path) -> None:
    """One sentence when a key of COUNT_KEYS holds anything but whole numbers, or one of REAL_KEYS anything but
    a number (what the numbers mean is judged by the shared model checks, harness.run.checks)."""
    for key in COUNT_KEYS + REAL_KEYS:
        v = fields.get(f"{arch}.{key}")
        values = v if isinstance(v, list) and key in COUNT_KEYS else [] if v is None else [v]
        kinds = (int,) if key in COUNT_KEYS else (int, float)
        if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in values):
            what = "a whole number (or one per layer)" if key in COUNT_KEYS else "a number"
            raise UserError(f"{str(path)!r}: metadata {arch}.{key} = {clean_text(repr(v), 80)} is not {what}; the "
                            "file is corrupt: re-download or re-create it.")


def _count(fields: dict, key: str) -> int:
    """A count from type-checked metadata: 0 when absent, the largest entry of a per-layer array."""
    v = fields.get(key)
    return max(v, default=0) if isinstance(v, list) else int(v or 0)


def _type_block(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type: GGML_TYPES, else the gguf package's table of all."""
    if type_name in GGML_TYPES:
        return GGML_TYPES[type_name][1:]
    import gguf
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def tensor_bytes(type_name: str, shape) -> int:
    """Bytes a tensor of this ggml type and shape (numpy or ggml order) occupies; rows must be whole blocks."""
    block, block_bytes = _type_block(type_name)
    return math.prod(shape) // block * block_bytes       # python ints: no overflow, unlike np.prod


def check_layout(buf, size: int) -> None:
    """Walk the header (counts, key/value pairs, tensor infos) before the gguf reader does, so a count or length
    that claims more than the file holds is one error here rather than a loop of 2**60 steps there.
    Raises ValueError naming the first problem."""
    order = "<" if int.from_bytes(buf[4:8], "little") & 0xFFFF else ">"     # big-endian files: gguf's own rule
    pos = 4

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n < 0 or n > size - pos:
            raise ValueError(f"{what} at byte {pos} runs past the end of the file ({size} bytes; truncated?)")
        pos += n
        return pos - n

    def num(fmt: str, what: str) -> int:
        return struct.unpack_from(order + fmt, buf, take(struct.calcsize(fmt), what))[0]

    def string(what: str, limit: int | None = None) -> bytes:
        n = num("Q", f"the length of {what}")
        if limit is not None and n >= limit:
            raise ValueError(f"{what} is {n} bytes long (ggml allows at most {limit - 1})")
        return bytes(buf[take(n, what):pos])

    def value(kind: int, what: str) -> None:
        if kind in GGUF_SCALARS:
            take(GGUF_SCALARS[kind], what)
        elif kind == GGUF_STRING:
            take(num("Q", f"the length of {what}"), what)
        elif kind == GGUF_ARRAY:
            sub, n = num("I", f"the element type of {what}"), num("Q", f"the length of {what}")
            if sub in GGUF_SCALARS:
                take(n * GGUF_SCALARS[sub], what)
            elif sub == GGUF_STRING:
                if n * 8 > size - pos:
                    raise ValueError(f"{what} claims {n} strings, more than the file holds")
                for _ in range(n):
                    take(num("Q", f"a string length in {what}"), what)
            else:
                raise ValueError(f"{what} has invalid element type {sub}")
        else:
            raise ValueError(f"{what} has invalid value type {kind}")

    version = num("I", "the version")
    n_tensors, n_kv = num("Q", "the tensor count"), num("Q", "the metadata count")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    for i in range(n_kv):
        what = f"metadata key #{i}"
        key = string(what)
        value(num("I", f"the type of {what}"), f"metadata {clean_text(repr(key.decode(errors='replace')), 80)}")
    for i in range(n_tensors):
        name = string(f"the name of tensor #{i}", GGML_MAX_NAME)
        if not name or _UNSAFE.search(name.decode(errors="replace")):
            raise ValueError(f"tensor #{i} has an empty name or one with control characters")
        n_dims = num("I", f"the dimension count of tensor #{i}")
        if not 0 < n_dims <= GGML_MAX_DIMS:
            raise ValueError(f"tensor {name.decode(errors='replace')!r} has {n_dims} dimensions (ggml: 1..4)")
        take(8 * n_dims + 4 + 8, f"the shape, type and offset of tensor #{i}")


def fingerprint(path: Path, header_bytes: int) -> str:
    """sha256 over size + header + the first and last MiB of data: stable, fast, changes with the weights."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(min(header_bytes, 64 << 20)))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def read_meta(path: str | Path, require_moe: bool = True) -> ModelMeta:
    """Parse and validate a GGUF file; raise UserError with one sentence on anything wrong.
    Checked here: the layout (every count, length and offset against the file), tensor names (< 64 bytes, no
    control characters), shapes, types and byte sizes (whole blocks of the type; data inside the file, no two
    tensors overlapping). Every string is cleaned (clean_text). What the numbers mean is judged by the shared
    model checks (harness.run.checks) before a sweep runs anything."""
    import gguf  # heavy-ish; keep CLI start fast

    path = Path(path)
    if not path.is_file():
        raise UserError(f"Model file {str(path)!r} does not exist; pass the path of a .gguf file or synthesize one "
                        f"with `moebench model synth`.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserError(f"{str(path)!r} is not a GGUF file (bad magic); pass a .gguf model file.")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            check_layout(buf, size)
        reader = gguf.GGUFReader(path)
        tensors = []
        for t in reader.tensors:
            name, ne, kind = t.name, tuple(int(d) for d in t.shape), t.tensor_type.name
            if any(d <= 0 or d > MAX_DIM for d in ne):
                raise ValueError(f"tensor {name!r} has invalid shape {ne}")
            block, _ = _type_block(kind)
            if ne[0] % block:
                raise ValueError(f"tensor {name!r} of type {kind} has rows of {ne[0]} values, not whole blocks of "
                                 f"{block}")
            n_bytes = tensor_bytes(kind, ne)
            if t.data_offset < reader.data_offset or t.data_offset + n_bytes > size:
                raise ValueError(f"tensor {name!r} ({kind}, shape {ne}: {n_bytes} bytes) lies outside the file")
            tensors.append(TensorEntry(name, ne, kind, n_bytes, int(t.data_offset), expert_layer(name)))
        ordered = sorted(tensors, key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.n_bytes > b.offset:
                raise ValueError(f"tensors {a.name!r} and {b.name!r} overlap in the file")
        fields = {clean_text(k): _value(v) for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        header = reader.data_offset
    except UserError:
        raise
    except Exception as e:  # the gguf reader raises many kinds on corrupt input; its text may quote the file
        raise UserError(f"{str(path)!r} is not a valid GGUF file ({clean_text(e, 200)}); re-download or "
                        "re-create it.") from None

    arch = fields.get("general.architecture", "")
    n_layers = fields.get(f"{arch}.block_count")
    if not isinstance(arch, str) or not arch or isinstance(n_layers, bool) or not isinstance(n_layers, int) \
            or not 0 < n_layers < 100_000:
        raise UserError(f"{str(path)!r} lacks a valid general.architecture/block_count; it is not a usable model file.")
    _check_types(fields, arch, path)
    n_expert = _count(fields, f"{arch}.expert_count")
    moe_layers = sorted({t.layer for t in tensors if t.layer is not None})
    if require_moe and (n_expert < 2 or not moe_layers):
        raise UserError(f"{str(path)!r} ({arch}) is not a Mixture-of-Experts model (no routed expert tensors); "
                        "moebench needs an MoE GGUF such as qwen3moe.")
    if moe_layers and moe_layers[-1] >= n_layers:
        raise UserError(f"{str(path)!r} has expert tensors for layer {moe_layers[-1]} but only {n_layers} layers; the "
                        f"file is corrupt.")
    name = fields.get("general.name")
    return ModelMeta(path=path, arch=arch, n_layers=n_layers, n_expert=n_expert,
                     n_expert_used=_count(fields, f"{arch}.expert_used_count"), fields=fields,
                     tensors=tensors, file_bytes=size, fingerprint=fingerprint(path, header),
                     name=clean_text(path.stem if name is None else name), moe_layers=moe_layers)
