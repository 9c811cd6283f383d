"""TensorSharp's CLI benchmark (`TensorSharp.Cli --benchmark`) as an engine.

Not installable here (it needs .NET and a native ggml build): get it from
https://github.com/zhongkaifu/TensorSharp, build TensorSharp.Cli, and pass `--tensorsharp PATH`,
set MOEBENCH_TENSORSHARP, or put `TensorSharp.Cli` on PATH.

One process per workload, the command TensorSharp's own comparisons used:
  TensorSharp.Cli --model F --backend ggml_cuda|ggml_cpu --n-cpu-moe N --benchmark
      --bench-prefill P --bench-decode D --bench-runs R --bench-fixed-tokens
with MAX_CONTEXT = P + D rounded up to 256 and every inherited TS_* variable cleared (the flag sets
the depth). ppN -> P=N, D=0 (prefill-only runs); tgN@dD -> P=D, D=N (decode after a D-token prefill;
tgN without @d prefills 1 token, the least a decode can follow). ppN@dD has no TensorSharp form.
R = warm-up + repetitions; the first warm-up runs are dropped, as its comparisons did.

It prints, per run and once at the end (through its logger, so lines may carry a prefix):
  benchmark run i/R: prefillMs=... prefillTps=... decodeMs=... decodeTps=... msPerTok=...
  benchmark summary: bestPrefillMs=... bestPrefillTps=... bestDecodeMs=... ... avgDecodeTps=...
A metric that was not run prints NaN (e.g. decodeTps with --bench-decode 0).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import EngineInfo, EngineSettings
from engines.external import ExternalEngine, ExternalError, tail
from engines.gguf_meta import read_meta

_RUN = re.compile(r"benchmark run (\d+)/(\d+):(.*)")
_SUMMARY = re.compile(r"benchmark summary:(.*)")
_PAIR = re.compile(r"(\w+)=(\S+)")


def number(text: str) -> float:
    """A .NET-formatted double: NaN, ∞/-∞ (or Infinity), or a plain number; anything else is NaN."""
    t = text.strip().rstrip(",;")
    t = {"∞": "inf", "-∞": "-inf", "Infinity": "inf", "-Infinity": "-inf"}.get(t, t)
    try:
        return float(t)
    except ValueError:
        return math.nan


@dataclass
class BenchOutput:
    runs: list[dict[str, float]] = field(default_factory=list)   # one per `benchmark run i/R` line, in order
    total: int | None = None                                      # the R of `i/R`
    summary: dict[str, float] = field(default_factory=dict)


def parse_output(text: str) -> BenchOutput:
    out = BenchOutput()
    for line in text.splitlines():
        if m := _RUN.search(line):
            out.total = int(m.group(2))
            out.runs.append({"run": int(m.group(1)), **{k: number(v) for k, v in _PAIR.findall(m.group(3))}})
        elif m := _SUMMARY.search(line):
            out.summary = {k: number(v) for k, v in _PAIR.findall(m.group(1))}
    return out


def run_ns(run: dict[str, float], metric: str, n_tokens: int) -> int:
    """Duration of one run's `metric` (prefill|decode) in ns. It prints ms with no decimals and tok/s
    with one, so take whichever carries the smaller rounding error (0.5 ms vs 0.05 tok/s)."""
    ms, tps = run.get(f"{metric}Ms", math.nan), run.get(f"{metric}Tps", math.nan)
    ok = lambda x: math.isfinite(x) and x > 0
    if ok(tps) and (not ok(ms) or 0.05 / tps < 0.5 / ms):
        return round(n_tokens / tps * 1e9)
    if ok(ms):
        return round(ms * 1e6)
    raise ExternalError(f"TensorSharp run {run.get('run')} has no {metric} time ({metric}Ms={ms}, {metric}Tps={tps})")


def plan(workload) -> tuple[int, int, str, int]:
    """(bench_prefill, bench_decode, timed metric, timed tokens) for a workload."""
    if workload.n_prompt and workload.n_depth:
        raise ExternalError(f"tensorsharp cannot time {workload.name}: its benchmark prefills from an empty cache; "
                            f"use ppN, or tgN@dD for decode at depth")
    if workload.n_prompt:
        return workload.n_prompt, 0, "prefill", workload.n_prompt
    return max(workload.n_depth, 1), workload.n_gen, "decode", workload.n_gen


def max_context(prefill: int, decode: int) -> int:
    """What the run needs, rounded up to 256 (ggml-cuda flash attention aborts on other KV sizes)."""
    return -(-(prefill + decode) // 256) * 256


def backend(device: str) -> str:
    if device == "cpu":
        return "ggml_cpu"
    if device.startswith("cuda"):
        return "ggml_cuda"
    from engines.devices import gpus
    return "ggml_cuda" if gpus() else "ggml_cpu"


class TensorSharpEngine(ExternalEngine):
    name = "tensorsharp"
    binary_name = "TensorSharp.Cli"
    extra_key = "tensorsharp"
    env_var = "MOEBENCH_TENSORSHARP"
    how_to_get = ("it needs .NET and a native build: build TensorSharp.Cli from "
                  "https://github.com/zhongkaifu/TensorSharp, "
                  "then pass `--tensorsharp PATH`, set MOEBENCH_TENSORSHARP=PATH, or put TensorSharp.Cli on PATH.")

    def load(self, model: Path, s: EngineSettings) -> None:
        # TensorSharp loads the model inside every --benchmark run; here we only check the binary
        self.s, self.model, self.meta = s, model, read_meta(model)
        self.binary = self.locate(s)
        self.backend = backend(s.device)

    def argv(self, prefill: int, decode: int, runs: int) -> list[str]:
        return [str(self.binary), "--model", str(self.model), "--backend", self.backend,
                "--n-cpu-moe", str(self.s.n_cpu_moe), "--benchmark", "--bench-prefill", str(prefill),
                "--bench-decode", str(decode), "--bench-runs", str(runs), "--bench-fixed-tokens"]

    def measure(self, workload, repetitions: int, warmup: int, seed: int) -> list[int]:
        prefill, decode, metric, n_tokens = plan(workload)
        runs = warmup + repetitions
        ctx = max_context(prefill, decode)
        print(f"MAX_CONTEXT={ctx}", flush=True)       # into the cell's log, next to the command line
        env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")} | {"MAX_CONTEXT": str(ctx)}
        done = self.run(self.argv(prefill, decode, runs), env=env)
        out = parse_output(done.output)
        if len(out.runs) != runs or out.total not in (None, runs):
            raise ExternalError(f"TensorSharp printed {len(out.runs)} 'benchmark run' lines, expected {runs}; "
                                f"output tail: {tail(done.output) or '(none)'}")
        if not out.summary:
            raise ExternalError(f"TensorSharp printed no 'benchmark summary' line (did it stop early?); "
                                f"output tail: {tail(done.output) or '(none)'}")
        return [run_ns(r, metric, n_tokens) for r in out.runs[warmup:]]

    def info(self) -> EngineInfo:
        # no compute_dtype or weights (engines.base): TensorSharp prints neither, and how its backends multiply and
        # hold a file's weights is not readable from outside; missing, the report names them as not reported
        s = self.s
        return EngineInfo(
            engine=self.name, version=self.version(),
            settings={"backend": self.backend, "n_cpu_moe": s.n_cpu_moe, "bench_fixed_tokens": True,
                      "max_context": "P + D of each workload rounded up to 256 (MAX_CONTEXT)",
                      "threads": "not settable (TensorSharp caps host threads at min(cpus/2, 64))",
                      "n_ubatch": "not settable (TensorSharp prefills in its own chunks)",
                      "load": "inside every TensorSharp.Cli run", "binary": str(self.binary)},
            bytes_by_device={},
            expert_bytes_host=self.meta.expert_bytes(s.n_cpu_moe), expert_bytes_total=self.meta.expert_bytes(),
            extra={"note": "TensorSharp.Cli prints no version; settings are as asked, not read back"})
