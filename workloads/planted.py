"""Planted routing for synthesized models: expert popularity skewed per layer (Zipf) and tied to token identity.

A random-weight model routes every token to an almost uniformly random expert set, so a routing trace of it has
no statistics worth predicting. A planted model routes by construction:

- token ids fall into C clusters (`cluster = token_id % C`), each cluster has a direction u_c in the embedding
  (orthonormal, so C <= n_embd); a token's embedding row is sqrt(D) * (0.8 u_c + 0.6 n_t), n_t a random unit
  vector orthogonal to every u (so the routers, whose rows lie in span(u), see the cluster and nothing else);
- each MoE layer l maps cluster c to a top-k expert set S[l, c] (ranked), drawn without replacement with
  probabilities p_e ~ rank_l(e)^-s (rank_l: a per-layer random permutation of the experts; s = the Zipf exponent);
- the router row of expert e is g * sum_c w_j(c, e) u_c, w_j = 1 - 0.04 j for slot j of S[l, c], g chosen for
  member logits ~6 and others ~0: the set is planted, the ranking inside it only leans the planted way (0.04 of
  the logit per slot is within the noise the other layers add);
- the tensors that write into the residual stream (attention/expert/shared-expert output projections, gemma4's
  post-norms) are damped (DAMP) so that the cluster direction still dominates the router input after the last
  layer (gpt-oss's large SwiGLU outputs needed 0.02; 0.1 let its layers 2-3 drift off the planted sets).

Deterministic in (seed, zipf, clusters); the GGUF records them as `moebench.routing.*`, and `planted_sets(meta)`
rebuilds the table S from those keys (the table itself would be too long an array for a metadata reader).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engines.errors import UserError

KEY = "moebench.routing."
ALPHA, BETA = 0.8, 0.6        # embedding = sqrt(D) * (ALPHA u_cluster + BETA noise); ALPHA^2 + BETA^2 = 1
LOGIT = 6.0                   # planted router logit of slot 0 at the embedding (others ~0)
SLOT_STEP = 0.04              # logit fraction lost per slot: w_j = 1 - SLOT_STEP * j
DAMP = 0.02                   # residual writers' output relative to the embedding's RMS
_RESIDUAL_WRITERS = ("attn_output.weight", "attn_output.bias", "ffn_down_exps.weight", "ffn_down_exps.bias",
                     "ffn_down_shexp.weight", "ffn_down.weight", "ssm_out.weight")
_POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")      # sandwich norms (gemma4): they scale


@dataclass(frozen=True)
class Planting:
    """What to plant: the Zipf exponent s of expert popularity and the number of token clusters (0: the default,
    min(4 n_expert, n_embd, n_vocab))."""
    zipf: float
    clusters: int = 0

    def resolved(self, n_expert: int, n_embd: int, n_vocab: int) -> "Planting":
        c = self.clusters or min(4 * n_expert, n_embd, n_vocab)
        if not 0 <= self.zipf <= 10 or not math.isfinite(self.zipf):
            raise UserError(f"zipf={self.zipf} is not valid; use an exponent between 0 (uniform) and 10.")
        if not 1 <= c <= min(n_embd, n_vocab):
            raise UserError(f"clusters={c} is not valid for this model; use 1..{min(n_embd, n_vocab)} "
                            f"(at most n_embd and n_vocab).")
        return Planting(float(self.zipf), int(c))

    @property
    def tag(self) -> str:
        """For file names: `zipf1.2-c64`."""
        return f"zipf{self.zipf:g}" + (f"-c{self.clusters}" if self.clusters else "")


def parse_options(opts: list[str]) -> Planting | None:
    """`-m preset:NAME[:DTYPE]@zipf=S[@clusters=C]` options (the `k=v@k=v` of engine specs) -> a Planting."""
    kv = {}
    for o in opts:
        k, _, v = o.partition("=")
        if k not in ("zipf", "clusters") or not v:
            raise UserError(f"Unknown model option {o!r}; use preset:NAME[:DTYPE]@zipf=S[@clusters=C].")
        try:
            kv[k] = float(v) if k == "zipf" else int(v)
        except ValueError:
            raise UserError(f"Model option {o!r} needs a number (e.g. zipf=1.2, clusters=64).") from None
    if not kv:
        return None
    if "zipf" not in kv:
        raise UserError("clusters=C plants routing only together with zipf=S; add @zipf=S (0 = uniform).")
    return Planting(kv["zipf"], kv.get("clusters", 0))


def directions(p: Planting, n_embd: int, seed: int) -> np.ndarray:
    """(C, D) orthonormal cluster directions."""
    g = np.random.default_rng([seed, 0x70, 1]).standard_normal((n_embd, p.clusters))
    q, _ = np.linalg.qr(g)                            # (D, C), orthonormal columns
    return q.T.astype(np.float32)


def expert_sets(p: Planting, layers: list[int], n_expert: int, k: int, seed: int) -> dict[int, np.ndarray]:
    """Per MoE layer index: (C, k) ranked expert ids per cluster."""
    out = {}
    for il in layers:
        rng = np.random.default_rng([seed, 0x70, 2, il])
        rank = rng.permutation(n_expert) + 1                    # rank_l(e), 1 = most popular
        prob = rank.astype(np.float64) ** -p.zipf
        prob /= prob.sum()
        out[il] = np.stack([rng.choice(n_expert, size=k, replace=False, p=prob) for _ in range(p.clusters)])
    return out


def planted_frequency(sets: np.ndarray, n_expert: int, cluster_weights: np.ndarray | None = None) -> np.ndarray:
    """(E,) share of top-k selections each expert gets when clusters occur with cluster_weights (default uniform)."""
    C, k = sets.shape
    w = np.full(C, 1.0 / C) if cluster_weights is None else cluster_weights / cluster_weights.sum()
    f = np.zeros(n_expert)
    np.add.at(f, sets.ravel(), np.repeat(w, k))
    return f / k


def zipf_rank(p: Planting, il: int, n_expert: int, seed: int) -> np.ndarray:
    """(E,) the planted popularity rank of each expert in layer il (1 = most popular), as expert_sets drew it."""
    return np.random.default_rng([seed, 0x70, 2, il]).permutation(n_expert) + 1


class Planter:
    """Rewrites a synthesized model's tensor values as they are written: embedding, routers, residual writers."""

    def __init__(self, p: Planting, h, router_layers: list[int], seed: int):
        self.p, self.h, self.seed = p, h, seed
        self.u = directions(p, h.n_embd, seed)                                      # (C, D)
        self.sets = expert_sets(p, router_layers, h.n_expert, h.n_expert_used, seed)
        self.sandwich = h.has("sandwich_norms")

    def write_metadata(self, w) -> None:
        w.add_float32(KEY + "zipf", self.p.zipf)
        w.add_uint32(KEY + "clusters", self.p.clusters)
        w.add_uint32(KEY + "seed", self.seed)
        w.add_string(KEY + "cluster_rule", "token_id % clusters")
        w.add_array(KEY + "layers", sorted(self.sets))

    def values(self, name: str, a: np.ndarray) -> np.ndarray:
        """The value to write for tensor `name` whose generic draw is a (an expert stack arrives one expert at a
        time)."""
        D = self.h.n_embd
        if name == "token_embd.weight":                                            # (V, D)
            a = a - (a @ self.u.T) @ self.u            # noise orthogonal to every cluster direction: the routers
            n = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-6)     # (rows in span(u)) ignore it
            c = np.arange(a.shape[0]) % self.p.clusters
            return (math.sqrt(D) * (ALPHA * self.u[c] + BETA * n)).astype(np.float32)
        if name.endswith(".ffn_gate_inp.weight") and a.shape == (self.h.n_expert, D):
            sets = self.sets[int(name.split(".")[1])]                              # (C, k)
            m = np.zeros((self.h.n_expert, self.p.clusters), np.float32)           # (E, C) slot weights
            slot_w = 1.0 - SLOT_STEP * np.arange(sets.shape[1])
            m[sets, np.arange(self.p.clusters)[:, None]] = slot_w[None, :]
            g = LOGIT / (ALPHA * math.sqrt(D))                                     # |rmsnorm(x)| ~ sqrt(D)
            return (g * m @ self.u).astype(np.float32)                             # (E, D)
        if self.sandwich and name.endswith(_POST_NORMS):       # a norm's weight sets its branch's RMS
            return (a * (DAMP * math.sqrt(D) / math.sqrt(float(np.mean(a * a))))).astype(np.float32)
        if not self.sandwich and name.endswith(_RESIDUAL_WRITERS):
            return a * np.float32(DAMP)
        return a


def read_planting(meta) -> tuple[Planting, int, list[int]] | None:
    """(planting, seed, router layers) a synthesized file records, None for a file without planted routing."""
    z = meta.fields.get(KEY + "zipf")
    if z is None:
        return None
    layers = meta.fields.get(KEY + "layers")
    if not isinstance(layers, list):
        raise UserError(f"{meta.path.name}: {KEY}layers is missing or too long; re-synthesize the file.")
    p = Planting(round(float(z), 6), int(meta.fields[KEY + "clusters"]))         # stored as f32
    return p, int(meta.fields[KEY + "seed"]), layers


def planted_sets(meta) -> dict[int, np.ndarray] | None:
    """Per router layer index: (C, k) ranked expert ids the file's routing was planted with; None if none."""
    r = read_planting(meta)
    if r is None:
        return None
    p, seed, layers = r
    return expert_sets(p, layers, meta.n_expert, meta.n_expert_used, seed)
