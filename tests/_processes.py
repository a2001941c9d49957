"""Service processes a test started: stopped the way a deployment stops them."""

from __future__ import annotations

import signal
import subprocess


def stop(*procs: subprocess.Popen) -> None:
    """SIGTERM (a frozen one is woken first), 30 s each to exit, then SIGKILL."""
    for p in procs:
        p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
