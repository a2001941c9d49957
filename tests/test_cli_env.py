"""The `rollout` command finds the tools installed beside its interpreter without an activated venv: verifiers
builds a harness's packages with ``uv`` (a dependency), run by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_uv_is_found_beside_the_interpreter_with_the_venv_not_activated():
    probe = ("from rollout.cli import tools_beside_interpreter; import shutil; "
             "before = shutil.which('uv'); tools_beside_interpreter(); print(before, shutil.which('uv'))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PATH": "/usr/bin:/bin"},
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert Path(after).parent == Path(sys.executable).parent and Path(after).name == "uv"
    assert before == "None" or Path(before).parent != Path(sys.executable).parent
    assert subprocess.run([after, "--version"], capture_output=True, text=True).stdout.startswith("uv 0.13")
