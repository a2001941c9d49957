"""The read commands (audit, sql, report, export; and replay) on a --db they cannot use, and sql's dot commands given as the
query: one line on stderr that says what to do, and the exit code; real DuckDB files, no broker."""

from __future__ import annotations

import json

import duckdb
import pytest

from replay.ingest import load_events
from replay.synthetic import generate_run
from rollout.cli import main
from test_replay_unit import flat, placed

READ_COMMANDS = {  # argv after --db, and the exit code of a --db the command cannot use
    "audit": ([], 2),
    "sql": (["SELECT 1"], 1),
    "report": (["--out", "report.html"], 1),
    "export": (["--out", "export"], 2),
    "export traces": (["--format", "traces", "--out", "traces.jsonl"], 2),
}


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """A replayed run in a DuckDB file."""
    run = generate_run("cli-db-0001", rounds=2, groups=2, group_size=2)
    path = str(tmp_path_factory.mktemp("cli") / "run.duckdb")
    con = duckdb.connect(path)
    load_events(con, run.run_id, placed(flat(run)))
    con.close()
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of one `rollout` command."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err.splitlines()


@pytest.mark.parametrize("command", READ_COMMANDS)
def test_missing_db_is_one_line_naming_the_replay_to_run(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rest, code = READ_COMMANDS[command]
    missing = str(tmp_path / "nope.duckdb")
    rc, out, err = run_cli(capsys, command.split()[0], "--db", missing, *rest)
    assert rc == code and not out
    assert err == [f"rollout {command.split()[0]}: error: no such DuckDB file {missing}: "
                   f"run `rollout replay --db {missing}` first"]
    assert not (tmp_path / "nope.duckdb").exists()  # not created empty on the way


@pytest.mark.parametrize("command", READ_COMMANDS)
def test_a_file_that_is_not_duckdb_is_one_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rest, code = READ_COMMANDS[command]
    text = tmp_path / "notes.duckdb"
    text.write_text("not a database\n")
    rc, out, err = run_cli(capsys, command.split()[0], "--db", str(text), *rest)
    assert rc == code and not out
    assert len(err) == 1 and f"{text} is not a DuckDB file" in err[0] and "rollout replay --db" in err[0], err


def test_replay_into_a_file_that_is_not_duckdb_is_one_line_before_any_kafka(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    rc, out, err = run_cli(capsys, "replay", "--db", str(text))
    assert rc == 2 and not out
    assert len(err) == 1 and f"{text} is not a DuckDB file" in err[0], err
    assert text.read_text() == "my notes\n"  # untouched


def test_sql_write_does_not_create_a_missing_db(tmp_path, capsys):
    missing = tmp_path / "nope.duckdb"
    rc, _, err = run_cli(capsys, "sql", "--write", "--db", str(missing), "CREATE VIEW v AS SELECT 1")
    assert rc == 1 and len(err) == 1 and "no such DuckDB file" in err[0]
    assert not missing.exists()


def test_dot_commands_as_the_query(db, capsys):
    rc, out, err = run_cli(capsys, "sql", "--db", db, ".tables")
    assert rc == 0 and not err
    assert "v_reward_by_revision" in out and "training_records" in out and "batch_lineage" in out

    rc, out, err = run_cli(capsys, "sql", "--db", db, ".tables", "--format", "json")
    rows = {r["name"]: r for r in map(json.loads, out.splitlines())}
    assert rc == 0 and rows["steps"]["kind"] == "table" and rows["steps"]["rows"] > 0
    assert rows["v_reward_by_revision"]["kind"] == "view"

    rc, out, err = run_cli(capsys, "sql", "--db", db, ".schema", "steps", "--format", "csv")  # words joined
    assert rc == 0 and out.splitlines()[0].startswith("column_name,") and "\nstep_id," in out


@pytest.mark.parametrize("argv, message", [
    ([".nope"], "unknown command '.nope'; .help lists them"),
    ([".tables", "--format", "parquet", "--out", "t.parquet"], ".tables prints table, csv or json"),
    ([".schema", "no_such_table"], "no_such_table"),
])
def test_a_dot_command_that_fails_is_one_line(db, argv, message, capsys):
    rc, out, err = run_cli(capsys, "sql", "--db", db, *argv)
    assert rc == 1 and not out
    assert len(err) == 1 and err[0].startswith("rollout sql: error: ") and message in err[0], err
