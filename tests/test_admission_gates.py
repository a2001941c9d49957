"""prime-rl's admission gates through the whole loop on the test broker: a recipe with ``curriculum.gates.
zero_advantage`` on a task the tiny model almost never solves (exact-match reward), so most groups are rewarded
alike. Every such group is kept out of training and refunded on the admissions ledger, the arena samples again to
fill the batch, and the run still ends at exactly ``max_steps`` full batches (before the arena waited for slots
given back, it stopped admitting once the first claims covered the batches, and the run stalled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

RECIPE = """max_steps = 2
[model]
name = "tiny-byte-lm"
[orchestrator]
batch_size = 32
group_size = 8
[orchestrator.train.sampling]
temperature = 1.0
max_tokens = 16
[[orchestrator.train.source]]
name = "arithmetic"
env = { taskset = { id = "arithmetic", reward = "exact" } }
curriculum = { gates = { zero_advantage = { type = "advantage_range" } } }
"""


def test_groups_without_signal_are_refunded_and_others_fill_the_batches(kafka_bootstrap, tmp_path):
    import duckdb

    recipe = tmp_path / "gated.toml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "rl", "@", str(recipe), "--no-progress"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    # exactly max_steps revisions, each from a full batch, whatever the groups the gate kept out
    assert s["revisions"] == s["batches"] == 2 and s["records_in_batches"] == 64 and s["dead_letters"] == 0, s
    db = tmp_path / "run.duckdb"
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "replay", "--db", str(db), "--run", s["run"],
                           "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with duckdb.connect(str(db), read_only=True) as con:
        refunded = {g for (g,) in con.sql("SELECT group_id FROM admissions WHERE event_type = 'admission_refund'")
                    .fetchall()}
        claimed = {g for (g,) in con.sql("SELECT group_id FROM admissions WHERE event_type = 'admission_claim'")
                   .fetchall()}
        trained = con.sql("SELECT group_id, count(*), max(abs(advantage)) FROM training_records GROUP BY 1").fetchall()
        alike = {g for (g,) in con.sql("""SELECT s.group_id FROM scores s JOIN score_rewards r ON r.score_event_id =
                                              s.event_id WHERE NOT s.evaluation GROUP BY 1
                                              HAVING count(*) = 8 AND min(r.reward) = max(r.reward)""").fetchall()}
    # the gate was exercised (the tiny model rarely says the exact sum) and refunded only groups the arenas claimed
    assert len(refunded) >= 2 and refunded <= claimed, (len(refunded), len(claimed))
    # no record of a refunded group, every trained group whole (8 records) and with a non-zero advantage
    assert not refunded & {g for g, _, _ in trained}
    assert all(n == 8 and a > 0 for _, n, a in trained), trained
    # every whole group rewarded alike was refunded, and only those were
    assert alike and alike == refunded, (len(alike), len(refunded))
