"""What the lent GPU machine cannot fetch (it has no network), made here: `benchmarks/gpu_check.sh --prepare`.

.gpu/ (git-ignored by its own .gitignore "*"; named in the device tool's `carry`, so it travels):
  llama-cpp-python-<V>-cuda-src.tar.xz   llama-cpp-python's sdist minus everything a CUDA build of the Python
                                         bindings never reads (TRIM), with two defaults patched (PATCHES)
  wheels/<name>-<version>-*.whl          the pure-Python packages the GPU image lacks (WHEELS)
  manifest.json                          what is there: names, sizes, sha256, patches, source

`check()` reads it back (the dry run and the GPU run both call it): every file present with its sha256,
the archive holding what the build needs and nothing TRIM drops, the patches in place, and the working
tree plus .gpu/ inside the 64 MiB that travel. `verify_build_tree()` (run by --prepare) configures the
trimmed tree with CMake and runs every compile step as a dependency scan, so a file that the trim dropped
but the build needs is found here, not on the GPU machine.
"""
from __future__ import annotations

import hashlib
import io
import json
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / ".gpu"
LLAMA_VERSION = "0.3.36"                     # pyproject.toml pins llama-cpp-python==0.3.36
ARCHIVE = f"llama-cpp-python-{LLAMA_VERSION}-cuda-src.tar.xz"
PREFIX = f"llama_cpp_python-{LLAMA_VERSION}"   # the archive's top folder, as in the sdist
WHEELS = ("gguf", "diskcache")              # moebench needs gguf; llama_cpp imports diskcache; the image has the rest
TRAVEL_LIMIT = 64 << 20                     # the device tool sends at most 64 MiB (tree + carried paths)
TRAVEL_MARGIN = 8 << 20                     # room for the files other people add to the tree meanwhile

# Paths (relative to the sdist root) a CUDA build of the bindings never reads. Other ggml backends are
# only add_subdirectory'd when their GGML_<NAME> option is on; common/ and cpp-httplib only with
# LLAMA_BUILD_COMMON, tools/ only with LLAVA_BUILD (both patched off below). The biggest: .git 39 MB
# (the sdist ships llama-cpp-python's git history), models 75 MB, docs 38 MB.
_V = "vendor/llama.cpp/"
TRIM = (".git", ".github", "docker", "docs", "examples", "tests", "scripts",
        _V + ".git", _V + ".github", _V + ".devops", _V + ".gemini", _V + ".pi", _V + "docs", _V + "models",
        _V + "tools", _V + "tests", _V + "examples", _V + "benches", _V + "media", _V + "gguf-py",
        _V + "conversion", _V + "scripts", _V + "pocs", _V + "app", _V + "grammars", _V + "requirements",
        _V + "skills", _V + "ci", _V + "common", _V + "vendor/cpp-httplib",
        *(_V + "ggml/src/ggml-" + b for b in ("blas", "cann", "et", "hexagon", "hip", "metal", "musa", "opencl",
                                               "openvino", "rpc", "sycl", "virtgpu", "vulkan", "webgpu", "zdnn",
                                               "zendnn", "kompute")))
# What the build reads first: the archive must hold these (check() looks).
REQUIRED = ("CMakeLists.txt", "pyproject.toml", "README.md", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py",
            _V + "CMakeLists.txt", _V + "include/llama.h", _V + "src/llama.cpp", _V + "ggml/CMakeLists.txt",
            _V + "ggml/src/ggml-cuda/CMakeLists.txt", _V + "ggml/src/ggml-cuda/ggml-cuda.cu",
            _V + "ggml/src/ggml-cpu/CMakeLists.txt", _V + "vendor/CMakeLists.txt")
