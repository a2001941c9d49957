"""Stable names for service instances started without ``--instance``.

A transactional producer's id is what lets its successor abort the transaction it left open: the successor's
``init_transactions`` fences every earlier producer with that id and aborts its open transaction at once. With a
random id per process, a SIGKILLed process's open transaction (its offsets pending) blocks the next owner of its
partitions until the broker's transaction timeout. So an unnamed instance takes the lowest free *slot* of its
consumer group on this host, ``<host>-<k>``, held by an exclusive ``flock`` on a file under the cache directory:
the kernel frees it when the process dies, however it dies, so the next unnamed instance on the host starts with
the dead one's id, and no two live processes ever share one.

A process on another host, or a container whose host name changes on restart, gets another id: its predecessor's
transaction is then aborted by the broker's timeout (``ROLLOUT_TRANSACTION_TIMEOUT_MS``), as before. Name the
instances (``--instance``, a StatefulSet's pod name) to be independent of the host.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from pathlib import Path
from typing import IO

from schemas.cache import cache_dir

MAX_SLOTS = 4096
_HELD: dict[str, tuple[str, IO[str]]] = {}  # group -> (slot name, its open lock file): held for the process's life


def slots_dir() -> Path:
    """Where this host's slots are held, and what lives as long as a slot (``streams.poison``)."""
    return cache_dir() / "instances"


def write_for_successor(path: Path, text: str) -> None:
    """A small file the next process with this instance's id reads (``streams.poison``, ``streams.commits``):
    written whole (a temporary named by this process, then renamed), not fsynced: a process's death, however it
    dies, keeps the page cache, which is what these files are for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def slot_name(group: str, folder: Path | None = None) -> str:
    """This process's slot of ``group``: the lowest one no live process on this host holds, claimed on first use
    and kept for the process's life (every processor the process builds for the group has the same id)."""
    if group in _HELD:
        return _HELD[group][0]
    folder = folder or slots_dir()
    folder.mkdir(parents=True, exist_ok=True)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", group)
    for k in range(MAX_SLOTS):
        f = open(folder / f"{safe}.{k}.lock", "a")  # noqa: SIM115 - held open: it is the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        _HELD[group] = (f"{host}-{k}", f)
        return _HELD[group][0]
    raise RuntimeError(f"{MAX_SLOTS} unnamed instances of {group} on this host: name them (--instance)")
