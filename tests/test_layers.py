"""The package's layers (docs/design.md, "Layers"): every project import, read with `ast` (nothing is
imported), points downward, and no project modules import each other in a cycle.

Lazy imports inside functions count: they are still a dependency, only a later one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "engines", "workloads")
# engine modules that import nothing of the project but each other (and torch-free reference data)
ENGINE_LEAVES = {"engines", "engines.errors", "engines.paths", "engines.devices", "engines.base", "engines.gguf_meta",
                 "engines.ggml_build", "engines.registry", "engines.reference", "engines.reference.placement",
                 "engines.cache_policies", "engines.routing"}


def leaf(module: str) -> bool:
    """Engine leaves, and the torch-free architecture table (engines.reference.archs and its modules)."""
    return module in ENGINE_LEAVES or module.startswith("engines.reference.archs")
# harness layers, top to bottom: a module may import its own layer (without cycles) and the ones below
HARNESS_RANK = {"harness.__main__": 6, "harness.cli": 5, "harness.run": 4, "harness.analysis": 3, "harness.planning": 2,
                "harness.store": 1, "harness.hw": 1, "harness.tools": 1, "harness.units": 0,
                "harness.stats": 0}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: Path, name: str) -> set[str]:
    """Every module (absolute name) the file imports, at any depth of the file, relative imports resolved."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}     # `from harness import results` imports a module
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports(p, m) if i in mods and i != m} for m, p in mods.items()}


def layer(module: str) -> str:
    return next((k for k in sorted(HARNESS_RANK, key=len, reverse=True) if module == k or module.startswith(k + ".")),
                module)


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in g.items():
        for d in sorted(deps):
            why = ""
            if m.startswith("engines") and not d.startswith("engines"):
                why = "engines never import harness or workloads"
            elif leaf(m) and not leaf(d):
                why = "engine leaf modules import only each other"
            elif m.startswith("workloads") and d.startswith("engines") and not leaf(d):
                why = "workloads import only engine leaf modules"
            elif m.startswith("workloads") and d.startswith("harness"):
                why = "workloads never import harness"
            elif m.startswith("harness.") and d.startswith("harness."):
                lm, ld = layer(m), layer(d)
                if HARNESS_RANK.get(ld, 0) > HARNESS_RANK.get(lm, 0) or (lm != ld and HARNESS_RANK.get(ld) ==
                                                                         HARNESS_RANK.get(lm)):
                    why = f"{lm} may not import {ld} (layers import downward only)"
            if why:
                bad.append(f"{m} imports {d}: {why}")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def click_users(mods: dict[str, Path]) -> list[str]:
    return sorted(m for m, p in mods.items() if "click" in imports(p, m) and layer(m) != "harness.cli")


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_imports_point_downward():
    assert violations(graph()) == []


def test_only_the_cli_imports_click():
    assert click_users(modules()) == []


@pytest.mark.parametrize("module, forbidden", [
    ("engines.reference.engine", "harness.run.runner"),           # an engine importing the harness
    ("harness.store.results", "harness.analysis.report"),         # a lower layer importing a higher one
    ("workloads.synth", "engines.reference.engine"),              # workloads importing a heavy engine module
    ("harness.planning.plan", "harness.run.spec"),                # planning importing run
])
def test_a_forbidden_import_is_caught(module, forbidden):
    """The checks can fail: each rule reports one added forbidden import, and a back edge makes a cycle."""
    g = graph()
    assert module in g and forbidden in g, "the example modules exist"
    g[module] = g[module] | {forbidden}
    assert any(v.startswith(f"{module} imports {forbidden}:") for v in violations(g))
    g[forbidden] = g[forbidden] | {module}
    assert any(module in c and forbidden in c for c in cycles(g))
