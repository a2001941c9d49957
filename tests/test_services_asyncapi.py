"""`faststream docs gen consumers.asyncapi:app` describes every pipeline topic and message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_asyncapi_lists_every_topic_and_message(tmp_path):
    faststream = Path(sys.executable).with_name("faststream")
    out = subprocess.run([str(faststream), "docs", "gen", "consumers.asyncapi:app", "--yaml", "--app-dir", str(ROOT)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    spec = (tmp_path / "asyncapi.yaml").read_text()
    from streams import topics

    for t in topics.TOPICS.values():
        assert t.name in spec, t.name
    for message in ("Step", "Rollout", "RolloutScored", "TrainingRecord", "TrainerBatch", "PolicyRevision",
                    "DeadLetter"):
        assert f"title: {message}" in spec, message
