"""Child processes that end with the process that started them.

A server or an arena started for a run is that run's: when the run's process dies (SIGKILL, the OOM killer), the
kernel sends each such child SIGTERM (``PR_SET_PDEATHSIG``), so nothing is left holding a port, cores and
gigabytes after it; a child that does not stop on it is killed with its process group (``end_group_after_parent``). The signal follows the thread that started the child: start them from the event loop's
thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any, Awaitable, Callable

PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 10.0  # what a child whose parent died gets to stop by itself (``end_group_after_parent``)


def die_with_parent() -> None:
    """``preexec_fn`` of a child: SIGTERM when its parent dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def die_with_parent_at(nice: int) -> Callable[[], None]:
    """``preexec_fn`` of a child that dies with its parent and runs at ``nice`` (0: its parent's priority), it and
    every thread it starts (``rollout.cores.BACKGROUND_NICE``)."""

    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    return setup


def end_group_after_parent(grace_s: float = ORPHAN_GRACE_S, every_s: float = 0.5) -> None:
    """In a child that leads its own process group (started with ``start_new_session``): once its parent is gone,
    give it ``grace_s`` to stop on the SIGTERM ``die_with_parent`` sent, then SIGKILL the whole group. A vLLM API
    server killed mid-reload waits for ever on its engine core's reply, which never comes; SIGKILL as the death
    signal itself would leave that engine core, in a process of its own, behind. Nothing where it leads no group
    (a server started by hand from a shell)."""
    import threading
    import time

    if os.getpgid(0) != os.getpid():
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        time.sleep(grace_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="end-group-after-parent", daemon=True).start()


def group_alive(pgid: int) -> bool:
    """Whether a live process of group ``pgid`` is left: a zombie, whose memory is already freed and which a
    container's init may never reap, does not count (Linux's ``/proc``; elsewhere any member does)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


async def end_group(pgid: int, leader_exit: Awaitable[Any], grace_s: float, every_s: float = 0.1) -> None:
    """SIGTERM process group ``pgid``, whether or not its leader still lives; SIGKILL whatever of it is left after
    ``grace_s``; then reap the leader (our child) with ``leader_exit``. The group is watched, not the leader's wait:
    asyncio's also waits for the leader's pipes, which an orphan of the group may hold open."""
    import asyncio
    import time

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while (alive := group_alive(pgid)) and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        if not alive:
            break
    try:
        await asyncio.wait_for(leader_exit, 5.0)
    except asyncio.TimeoutError:
        pass