# (file, exact text, replacement, why). The top CMakeLists.txt FORCEs LLAMA_BUILD_COMMON on (a command line
# cannot turn it off): libllama-common (53 C++ files, with cpp-httplib) serves only mtmd and the tools.
PATCHES = (
    ("CMakeLists.txt", 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)',
     'set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)  # moebench gpu_check',
     "libllama-common serves only mtmd and the tools, none of which the bindings load"),
    ("CMakeLists.txt", 'option(LLAVA_BUILD "Build llava shared library and install alongside python package" ON)',
     'option(LLAVA_BUILD "Build llava shared library and install alongside python package" OFF)  # moebench',
     "mtmd (multimodal) is loaded only by llama_chat_format's vision handlers; tools/ is trimmed"),
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trimmed(rel: str) -> bool:
    return any(rel == t or rel.startswith(t + "/") for t in TRIM)


# --- making .gpu/ -------------------------------------------------------------------------------------

def find_sdist(given: str | None, work: Path) -> Path:
    """The unpacked sdist root: `given` (a folder or the .tar.gz), else pip's download (its cache first)."""
    if given:
        p = Path(given).expanduser()
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_VERSION}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(work), "-q"], check=True)
        p = next(work.glob("llama_cpp_python-*.tar.gz"))
    if p.is_file():
        with tarfile.open(p) as tf:
            tf.extractall(work / "sdist", filter="data")
        p = next((work / "sdist").iterdir())
    if not (p / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise SystemExit(f"{p} is not llama-cpp-python's sdist (no vendor/llama.cpp/CMakeLists.txt).")
    return p


def _patched(rel: str, data: bytes) -> bytes:
    for name, old, new, _ in PATCHES:
        if name == rel:
            text = data.decode()
            if text.count(old) != 1:
                raise SystemExit(f"{rel}: expected exactly one line `{old}` to patch; is this llama-cpp-python "
                                 f"{LLAMA_VERSION}? Update PATCHES in {Path(__file__).name}.")
            data = text.replace(old, new).encode()
    return data


def make_archive(src: Path, dest: Path) -> dict:
    """The trimmed, patched sources as a deterministic tar.xz (sorted, fixed mtime/owner: same input, same bytes)."""
    files = sorted(p for p in src.rglob("*") if (p.is_file() or p.is_symlink())
                   and not trimmed(p.relative_to(src).as_posix()))
    raw = 0
    with tarfile.open(dest, "w:xz", preset=6) as tf:
        for p in files:
            rel = p.relative_to(src).as_posix()
            info = tarfile.TarInfo(f"{PREFIX}/{rel}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 1700000000, 0, 0, "", ""
            if p.is_symlink():
                info.type, info.linkname = tarfile.SYMTYPE, str(p.readlink())
                tf.addfile(info)
                continue
            data = _patched(rel, p.read_bytes())
            info.size, info.mode = len(data), 0o755 if p.stat().st_mode & 0o111 else 0o644
            raw += len(data)
            tf.addfile(info, io.BytesIO(data))
    return {"name": dest.name, "bytes": dest.stat().st_size, "sha256": sha256(dest), "files": len(files),
            "unpacked_bytes": raw}


def fetch_wheels(dest: Path, wheel_dir: str | None) -> list[dict]:
    """The wheels of WHEELS at the versions installed here (what the CPU tests ran), from `wheel_dir` or pip."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in WHEELS:
        version = metadata.version(name)
        pattern = f"{name.replace('-', '_')}-{version}-*.whl"
        if wheel_dir:
            for w in Path(wheel_dir).glob(pattern):
                shutil.copy2(w, dest / w.name)
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
                            "--only-binary=:all:", "-d", str(dest), "-q"], check=True)
        wheel = next(dest.glob(pattern), None)
        if wheel is None:
            raise SystemExit(f"no wheel {pattern} found ({'in ' + wheel_dir if wheel_dir else 'from pip'}).")
        if not wheel.name.endswith("-py3-none-any.whl"):
            raise SystemExit(f"{wheel.name} is not a pure-Python wheel; the GPU machine (Python 3.12) may refuse it.")
        out.append({"name": wheel.name, "package": name, "version": version, "bytes": wheel.stat().st_size,
                    "sha256": sha256(wheel)})
    return out


def prepare(sdist: str | None, gpu_dir: Path = GPU_DIR, wheel_dir: str | None = None, verify: bool = True) -> dict:
    """Make gpu_dir (see the module doc); returns the manifest. verify: configure + include scan (needs cmake)."""
    gpu_dir.mkdir(parents=True, exist_ok=True)
    (gpu_dir / ".gitignore").write_text("*\n")      # ignored by git even without a .gitignore line elsewhere
    with tempfile.TemporaryDirectory(prefix="gpu-check-prepare-") as tmp:
        src = find_sdist(sdist, Path(tmp))
        for old in gpu_dir.glob("llama-cpp-python-*-cuda-src.tar.xz"):
            old.unlink()
        shutil.rmtree(gpu_dir / "wheels", ignore_errors=True)
        archive = make_archive(src, gpu_dir / ARCHIVE)
        manifest = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "llama_cpp_python": LLAMA_VERSION, "source": str(sdist or "pip download"),
                    "source_sha256": sha256(Path(sdist)) if sdist and Path(sdist).is_file() else None,
                    "archive": archive, "trimmed": list(TRIM),
                    "patches": [{"file": f, "from": a, "to": b, "why": w} for f, a, b, w in PATCHES],
                    "wheels": fetch_wheels(gpu_dir / "wheels", wheel_dir)}
        if verify:
            manifest["verify"] = verify_build_tree(gpu_dir / ARCHIVE)
    (gpu_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# --- checking .gpu/ -----------------------------------------------------------------------------------

def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what the device tool sends besides carried paths: tracked and untracked-not-ignored files."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((root / n).stat().st_size for n in out.decode().split("\0") if n and (root / n).is_file())


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def check(gpu_dir: Path = GPU_DIR, deep: bool = True) -> tuple[dict | None, list[str]]:
    """(manifest, problems): [] when gpu_dir holds what the GPU run needs. deep: also read the archive."""
    mf = gpu_dir / "manifest.json"
    if not mf.is_file():
        return None, [f"{gpu_dir} is not prepared (no manifest.json); run benchmarks/gpu_check.sh --prepare here."]
    m = json.loads(mf.read_text())
    problems = []
    if m.get("llama_cpp_python") != LLAMA_VERSION:
        problems.append(f"{mf}: llama-cpp-python {m.get('llama_cpp_python')}, but the project pins {LLAMA_VERSION}; "
                        f"run --prepare again.")
    entries = [m["archive"]] + [dict(w, name=f"wheels/{w['name']}") for w in m.get("wheels", [])]
    for e in entries:
        p = gpu_dir / e["name"]
        if not p.is_file():
            problems.append(f"{p} is missing; run --prepare again.")
        elif p.stat().st_size != e["bytes"] or sha256(p) != e["sha256"]:
            problems.append(f"{p}: size or sha256 differs from manifest.json (changed?); run --prepare again.")
    have = {w.get("package") for w in m.get("wheels", [])}
    problems += [f"manifest.json lists no {n} wheel; run --prepare again." for n in WHEELS if n not in have]
    total = tree_bytes() + dir_bytes(gpu_dir)
    if total > TRAVEL_LIMIT - TRAVEL_MARGIN:
        problems.append(f"the working tree plus {gpu_dir.name}/ is {total / 2**20:.1f} MiB; the device tool sends at "
                        f"most {TRAVEL_LIMIT >> 20} MiB (keep {TRAVEL_MARGIN >> 20} MiB spare).")
    if deep and not problems:
        problems += check_archive(gpu_dir / m["archive"]["name"])
    return m, problems


def check_archive(path: Path) -> list[str]:
    """The archive holds REQUIRED, nothing TRIM drops, and the patched lines."""
    problems = []
    with tarfile.open(path) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        problems += [f"{path.name} lacks {r}" for r in REQUIRED if r not in names]
        problems += [f"{path.name} holds {n}, which TRIM drops" for n in sorted(names) if trimmed(n)][:5]
        if "CMakeLists.txt" in names:
            top = tf.extractfile(f"{PREFIX}/CMakeLists.txt").read().decode()
            problems += [f"{path.name}: {f} is not patched ({why})" for f, _, new, why in PATCHES
                         if f == "CMakeLists.txt" and new not in top]
    return problems


# --- verifying the trimmed tree builds (here, once, by --prepare) -------------------------------------

def verify_build_tree(archive: Path, jobs: int = 2) -> dict:
    """Configure the trimmed tree as the GPU machine will (CUDA on when nvcc is here; the cuBLAS libraries need
    not exist to configure), then run every compile step as a dependency scan (the compiler's -M: the real
    preprocessor, the real macros, ~1 s a CUDA file): a file the trim dropped but a step includes fails it.
    cuBLAS's header may be missing here; an empty stand-in (last on the include path) lets the scan go on."""
    if not shutil.which("cmake"):
        return {"skipped": "no cmake here"}
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(prefix="gpu-check-verify-") as tmp:
        tmp = Path(tmp)
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        src, build, stub = tmp / PREFIX, tmp / "b", tmp / "stub"
        stub.mkdir()
        (stub / "cublas_v2.h").write_text("/* stand-in for the dependency scan only */\n")
        cuda = bool(shutil.which("nvcc"))
        args = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAVA_BUILD=OFF",
                f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", "-DGGML_CUDA_NO_VMM=ON", "-DGGML_CUDA_NCCL=OFF",
                "-DGGML_CUDA_FA=OFF", "-DCMAKE_CUDA_ARCHITECTURES=90-real",
                "-DCUDA_cublas_LIBRARY=/nonexistent/libcublas.so.13",
                "-DCUDA_cublasLt_LIBRARY=/nonexistent/libcublasLt.so.13"]
        args += ["-G", "Ninja"] if shutil.which("ninja") else []
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"CMake cannot configure the trimmed tree:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
        if not (build / "build.ninja").is_file():
            return {"configured_cuda": cuda, "skipped": "dependency scan needs ninja"}
        text = subprocess.run(["ninja", "-C", str(build), "-t", "commands"], capture_output=True, text=True).stdout
        scans = [_dependency_scan(line, stub) for line in text.splitlines() if " -c " in line]
        scans = [s for s in scans if s]
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(lambda a: subprocess.run(a, cwd=build, capture_output=True, text=True), scans))
        failed = [f"{a[a.index('-M') + 1]}: {_first_error(r.stderr) or r.returncode}"
                  for a, r in zip(scans, results) if r.returncode]
        if failed:
            raise SystemExit("the trimmed tree lacks files the build includes:\n  " + "\n  ".join(failed[:10]))
        return {"configured_cuda": cuda, "compile_steps": len(scans),
                "cuda_steps": sum(1 for a in scans if a[a.index("-M") + 1].endswith(".cu")),
                "dependency_scan": "every compile step's includes resolve"}


