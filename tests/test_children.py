"""A child started for a run ends with the run's process (``producers.inference.children``): a parent SIGKILLed (as the
OOM killer does) leaves no server or arena behind. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import subprocess, sys, time
from producers.inference.children import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone for our purpose
        return f.read().split()[2] != "Z"


def test_a_child_started_for_a_run_dies_with_its_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


async def test_a_server_group_whose_leader_died_first_is_ended_whole(tmp_path):
    """``VllmServer.stop`` with its API server (the group's leader) already SIGKILLed, as the OOM killer does: the
    engine core it forked, still in the group, is ended too (it once lived on, holding the model and the cores)."""
    import asyncio

    from producers.inference.vllm_server import VllmServer

    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "sleep 300 & echo $!; wait", stdout=asyncio.subprocess.PIPE, start_new_session=True)
    engine = int((await proc.stdout.readline()).decode())  # the leader's child, in its group
    os.kill(proc.pid, signal.SIGKILL)
    while _alive(proc.pid):  # (not ``proc.wait()``: asyncio's waits for the pipe, which the engine holds open)
        await asyncio.sleep(0.05)
    assert _alive(engine)  # orphaned, alive: what stop() used to leave
    server = VllmServer(tmp_path)
    server.proc = proc
    t0 = time.monotonic()
    await server.stop(grace_s=5.0)
    assert not _alive(engine) and time.monotonic() - t0 < 5.0  # sleep ends on SIGTERM: no need to wait for SIGKILL
