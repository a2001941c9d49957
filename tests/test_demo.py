"""The README's main job, `rollout demo`, end to end on the test broker: it must close the loop and learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def test_demo_closes_the_loop_and_reward_rises(kafka_bootstrap):
    groups = 192
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "demo", "--groups", str(groups)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout[-2500:])
    s = json.loads(out.stdout.strip().splitlines()[-1])
    rollouts = groups * 8
    assert s["rollouts"] == s["scored"] == rollouts
    # every rollout's one trainable step is in exactly one batch, or was refused as stale (with its reason)
    stale = s["dead_letter_reasons"].get("batcher: StaleRecordError", 0)
    assert s["records_in_batches"] + stale == rollouts and s["dead_letters"] == stale
    assert stale <= rollouts // 20, s["dead_letter_reasons"]
    assert s["revisions"] >= 10
    rewards = [s["mean_reward_by_revision"][k] for k in sorted(s["mean_reward_by_revision"], key=int)]
    # learning, not noise: the last three revisions' rollouts score clearly above revision 0's
    assert sum(rewards[-3:]) / 3 > max(2 * rewards[0], rewards[0] + 0.1), rewards
