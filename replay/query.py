"""SQL over a replayed run: one query, an interactive prompt, exports (table, csv, json, parquet)."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import duckdb

from replay import tables as T

FORMATS = ("table", "csv", "json", "parquet")
LIST_PREVIEW = 6


def cell(value: Any, *, full: bool = False) -> str:
    """One value as text: lists and maps shortened (unless full), floats to 6 significant digits."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(value) if full or math.isnan(value) or math.isinf(value) else f"{value:.6g}"
    if isinstance(value, bytes):
        return value.hex() if full else f"<{len(value)} bytes>"
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return json.dumps({str(k): _jsonable(v) for k, v in value.items()}) if full else \
            "{" + ", ".join(f"{k}: {cell(v)}" for k, v in list(value.items())[:LIST_PREVIEW]) + \
            (", …" if len(value) > LIST_PREVIEW else "") + "}"
    if isinstance(value, (list, tuple)):
        if full:
            return json.dumps(_jsonable(value))
        head = ", ".join(cell(v) for v in value[:LIST_PREVIEW])
        more = f", … {len(value) - LIST_PREVIEW} more" if len(value) > LIST_PREVIEW else ""
        return f"[{head}{more}]"
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if hasattr(value, "as_tuple"):  # Decimal (sum() of integers is HUGEINT/DECIMAL in DuckDB)
        return int(value) if value == int(value) else float(value)
    return value


def fetch(rel: duckdb.DuckDBPyRelation, limit: int | None = None) -> tuple[list[str], list[str], list[tuple]]:
    """(columns, types, rows) through Arrow (no pytz needed for TIMESTAMPTZ; MAPs come back as dicts)."""
    import pyarrow as pa

    types = [str(t) for t in rel.types]
    table = (rel.limit(limit) if limit is not None else rel).to_arrow_table()
    cols = []
    for col in table.columns:
        values = col.to_pylist()
        if pa.types.is_map(col.type):
            values = [dict(v) if v is not None else None for v in values]
        cols.append(values)
    return list(table.column_names), types, list(zip(*cols)) if cols else []


def run_query(con: duckdb.DuckDBPyConnection, sql: str, *, fmt: str = "table", out: str | None = None,
              max_rows: int = 200, stream: TextIO | None = None) -> int:
    """Run ``sql`` and print (or write to ``out``) its result; returns the number of rows."""
    stream = stream or sys.stdout
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if out and fmt in ("csv", "json", "parquet"):
        duck_fmt = {"csv": "csv, HEADER", "json": "json", "parquet": "parquet"}[fmt]
        con.execute(f"COPY ({sql.strip().rstrip(';')}) TO '{_quote(out)}' (FORMAT {duck_fmt})")
        n = con.execute(f"SELECT count(*) FROM '{_quote(out)}'").fetchone()[0] if fmt == "parquet" else -1
        print(f"wrote {out}" + (f" ({n} rows)" if n >= 0 else ""), file=sys.stderr)
        return max(n, 0)
    if fmt == "parquet":
        raise ValueError("--format parquet needs --out FILE")
    rel = con.sql(sql)
    if rel is None:  # a statement without a result (CREATE VIEW ...)
        print("ok", file=stream)
        return 0
    columns, types, rows = fetch(rel)
    write_rows(columns, rows, types=types, fmt=fmt, max_rows=max_rows, stream=stream)
    return len(rows)


def write_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, types: Sequence[str] | None = None,
               fmt: str = "table", max_rows: int = 200, stream: TextIO | None = None) -> None:
    """Rows to ``stream`` in a text format: a table (up to ``max_rows``), CSV, or JSON lines."""
    stream = stream or sys.stdout
    if fmt == "csv":
        w = csv.writer(stream)
        w.writerow(columns)
        for r in rows:
            w.writerow([cell(v, full=True) if v is not None else "" for v in r])
    elif fmt == "json":
        for r in rows:
            stream.write(json.dumps({c: _jsonable(v) for c, v in zip(columns, r)}) + "\n")
    else:
        print_table(columns, rows, types=types, max_rows=max_rows, stream=stream)


def _quote(path: str) -> str:
    return path.replace("'", "''")


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, types: Sequence[str] | None = None,
                max_rows: int = 200, stream: TextIO | None = None, title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream or sys.stdout, width=None if (stream or sys.stdout).isatty() else 200)
    table = Table(title=title, show_lines=False, header_style="bold")
    for i, c in enumerate(columns):
        numeric = bool(types) and any(k in types[i] for k in ("INT", "DOUBLE", "FLOAT", "DECIMAL", "HUGEINT"))
        table.add_column(c + (f"\n[dim]{types[i].lower()}[/dim]" if types else ""), justify="right" if numeric else "left",
                         overflow="fold")
    for r in rows[:max_rows]:
        table.add_row(*(cell(v) for v in r))
    console.print(table)
    if len(rows) > max_rows:
        console.print(f"[dim]{len(rows)} rows, {max_rows} shown (--max-rows, or --format csv|json)[/dim]")
    else:
        console.print(f"[dim]{len(rows)} row{'s' if len(rows) != 1 else ''}[/dim]")


