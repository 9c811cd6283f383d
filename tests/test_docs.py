"""The documentation (README.md, docs/, mkdocs.yml): every page is in the site's nav, the site builds with
`mkdocs build --strict` and its CLI reference covers every command, the README's links land on pages, nothing points
outside the repository, and the commands the pages mark as runnable run as written.

A page marks a runnable block with an HTML comment on the line before its fence: `<!-- docs-test -->` (a few seconds
on any CPU: the default suite) or `<!-- docs-test: slow -->` (sweeps of a minute or more: `-m slow`, run by .ci/run).
The marked blocks of one page run in order as one bash script (`set -e`) in a fresh directory, with this
environment's `moebench` first on PATH and `.venv` pointing at this environment, so that the README's
`.venv/bin/moebench ...` runs as written too.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
MARKED = re.compile(r"^<!-- docs-test(: slow)? -->\n```(?:bash|sh)\n(.*?)^```$", re.M | re.S)
LINKED = ["examples", "benchmarks"]          # repository folders the pages' commands name, linked into the directory


def blocks(page: Path) -> list[tuple[bool, str]]:
    """(slow, script) of each marked block of a page, in order."""
    return [(bool(m.group(1)), m.group(2)) for m in MARKED.finditer(page.read_text())]


def nav_files(nav) -> list[str]:
    """The Markdown files a mkdocs.yml nav names, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [f for v in nav.values() for f in nav_files(v)]
    return [f for item in nav for f in nav_files(item)]


def runnable() -> list:
    """One case per page with marked blocks: its fast blocks; and one more, slow, with all of them when it has slow
    ones (a slow block may use what a fast one made)."""
    cases = []
    for page in PAGES:
        bs = blocks(page)
        name = str(page.relative_to(ROOT))
        if any(not slow for slow, _ in bs):
            cases.append(pytest.param(page, False, id=name))
        if any(slow for slow, _ in bs):
            cases.append(pytest.param(page, True, id=f"{name} (slow)", marks=pytest.mark.slow))
    return cases


def test_pages_mark_commands_to_run():
    """The marks the runner looks for are there (a renamed marker would silently run nothing)."""
    marked = {p.relative_to(ROOT).as_posix(): blocks(p) for p in PAGES}
    assert marked["README.md"] and marked["docs/getting-started.md"] and marked["docs/depth.md"]
    assert all("moebench" in script for bs in marked.values() for _, script in bs)


@pytest.mark.parametrize("page, slow", runnable())
def test_marked_commands_run(page: Path, slow: bool, tmp_path):
    script = "\n".join(s for is_slow, s in blocks(page) if slow or not is_slow)
    (tmp_path / ".venv").symlink_to(sys.prefix)
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if k not in ("FAULT", "MOEBENCH_ENGINES")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (script, r.stdout[-3000:], r.stderr[-4000:])
    assert "Traceback" not in r.stderr, r.stderr[-4000:]


def test_every_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml", reason="PyYAML reads mkdocs.yml (the dev extra brings it with ray)")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_files(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, "every docs page once in mkdocs.yml's nav, and nothing else"
    assert len(set(listed)) == len(listed)


def test_readme_links_land_on_pages():
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links, "the README links into the docs"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


def test_nothing_points_outside_the_repository():
    """No page, comment or docstring cites a file beside the repository (a clone has none of it)."""
    outside = re.compile(r"\.\./shared|DESIGN\.md|/work/(?:main|shared|notes)")
    files = [p for pattern in ("*.md", "*.py", "*.sh", "*.yml", "*.toml", "Makefile", ".ci/run")
             for p in ROOT.glob(f"**/{pattern}" if "/" not in pattern else pattern)
             if not {".venv", "site", "results", "reports", ".git", "build"} & set(p.relative_to(ROOT).parts)
             and p != Path(__file__).resolve()]
    assert len(files) > 50
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if outside.search(line)]
    assert not hits, hits


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocs_click")),
                    reason="the docs extra is not installed (pip install -e '.[docs]', or `make docs`); .ci/run "
                           "installs it before the tests")
def test_the_site_builds_strict_with_every_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    from harness.cli import COMMANDS

    reference = (tmp_path / "site" / "cli" / "index.html").read_text()
    for name in COMMANDS:          # the reference is generated from the commands: a new one appears by itself
        assert f'id="moebench-{name}"' in reference, name
    assert "--n-cpu-moe" in reference and "build-llama-bench" in reference
