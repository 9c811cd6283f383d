"""llama-bench workload names: ppN (prefill N into an empty cache), tgN (N single-token decodes),
optional @dD (prefill D tokens untimed first, then time the test at that depth), optional +corr (a correlated
token stream instead of llama-bench's uniform random ids: workloads.tokens)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from engines.errors import UserError

DEFAULT_WORKLOADS = "pp4096,pp8192,tg128"
_NAME = re.compile(r"(pp|tg)(\d+)(?:@d(\d+))?(\+corr)?")
STREAMS = ("random", "correlated")      # the token stream of a workload: default, or `+corr`


@dataclass(frozen=True)
class Workload:
    name: str
    n_prompt: int    # tokens prefilled in the timed region
    n_gen: int       # tokens decoded one at a time in the timed region
    n_depth: int     # tokens prefilled (untimed) before the timed region
    stream: str = "random"      # STREAMS: which token stream feeds it (workloads.tokens)

    @property
    def kind(self) -> str:
        return "pp" if self.n_prompt else "tg"

    @property
    def n_tokens(self) -> int:
        """Tokens processed in the timed region (the numerator of tok/s)."""
        return self.n_prompt + self.n_gen

    @property
    def n_ctx_needed(self) -> int:
        return self.n_depth + self.n_prompt + self.n_gen


def parse_workload(text: str) -> Workload:
    name = text.strip().lower()
    m = _NAME.fullmatch(name)
    if not m or int(m.group(2)) == 0:
        raise UserError(f"Unknown workload {text!r}; use ppN, tgN, ppN@dD or tgN@dD with N > 0, optionally +corr for "
                        f"a correlated token stream (e.g. pp512, tg128@d8192, pp512+corr).")
    n, depth = int(m.group(2)), int(m.group(3) or 0)
    return Workload(name, n if m.group(1) == "pp" else 0, n if m.group(1) == "tg" else 0, depth,
                    "correlated" if m.group(4) else "random")


def parse_workloads(text: str) -> list[Workload]:
    items = [w for w in text.split(",") if w.strip()]
    if not items:
        raise UserError("No workloads given; pass e.g. -w pp512,tg128.")
    return [parse_workload(w) for w in items]
