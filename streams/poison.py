"""How often processing each input record failed: what lets one poison record be dead-lettered instead of holding
its partitions for ever (``streams.transactions.TransactionalProcessor._process``).

A try is counted when it *starts* and given back when it ends well, so a try that never ends, because the
process died in it, counts as a failure too. In memory that is the same as counting exceptions. Written to a
file (``path``), the counts outlive the process: needed where a record's failure kills the process before any
exception reaches the counter, as in a torchrun group, where a follower rank that raises or crashes on a batch
makes torchrun restart every rank, rank 0 (the one with the counter) included. There, a record during which the
group died ``attempts`` times is dead-lettered like one that raised that often.

The file is per transactional id (the instance), under the cache directory: torchrun restarts a group on the
same host, with the same id. Counts are forgotten once a commit passes their record. Where they are kept in a file
a process tries a record once per life: a failed try ends the process (``ProcessMustRestart``), since a group
whose step failed may no longer agree on anything (a follower gone, or stuck in a collective rank 0 left), and
tries made against a broken group would count against a record that did nothing wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from streams.instances import write_for_successor

Key = tuple[str, int, int]  # (topic, partition, offset)
DIED = "the process died while processing it"


class ProcessMustRestart(RuntimeError):
    """A try failed where this process may not try again (``PoisonCounts.once_per_life``): the try is counted,
    and the process exits for its supervisor (torchrun) to start it again."""


class PoisonCounts:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.counts: dict[Key, tuple[int, str]] = {}
        self._open: dict[Key, tuple[int, str]] = {}  # tries under way: the count before each
        if path is not None and path.exists():
            try:
                self.counts = {(t, p, o): (n, why) for t, p, o, n, why in json.loads(path.read_text())}
            except (ValueError, TypeError):  # a torn write: start again; the worst case is more tries
                self.counts = {}

    @property
    def once_per_life(self) -> bool:
        """Kept in a file: a failed try ends the process (the module's docstring says why)."""
        return self.path is not None

    def __bool__(self) -> bool:
        return bool(self.counts)

    def get(self, key: Key) -> tuple[int, str]:
        """The failed tries of ``key`` so far and the last reason."""
        return self.counts.get(key, (0, ""))

    def start(self, key: Key) -> None:
        """A try of ``key`` begins: counted as failed until ``ended`` says otherwise."""
        self._open[key] = before = self.get(key)
        self._set(key, (before[0] + 1, DIED))

    def ended(self, key: Key, error: BaseException | None) -> None:
        """The try ``start`` counted ended: given back when it went well (``error`` None), or failed for the
        environment's fault (the caller passes None then too); else kept, with ``error`` as its reason."""
        before = self._open.pop(key, self.get(key))
        if error is None:
            self._set(key, before if before[0] else None)
        else:
            self._set(key, (before[0] + 1, f"{type(error).__name__}: {error}"))

    def forget(self, committed: dict[int, dict[str, int]]) -> None:
        """Drop the counts of records a commit has passed (``committed``: partition -> topic -> next offset)."""
        kept = {k: v for k, v in self.counts.items() if k[2] >= committed.get(k[1], {}).get(k[0], 0)}
        if len(kept) != len(self.counts):
            self.counts = kept
            self._save()

    def _set(self, key: Key, value: tuple[int, str] | None) -> None:
        if value is None:
            self.counts.pop(key, None)
        else:
            self.counts[key] = value
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        write_for_successor(self.path, json.dumps([[*k, *v] for k, v in self.counts.items()]))