def _first_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    return next((x for x in lines if "error" in x), lines[0] if lines else "")


def _dependency_scan(line: str, stub: Path) -> list[str] | None:
    """A compile command turned into `<compiler> <flags> -M <source>` (no object, no depfile)."""
    toks, out, i = shlex.split(line), [], 0
    if "-c" not in toks:
        return None
    while i < len(toks):
        t = toks[i]
        if t == "-MD":
            i += 1
        elif t in ("-MT", "-MF", "-o"):
            i += 2
        elif t == "-c":
            out += ["-M", toks[i + 1]]
            i += 2
        else:
            out.append(t)
            i += 1
    return out[:-2] + [f"-I{stub}"] + out[-2:]


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="gpu_check.sh --prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", help="llama-cpp-python's sdist (.tar.gz or unpacked folder); default: pip download")
    ap.add_argument("--gpu-dir", default=str(GPU_DIR), help="where to write (default: .gpu/ in the repository)")
    ap.add_argument("--wheel-dir", help="take the wheels from this folder instead of pip")
    ap.add_argument("--no-verify", action="store_true", help="skip the CMake configure + include scan")
    a = ap.parse_args(argv)
    m = prepare(a.sdist, Path(a.gpu_dir), a.wheel_dir, verify=not a.no_verify)
    _, problems = check(Path(a.gpu_dir))
    print(json.dumps({k: m[k] for k in ("archive", "wheels", "verify") if k in m}, indent=2))
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if problems else 0
