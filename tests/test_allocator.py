"""The trainer's process on tcmalloc (consumers.trainer.allocator): started again under it once, its children handed the
LD_PRELOAD the command had, and ``ROLLOUT_ALLOCATOR=system`` keeping glibc's. Real processes, real exec."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from consumers.trainer import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the command sees after reexec(), and what a child it starts sees
PROBE = """
import json, os, subprocess, sys
from consumers.trainer import allocator
allocator.reexec()
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"tcmalloc": allocator.in_use(), "child_ld_preload": child, "pid": os.getpid(),
                  "marker": "_ROLLOUT_LD_PRELOAD_BEFORE" in os.environ}))
"""


def _probe(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    full.update(PYTHONPATH=ROOT, **env)
    done = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_library_is_installed():
    """.ci/setup installs Debian's libtcmalloc-minimal4: without it every trainer runs on glibc's allocator."""
    assert allocator.library() is not None


def test_a_command_is_started_again_under_tcmalloc_and_its_children_are_not():
    got = _probe()
    assert got["tcmalloc"] is True
    assert got["child_ld_preload"] == ""  # the command had none: its children get none
    assert got["marker"] is False


def test_a_users_own_preload_is_kept_for_the_command_and_its_children():
    libc_path = next(line.split()[-1] for line in open("/proc/self/maps") if "libc.so" in line)
    got = _probe(LD_PRELOAD=libc_path)
    assert got["tcmalloc"] is True
    assert got["child_ld_preload"] == libc_path


def test_system_keeps_glibcs_allocator():
    got = _probe(**{allocator.ENV: "system"})
    assert got["tcmalloc"] is False
    assert got["child_ld_preload"] == ""
