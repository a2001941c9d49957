"""What the machine holds, read from Linux's /proc: its memory, and the memory of a process tree. The arena sizes
the episodes it keeps in flight by it (``producers.arena.concurrency``); the benchmarks measure a side's peak by it.
Where /proc is not there, each reader says so with None or an empty result rather than guessing."""

from __future__ import annotations

import os

PAGE = os.sysconf("SC_PAGE_SIZE")


def meminfo(path: str = "/proc/meminfo") -> dict[str, int] | None:
    """``MemTotal``, ``MemAvailable``... in bytes; None where the file is not there."""
    try:
        with open(path) as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return None


def tree_rss(root: int, skip: frozenset[int] = frozenset()) -> dict[int, int]:
    """RSS in bytes of ``root`` and each of its descendants, by pid (one that exits meanwhile is left out; the
    subtrees under ``skip`` too)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        try:
            with open(f"/proc/{pid}/statm") as f:
                out[pid] = int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        todo += children.get(pid, [])
    return out


def pss(pid: int) -> int:
    """Proportional set size in bytes (a page shared by k processes counts 1/k in each), from
    /proc/PID/smaps_rollup; 0 for a process that exited meanwhile."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
    except (OSError, ValueError):
        return 0
