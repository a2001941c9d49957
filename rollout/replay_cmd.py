"""`rollout runs | replay | audit | sql | export | report`: a run from the log, in DuckDB.

    rollout runs                                   runs on the log (every topic prefix), most recent first
    rollout replay --db run.duckdb [--run ID] [--until TIME|TOPIC:PART:OFFSET,...]
    rollout audit  --db run.duckdb [--format text|json]      exit 1 on any violation
    rollout sql    --db run.duckdb "SELECT * FROM v_reward_by_revision" [--format table|csv|json|parquet --out F]
    rollout sql    --db run.duckdb                 an interactive prompt
    rollout sql    --db run.duckdb .tables         a dot command of the prompt (.tables, .schema NAME)
    rollout export --db run.duckdb --out DIR       every table and view as Parquet
    rollout export --db run.duckdb --format traces --out traces.jsonl   the run as verifiers v1 traces
    rollout import-traces traces.jsonl [--run-id ID]   a verifiers/prime-rl traces.jsonl onto the log as a run
    rollout import-traces RUN_DIR [--run-id ID]        a prime-rl run's trace stream (monitors/file/traces) likewise
    rollout report --db run.duckdb --out report.html

Every command but replay refuses a --db that is missing or not a DuckDB file, in one line.

Runs are looked for under every topic prefix on the cluster (``rollout.``, ``demo-1a2b3c4d.``, ...);
ROLLOUT_TOPIC_PREFIX, when set, restricts both commands to that prefix.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="list the runs on the log under every topic prefix (most recent first)")
    p.add_argument("--all-topics", action="store_true",
                   help="count every topic's messages per run (reads every topic's headers)")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("replay", help="replay a run from the log into a DuckDB database (incremental)")
    p.add_argument("--db", required=True, help="DuckDB file (created if missing; a second replay appends what is new)")
    p.add_argument("--run", dest="run_id", help="run id, under any topic prefix (default: the run already in --db, "
                                                 "else the most recent run)")
    p.add_argument("--until", help="stop at a Kafka record time (ISO 8601, or @epoch_ms; inclusive) or before "
                                   "offsets topic:partition:offset[,...]")
    p.add_argument("--compress", action="store_true",
                   help="compress columns in the database (smaller file, about 2x slower to write)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", help="recompute digests and check lineage of a replayed run; exit 1 on any violation")
    p.add_argument("--db", required=True)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--limit", type=int, default=20, help="findings shown per kind in text format (default 20)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("sql", help="query a replayed run (no query: an interactive prompt)")
    p.add_argument("--db", required=True)
    p.add_argument("query", nargs="*", help="SQL, or a dot command such as .tables (tables, views and "
                                            "batch_lineage(id)) or .schema NAME; words are joined by spaces")
    p.add_argument("--format", choices=("table", "csv", "json", "parquet"), default="table")
    p.add_argument("--out", help="write the result to this file (needed for parquet)")
    p.add_argument("--max-rows", type=int, default=200, help="rows shown in table format (default 200)")
    p.add_argument("--write", action="store_true", help="open the database writable (to create your own views)")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("export", help="export every table and view of a replayed run to files (Parquet by default), "
                                      "or the run as verifiers v1 traces.jsonl (--format traces)")
    p.add_argument("--db", required=True)
    p.add_argument("--out", required=True, help="directory (--format traces: a .jsonl file, or a directory that gets "
                                                "traces.jsonl)")
    p.add_argument("--format", choices=("parquet", "csv", "json", "traces"), default="parquet")
    p.add_argument("--no-views", action="store_true")
    p.add_argument("--no-failed", action="store_true", help="--format traces: leave failed rollouts out")
    p.add_argument("--validate", choices=("auto", "yes", "no"), default="auto",
                   help="--format traces: check every line with verifiers' own Trace/Episode models "
                        "(auto: when verifiers 0.4 is installed)")
    p.add_argument("--trace-format", choices=("0.4.0", "dev"), default="0.4.0",
                   help="--format traces: the record verifiers 0.4.0 reads (default), or the one its development "
                        "builds (0.4.1.dev*) write: Trace.dropped, per-token weight_versions, agent records as "
                        "imported")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import-traces", help="write a verifiers/prime-rl traces.jsonl, or a prime-rl run's trace "
                                             "stream, onto the log as a run (then: rollout replay --run ID)")
    p.add_argument("path", help="traces.jsonl (one episode or trace per line), or a run directory holding one; or "
                                "a prime-rl trace stream: the run's output dir, its monitors/file/traces dir or that "
                                "dir's stream/ (chunks NNNNN.jsonl and sealed NNNNN.jsonl.zst in order, "
                                "stream.index.jsonl, annotations/<producer>/ folded on, the later value winning)")
    p.add_argument("--run-id", help="run id of the imported run (default: a new one)")
    p.add_argument("--family", help="model family for steps whose trace names no revision (default: the agent's model)")
    p.add_argument("--dry-run", action="store_true", help="map and count, produce nothing")
    p.set_defaults(func=cmd_import_traces)

    p = sub.add_parser("report", help="charts of a replayed run (reward, staleness, pass rates, eval accuracy) as HTML or PNG")
    p.add_argument("--db", required=True)
    p.add_argument("--out", default="report.html", help="report.html (interactive charts: zoom, pan, tooltips; works "
                   "offline), or report.png (the same charts as one image)")
    p.add_argument("--no-audit", action="store_true", help="leave the audit verdict out")
    p.set_defaults(func=cmd_report)


def _fail(command: str, error: object, code: int) -> int:
    """Say what went wrong in one line on stderr (DuckDB's messages span several); returns the exit code."""
    print(f"rollout {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return code


def _settings():
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    if not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    return settings


def cmd_runs(args: argparse.Namespace) -> int:
    import asyncio

    from replay.runs import list_runs
    from replay.query import print_table

    runs = asyncio.run(list_runs(_settings(), all_topics=args.all_topics))
    if not runs:
        print("no runs on the log")
        return 0
    rows = [(r.run_id, r.prefix, r.first.isoformat(timespec="seconds"), r.last.isoformat(timespec="seconds"),
             ", ".join(f"{t}: {n}" for t, n in sorted(r.messages.items()))) for r in runs]
    print_table(["run_id", "topic prefix", "first", "last", "messages"], rows)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from replay.ingest import ReplayError, Replayer, Until
    from replay.tables import UnusableDatabase, connect

    try:
        if os.path.exists(args.db):  # replay adds to it: refuse a file that is not a usable DuckDB database
            connect(args.db, read_only=False).close()
        until = Until.parse(args.until)
        progress = None
        if not args.quiet and sys.stderr.isatty():
            progress = lambda r: print(f"\r{r.messages} messages, {r.bytes / 1e6:.0f} MB", end="",  # noqa: E731
                                       file=sys.stderr, flush=True)
        result = asyncio.run(Replayer(args.db, _settings(), run_id=args.run_id, until=until, progress=progress,
                                          compress=args.compress or None).run())
    except (ReplayError, UnusableDatabase) as e:
        return _fail("replay", e, 2)
    if progress:
        print(file=sys.stderr)
    if not args.quiet:
        print(result.summary())
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from replay.audit import run_audit, to_rows
    from replay.query import print_table
    from replay.tables import UnusableDatabase

    try:
        report = run_audit(args.db)
    except UnusableDatabase as e:
        return _fail("audit", e, 2)
    if args.format == "json":
        print(report.to_json())
    else:
        if report.findings:
            rows = [(r["severity"], r["kind"], r["message"]) for r in to_rows(report, args.limit)]
            print_table(["severity", "kind", "finding"], rows, max_rows=len(rows))
            hidden = len(report.findings) - len(rows)
            if hidden:
                print(f"({hidden} more findings; --limit or --format json for all)")
        print(report.summary())
    return 0 if report.ok else 1


def cmd_sql(args: argparse.Namespace) -> int:
    import duckdb

    from replay.query import interactive, run_command
    from replay.tables import UnusableDatabase, connect

    try:
        con = connect(args.db, read_only=not args.write)
    except UnusableDatabase as e:
        return _fail("sql", e, 1)
    with con:
        if not args.query:
            return interactive(con, fmt=args.format if args.format != "parquet" else "table", max_rows=args.max_rows)
        try:
            run_command(con, " ".join(args.query), fmt=args.format, out=args.out, max_rows=args.max_rows)
        except (duckdb.Error, ValueError) as e:
            return _fail("sql", e, 1)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from replay.query import export
    from replay.tables import UnusableDatabase, open_read_only

    try:  # checked before anything is written, for both formats
        con = open_read_only(args.db)
    except UnusableDatabase as e:
        return _fail("export", e, 2)
    with con:
        if args.format != "traces":
            for path in export(con, args.out, fmt=args.format, views=not args.no_views):
                print(path)
            return 0
    from replay.trace_export import write_traces  # it opens the database itself

    validate = {"auto": None, "yes": True, "no": False}[args.validate]
    try:
        n = write_traces(args.db, args.out, validate=validate, include_failed=not args.no_failed,
                         fmt=getattr(args, "trace_format", "0.4.0"))
    except ImportError as e:
        return _fail("export", f"--validate yes needs verifiers of the chosen --trace-format ({e})", 2)
    print(f"wrote {n} episodes to {args.out}")
    return 0


def cmd_import_traces(args: argparse.Namespace) -> int:
    import asyncio

    from replay.trace_import import import_file, produce_imported, summary

    try:
        imp = import_file(args.path, args.run_id, family=args.family)
    except (OSError, ValueError) as e:
        return _fail("import-traces", e, 2)
    for line in imp.skipped[:20]:
        print(f"skipped {line}", file=sys.stderr)
    for note in imp.notes:
        print(f"note: {note}", file=sys.stderr)
    if not imp.episodes:
        return _fail("import-traces", "no episode could be read", 1)
    if not args.dry_run:
        asyncio.run(produce_imported(imp, _settings()))
    print(summary(imp) + ("" if args.dry_run else f"; replay it with: rollout replay --db run.duckdb --run {imp.run_id}"))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from replay.report import write_report

    try:  # a --db it cannot use (replay.tables.UnusableDatabase), or a PNG it cannot draw
        out = write_report(args.db, args.out, with_audit=not args.no_audit)
    except RuntimeError as e:
        return _fail("report", e, 1)
    print(f"wrote {out}")
    return 0
