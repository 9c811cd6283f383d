"""Read and validate a GGUF file's header and tensor table (no weights are loaded).

GGUF files are untrusted input: every size and offset is checked against the file before anyone
allocates memory for it. Used by the runner (depth checks, fingerprints), the engines and `plan`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import expert_layer
from engines.errors import UserError

GGUF_MAGIC = b"GGUF"
MAX_DIM = 1 << 40
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
    fields: dict                # every metadata key -> python value (arrays as lists, but not huge ones)
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

    @property
    def n_vocab(self) -> int:
        emb = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        return int(self.get("vocab_size") or (emb.ne[1] if emb else 0))


def _scalar(field_) -> object:
    """A reader field as a Python value; long arrays (token lists) are summarized by their length."""
    if len(field_.types) > 1 and len(field_.data) > 64:
        return f"<array of {len(field_.data)}>"
    return field_.contents()


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
    """Parse and validate a GGUF file; raise UserError with one sentence on anything wrong."""
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
        reader = gguf.GGUFReader(path)
        tensors = []
        for t in reader.tensors:
            ne = tuple(int(d) for d in t.shape)
            if any(d <= 0 or d > MAX_DIM for d in ne) or not t.name:
                raise ValueError(f"tensor {t.name!r} has invalid shape {ne}")
            if t.data_offset < reader.data_offset or t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name!r} data lies outside the file")
            tensors.append(TensorEntry(t.name, ne, t.tensor_type.name, int(t.n_bytes), int(t.data_offset),
                                       expert_layer(t.name)))
        fields = {k: _scalar(v) for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        header = reader.data_offset
    except UserError:
        raise
    except Exception as e:  # the gguf reader raises many kinds on corrupt input
        raise UserError(f"{str(path)!r} is not a valid GGUF file ({e}); re-download or re-create it.") from None

    arch = str(fields.get("general.architecture", ""))
    n_layers = fields.get(f"{arch}.block_count")
    if not arch or not isinstance(n_layers, int) or not 0 < n_layers < 100_000:
        raise UserError(f"{str(path)!r} lacks a valid general.architecture/block_count; it is not a usable model file.")
    n_expert = int(fields.get(f"{arch}.expert_count") or 0)
    moe_layers = sorted({t.layer for t in tensors if t.layer is not None})
    if require_moe and (n_expert < 2 or not moe_layers):
        raise UserError(f"{str(path)!r} ({arch}) is not a Mixture-of-Experts model (no routed expert tensors); "
                        "moebench needs an MoE GGUF such as qwen3moe.")
    if moe_layers and moe_layers[-1] >= n_layers:
        raise UserError(f"{str(path)!r} has expert tensors for layer {moe_layers[-1]} but only {n_layers} layers; the "
                        f"file is corrupt.")
    return ModelMeta(path=path, arch=arch, n_layers=n_layers, n_expert=n_expert,
                     n_expert_used=int(fields.get(f"{arch}.expert_used_count") or 0), fields=fields,
                     tensors=tensors, file_bytes=size, fingerprint=fingerprint(path, header),
                     name=str(fields.get("general.name", path.stem)), moe_layers=moe_layers)