def export(con: duckdb.DuckDBPyConnection, out_dir: str, *, fmt: str = "parquet", views: bool = True) -> list[str]:
    """Every table (and the views) of the run as one file each in ``out_dir``."""
    if fmt not in ("parquet", "csv", "json"):
        raise ValueError(f"export format {fmt!r}: parquet, csv or json")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    names = list(T.TABLES) + (list(T.VIEWS) if views else [])
    written = []
    for name in names:
        path = os.path.join(out_dir, f"{name}.{fmt}")
        opts = {"parquet": "FORMAT parquet, COMPRESSION zstd", "csv": "FORMAT csv, HEADER", "json": "FORMAT json"}[fmt]
        con.execute(f"COPY (SELECT * FROM {name}) TO '{_quote(path)}' ({opts})")
        written.append(path)
    return written


HELP = """Enter SQL ending with ';'.  Dot commands (also as `rollout sql --db F .tables`):
  .tables            tables and views with row counts     .schema NAME   columns of a table or view
  .format FMT        table | csv | json                   .maxrows N     rows shown in table format
  .help              this text                            .quit          leave (or Ctrl-D)"""
QUIT = (".quit", ".exit", ".q")


def describe(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, int | None, str]]:
    rows = []
    for name, comment in con.execute("SELECT table_name, comment FROM duckdb_tables() WHERE NOT internal "
                                     "AND table_name NOT LIKE '\\_%' ESCAPE '\\' ORDER BY table_name").fetchall():
        rows.append(("table", name, con.execute(f"SELECT count(*) FROM {name}").fetchone()[0], comment or ""))
    for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall():
        rows.append(("view", name, None, ""))
    rows.append(("macro", "batch_lineage(batch_id)", None, "SELECT * FROM batch_lineage('...'): one batch's full lineage"))
    return rows


def dot_command(con: duckdb.DuckDBPyConnection, line: str, *, fmt: str = "table", max_rows: int = 200,
                stream: TextIO | None = None) -> tuple[str, int]:
    """One dot command (all but the prompt's own .quit); returns the (format, max rows) to go on with."""
    stream = stream or sys.stdout
    cmd, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if cmd == ".help":
        print(HELP, file=stream)
    elif cmd == ".tables":
        write_rows(["kind", "name", "rows", "about"], describe(con), fmt=fmt, max_rows=max_rows, stream=stream)
    elif cmd == ".schema" and arg:
        run_query(con, f"DESCRIBE {arg}", fmt=fmt, max_rows=max_rows, stream=stream)
    elif cmd == ".format" and arg in ("table", "csv", "json"):
        fmt = arg
    elif cmd == ".maxrows" and arg.isdigit():
        max_rows = int(arg)
    else:
        raise ValueError(f"unknown command {line.strip()!r}; .help lists them")
    return fmt, max_rows


def run_command(con: duckdb.DuckDBPyConnection, text: str, *, fmt: str = "table", out: str | None = None,
                max_rows: int = 200) -> None:
    """`rollout sql --db F TEXT`: a query, or a dot command as at the prompt (.tables, .schema NAME)."""
    if not text.lstrip().startswith("."):
        run_query(con, text, fmt=fmt, out=out, max_rows=max_rows)
        return
    if out or fmt == "parquet":
        raise ValueError(f"{text.split()[0]} prints table, csv or json: leave out --out and --format parquet")
    dot_command(con, text, fmt=fmt, max_rows=max_rows)


def interactive(con: duckdb.DuckDBPyConnection, *, fmt: str = "table", max_rows: int = 200,
                lines: Iterable[str] | None = None, stream: TextIO | None = None) -> int:
    """A small SQL prompt. ``lines`` (for tests) replaces the keyboard."""
    stream = stream or sys.stdout
    tty = lines is None and sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history)
        except ImportError:
            pass
        print(HELP, file=stream)
    source = iter(lines) if lines is not None else None
    buf: list[str] = []
    while True:
        try:
            if source is not None:
                line = next(source)
            else:
                line = input("sql> " if not buf else "...> ") if tty else sys.stdin.readline()
                if not tty and line == "":
                    raise EOFError
        except (EOFError, StopIteration):
            break
        stripped = line.strip()
        if not buf and stripped.startswith("."):
            if stripped.split()[0] in QUIT:
                break
            fmt, max_rows = _try(lambda: dot_command(con, stripped, fmt=fmt, max_rows=max_rows, stream=stream),
                                 stream) or (fmt, max_rows)
            continue
        if not stripped and not buf:
            continue
        buf.append(line.rstrip("\n"))
        if stripped.endswith(";"):
            sql = "\n".join(buf)
            buf = []
            _try(lambda: run_query(con, sql, fmt=fmt, max_rows=max_rows, stream=stream), stream)
    if buf:
        _try(lambda: run_query(con, "\n".join(buf), fmt=fmt, max_rows=max_rows, stream=stream), stream)
    return 0


def _try(fn: Callable[[], Any], stream: TextIO) -> Any:
    """``fn()``, or None after printing its error (the prompt goes on)."""
    try:
        return fn()
    except (duckdb.Error, ValueError) as e:
        print(f"error: {e}", file=stream)
        return None
