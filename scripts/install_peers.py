"""`make peers`: install the optional peer engines' packages, each into its own directory (engines/peers.py says why).

ik-llama-cpp-python (the ik-llama-cpp engine) and kt-kernel (the reference engine's experts=kt) go to
<venv>/peers/<distribution>/ with `pip install --no-deps --target`, so neither can replace the project's torch or put
its top-level directories into the project's site-packages. Run again, it reinstalls only what is missing or another
version.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # the project's engines package, from any directory

from engines.peers import PEER_DEPS, PEERS, installed, peer_dir  # noqa: E402


def main() -> int:
    for dist, version in PEERS.items():
        where = peer_dir(dist)
        if installed(dist) == version:
            print(f"{dist} {version}: already in {where}")
            continue
        shutil.rmtree(where, ignore_errors=True)         # another version's files must not stay beside the new ones
        print(f"installing {dist} {version} into {where}", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary", ":all:",
                            "--target", str(where), f"{dist}=={version}", *PEER_DEPS.get(dist, [])])
        if r.returncode:
            print(f"error: pip could not install {dist}=={version} (exit code {r.returncode}); its engine stays "
                  f"unavailable (`moebench engines` says why).", file=sys.stderr)
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
