"""What the memory sampler costs the engine it watches, measured interleaved in one run.

A child process keeps llama.cpp (the llama-cpp engine) loaded and runs pp512 or tg128 repetitions on
request; the parent turns a Sampler (50 ms) on for even blocks and off for odd ones (ABAB), so machine
drift falls on both sides. Prints medians, their ratio and a Mann-Whitney p-value.

    .venv/bin/python benchmarks/sampler_overhead.py [MODEL.gguf]   (default: preset small, synthesized once)
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.run.sampler import Sampler  # noqa: E402
from workloads.synth import cached_model  # noqa: E402

CHILD = r'''
import sys, time
from pathlib import Path
from engines.base import EngineSettings
from engines.llama_cpp import LlamaCppEngine
from workloads.tokens import token_stream
e = LlamaCppEngine(); e.load(Path(sys.argv[2]), EngineSettings(n_ctx=1024, threads=2))
toks, kind = token_stream(512, e.meta.n_vocab), sys.argv[1]
print("ready", flush=True)
for _ in sys.stdin:
    e.reset(); t = time.perf_counter_ns()
    if kind == "pp":
        e.prefill(toks)
    else:
        for x in toks[:128]:
            e.decode(x)
    print(time.perf_counter_ns() - t, flush=True)
'''


def main(model: Path, blocks: int = 12, reps: int = 3) -> None:
    from scipy.stats import mannwhitneyu

    for kind, n_tok in (("pp", 512), ("tg", 128)):
        p = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(model)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout.readline().strip() == "ready"
        tps: dict[str, list[float]] = {"on": [], "off": []}
        for block in range(blocks):
            mode = "on" if block % 2 == 0 else "off"
            s = Sampler(p.pid, 50) if mode == "on" else None
            if s:
                s.start()
            for _ in range(reps):
                p.stdin.write("go\n")
                p.stdin.flush()
                tps[mode].append(n_tok / (int(p.stdout.readline()) / 1e9))
            if s:
                s.stop()
        p.kill()
        on, off = statistics.median(tps["on"]), statistics.median(tps["off"])
        print(f"{kind}{n_tok}: sampler on {on:.1f} tok/s, off {off:.1f} tok/s (median of {len(tps['on'])} each, "
              f"ABAB blocks), on/off = {on / off:.4f}, Mann-Whitney p = "
              f"{mannwhitneyu(tps['on'], tps['off']).pvalue:.2g}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else cached_model("preset:small"))
