"""The chaos run's short form (``python -m benchmarks chaos --quick``, benchmarks/chaos.py): the loop as separate
processes on the test broker, each SIGKILLed once and restarted, the checkpoint disk filled and freed, a reward that
raises and one that hangs. What must hold whatever the timing: nothing trained twice, nothing admitted lost, the
run reaches its max_steps, the audit passes, no process left alive and no file left that the last commit does not
need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def test_the_loop_under_chaos_loses_nothing_and_doubles_nothing(kafka_bootstrap):
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    out = subprocess.run([sys.executable, "-m", "benchmarks", "chaos", "--quick", "--max-steps", "5", "--kill-every",
                          "3", "6", "--reward-hang-rate", "0.1", "--rollout-timeout", "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[chaos] {json.dumps(figures)}")
    assert not figures.get("timed_out"), out.stderr[-3000:]
    assert len(figures["kills"]) >= 4 and not figures["unplanned_exits"], figures
    assert figures["revisions_reached"] == figures["max_steps"]
    assert figures["records_trained_twice"] == 0 and figures["batches_trained_twice"] == 0
    assert figures["rollouts_doubled"] == 0
    assert figures["admitted_not_trained_not_dead_lettered"] == 0, figures["lost_examples"]
    assert figures["records_trained_once"] > 0 and figures["audit_violations"] == []
    assert figures["processes_left_alive"] == []
    assert figures["checkpoint_folder"]["beyond_needed"] == [], figures["checkpoint_folder"]
