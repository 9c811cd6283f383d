"""Where the optional peer engines' packages live: each in its own directory, never in the project's environment.

`make peers` (scripts/install_peers.py) puts each wheel with `pip install --no-deps --target` into
<venv>/peers/<distribution>/: ik-llama-cpp-python ships top-level `lib/`, `include/` and `bin/`, and kt-kernel declares
torch==2.9.1 and brings top-level `sgl_kernel`, `deep_gemm` and `triton_kernels`, so neither may touch the project's
site-packages. Only a cell's worker that runs such an engine puts the directory on its path, after everything else:
the project's own packages (torch, numpy) always win.
"""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

PEERS = {"ik-llama-cpp-python": "0.1.5", "kt-kernel": "0.7.2"}   # distribution -> the version the engines are built for
# what a peer imports that it does not bring and the project's environment lacks (installed beside it, --no-deps too:
# kt-kernel's other requirements are torch, which it does not link, and packages the project already has)
PEER_DEPS = {"kt-kernel": ["safetensors>=0.4"]}


def peer_dir(dist: str) -> Path:
    return Path(sys.prefix) / "peers" / dist


def installed(dist: str) -> str | None:
    """The version of `dist` installed in its peer directory, else None."""
    found = [d for d in metadata.distributions(path=[str(peer_dir(dist))]) if d.metadata["Name"].lower() == dist]
    return found[0].version if found else None


def missing(dist: str) -> str | None:
    """None when `dist` is installed at the version the engines are built for, else one sentence on how to get it."""
    have, want = installed(dist), PEERS[dist]
    if have == want:
        return None
    what = f"{dist} {have} is installed, not {want}" if have else f"{dist} is not installed"
    return f"{what} (in {peer_dir(dist)}); install it with `make peers`."


def use(dist: str) -> Path:
    """Put the peer directory on this process's import path (last) and return it."""
    where = peer_dir(dist)
    if str(where) not in sys.path:
        sys.path.append(str(where))
    return where
