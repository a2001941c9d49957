"""A traceback is a bug: every sub-command given wrong input (a missing or broken recipe, a database that cannot be
opened, a Kafka address nothing answers at, a bad flag) exits non-zero with a line that says what is wrong, and no
Python traceback. Real processes; the unreachable Kafka is a closed local port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    (["plan", "/nonexistent.toml"], "cannot read plan"),
    (["plan", "/etc/hostname"], "not valid TOML"),
    (["rl", "@", "/nonexistent.toml"], "cannot read plan"),
    (["demo", "--plan", "/nonexistent.toml"], "cannot read plan"),
    (["arena", "/nonexistent.toml"], "cannot read plan"),
    (["replay", "--db", "/nonexistent/dir/x.duckdb"], "Cannot open file"),
    (["audit", "--db", "/nonexistent.duckdb"], "no such DuckDB file"),
    (["sql", "--db", "/nonexistent.duckdb", "select 1"], "no such DuckDB file"),
    (["report", "--db", "/nonexistent.duckdb", "--out", "x.html"], "no such DuckDB file"),
    (["export", "--db", "/nonexistent.duckdb", "--out", "x"], "no such DuckDB file"),
    (["import-traces", "/nonexistent.jsonl"], "No such file"),
    (["derive", "nosuchrun"], "cannot reach Kafka"),
    (["status"], "cannot reach Kafka"),
    (["runs"], "cannot reach Kafka"),
    (["kafka", "bogus"], "invalid choice"),
    (["serve", "verifier", "--no-such-flag"], "unrecognized arguments"),
    (["serve", "nosuchservice"], "invalid choice"),
    (["rl", "@", "/etc/hostname"], "not valid TOML"),
    (["derive", "nosuchrun", "--since", "yesterday"], "invalid fromisoformat value"),
    (["demo", "--cores", "bogus"], "invalid choice"),
    (["demo", "--eval-interval", "0"], "must be >= 1"),
    (["model", "bogus"], "invalid choice"),
    (["arena", "/nonexistent.toml", "--groups", "-1"], "--groups: must be >= 0"),
    (["rl", "@", "/nonexistent.toml", "--max-steps", "0"], "--max-steps: must be >= 1"),
    (["derive", "nosuchrun", "--batch-records", "0"], "--batch-records: must be >= 1"),
    (["demo", "--epochs", "0"], "--epochs: must be >= 1"),
]


@pytest.mark.parametrize("argv, says", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_wrong_input_ends_in_one_line_not_a_traceback(argv, says, tmp_path):
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": "127.0.0.1:1"}  # nothing listens there
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    done = subprocess.run([sys.executable, "-m", "rollout.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in out and "Unclosed" not in out, out[-3000:]
    assert says in out, out[-3000:]
