"""Child processes that end with the process that started them.

A server or an arena started for a run is that run's: when the run's process dies (SIGKILL, the OOM killer), the
kernel sends each such child SIGTERM (``PR_SET_PDEATHSIG``), so nothing is left holding a port, cores and
gigabytes after it. The signal follows the thread that started the child: start them from the event loop's
thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Callable

PR_SET_PDEATHSIG = 1


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
