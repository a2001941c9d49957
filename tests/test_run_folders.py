"""A run leaves its folder under .state/demo (checkpoints, vLLM log): the newest ``--keep-runs`` stay, older ones
are removed when a run starts, so a machine running the loop every day does not fill its disk."""

from __future__ import annotations

import os

from rollout.demo import _retain_runs


def test_older_run_folders_are_removed_newest_kept(tmp_path, capsys):
    for i, name in enumerate(["a", "b", "c", "d"]):
        d = tmp_path / name / "checkpoints"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # a oldest, d newest
    _retain_runs(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]
    assert "removed 2 older run folder(s)" in capsys.readouterr().out
    _retain_runs(tmp_path, 2)  # nothing more to remove: silent
    assert capsys.readouterr().out == ""
    _retain_runs(tmp_path / "absent", 2)
