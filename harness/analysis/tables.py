"""Render tables for people (rich) and machines (md, csv, json, jsonl, sql). One place for every command's output,
llama-bench's formats included (json, jsonl, sql: what `llama-bench -o FORMAT` prints, for the sweep's records)."""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from engines.errors import UserError
from engines.gguf_meta import clean_text

FORMATS = ("table", "md", "csv", "json", "jsonl", "sql")
CELL_LIMIT = 4096       # characters of one rendered cell: a table is for reading (the result files keep it all)


def _cell(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:,.2f}"
    return "" if v is None else clean_text(v, CELL_LIMIT, lines=True)


def _clean(v):
    """A cell of any format without control characters (model names and error text come from model files and
    engine logs: untrusted); numbers and None untouched."""
    return clean_text(v, CELL_LIMIT, lines=True) if isinstance(v, str) else v


MD_SPECIAL = re.compile(r"([\\`*_\[\]<>~&|])")      # emphasis, code, links, raw HTML, entities, tables


def md_escape(text) -> str:
    """Backslash-escape Markdown/HTML punctuation (CommonMark allows it before any ASCII punctuation):
    model names and other strings come from GGUF metadata, which is untrusted (control characters go too)."""
    return MD_SPECIAL.sub(r"\\\1", clean_text(text, None))


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "_no rows_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(md_escape(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(md_escape(_cell(r.get(c))) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _sql_value(v) -> str:
    """One value of an SQL statement: text quoted with its quotes doubled and without control characters (paths and
    model names come from the user and from GGUF files: untrusted), numbers as they are, nothing as NULL."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "NULL"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + clean_text(v, None).replace("'", "''") + "'"


def llama_bench_sql(records) -> str:
    """llama-bench's `-o sql`, to pipe into sqlite3: CREATE TABLE IF NOT EXISTS llama_bench (its fields), then one
    INSERT per record. Only llama-bench records have that table (the sweep's)."""
    from harness.store.results import LLAMA_BENCH_FIELDS

    if not isinstance(records, list) or any(LLAMA_BENCH_FIELDS.keys() - r.keys() for r in records):
        raise UserError("--format sql writes llama-bench's table, which only `moebench sweep` has; "
                        "use jsonl, json or csv here.")
    types = {str: "TEXT", bool: "INTEGER", int: "INTEGER", float: "REAL"}
    columns = ",\n".join(f"  {f} {types[kind]}" for f, kind in LLAMA_BENCH_FIELDS.items())
    insert = f"INSERT INTO llama_bench ({', '.join(LLAMA_BENCH_FIELDS)}) VALUES"
    inserts = "".join(f"{insert} ({', '.join(_sql_value(r[f]) for f in LLAMA_BENCH_FIELDS)});\n" for r in records)
    return f"CREATE TABLE IF NOT EXISTS llama_bench (\n{columns}\n);\n\n{inserts}"


def render(rows: list[dict], fmt: str = "table", title: str = "", out: str | Path | None = None,
           json_payload=None) -> None:
    """Print rows in fmt to stdout, or write them to `out`. json_payload replaces rows for json and jsonl (a list: one
    item a line) and is what sql writes (llama-bench's records only).
    Every cell and the title lose their control characters, whatever the format (defence in depth: the
    strings of model files are cleaned where they are read, older result files may not be)."""
    rows = [{k: _clean(v) for k, v in r.items()} for r in rows]
    title = clean_text(title, None)
    if fmt == "json":
        text = json.dumps(rows if json_payload is None else json_payload, indent=2, default=str) + "\n"
    elif fmt == "jsonl":
        payload = rows if json_payload is None else json_payload
        text = "".join(json.dumps(r, default=str) + "\n" for r in (payload if isinstance(payload, list) else [payload]))
    elif fmt == "sql":
        text = llama_bench_sql(json_payload)
    elif fmt == "csv":
        import pandas as pd
        text = pd.DataFrame(rows).to_csv(index=False)
    elif fmt == "md":
        text = (f"### {md_escape(title)}\n\n" if title else "") + markdown(rows)
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
        t = Table(title=title or None)
        for c in (rows[0] if rows else {}):
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*(escape(_cell(v)) for v in r.values()))    # GGUF strings are not rich markup
        if out is None:
            console = Console()
            wide = console.is_terminal or "COLUMNS" in os.environ    # else a pipe/log: 200 columns, no wrapping
            (console if wide else Console(width=200)).print(t)
            return
        with open(out, "w") as f:
            Console(file=f, width=200).print(t)
        return
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
