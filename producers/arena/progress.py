"""What an arena counts (``ArenaStats``: its JSON line of figures) and the live progress line that shows it
(``ArenaProgress``, ``rollout arena`` without ``--no-progress``)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producers.arena.pacer import AdmissionPacer
from schemas.policy import PolicyRef


@dataclass
class ArenaStats:
    groups: int = 0
    rollouts: int = 0
    failed: int = 0
    truncated: int = 0
    cut_short: int = 0  # rollouts of admitted groups a stop left unfinished past its grace: never emitted
    steps: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    inflight_cap: int | None = None  # the cap on training episodes in flight now (producers.arena.concurrency)
    episode_bytes: int | None = None  # what one episode in flight holds, learned (its processes' and state's)
    evaluations: int = 0  # held-out rollouts (counted here, not in rollouts)
    evaluated_revisions: list[int] = field(default_factory=list)
    eval_s_each: list[float] = field(default_factory=list)  # each evaluation's wall seconds (training rollouts in
    # flight continue beside it), in evaluated_revisions' order
    failure_reasons: Counter = field(default_factory=Counter)  # failed rollouts by reason (its first line, cut)
    failed_groups_in_a_row: int = 0  # training groups whose every rollout failed, since the last that did not
    admitted_on_log: int = 0  # admitted (top-level, training) rollouts on the log ...
    records: int = 0  # ... and the training records they yield, their sub-episodes' included
    started: float = field(default_factory=time.monotonic)

    @property
    def eval_s(self) -> float:
        """Wall seconds with an evaluation running, all evaluations together."""
        return sum(self.eval_s_each)

    @property
    def records_per_rollout(self) -> float | None:
        """Training records per admitted rollout so far; None before one is on the log."""
        return self.records / self.admitted_on_log if self.admitted_on_log else None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "started"} | {
            "elapsed_s": round(time.monotonic() - self.started, 3), "eval_s": round(self.eval_s, 3),
            "eval_s_each": [round(x, 2) for x in self.eval_s_each]}


class ArenaProgress:
    """A rich live line on stderr: groups, rollouts, failures, tokens, current revision, paused or running.

    ``stats``: the arena's figures; ``pacer``: its admission (paused or not, how far ahead of the trainer);
    ``policy``: the revision the arena serves now (asked at each refresh, as it changes with every swap)."""

    def __init__(self, stats: ArenaStats, pacer: AdmissionPacer, policy: Callable[[], PolicyRef]) -> None:
        self.stats, self.pacer, self.policy = stats, pacer, policy
        self._task: asyncio.Task | None = None
        self._live: Any = None

    def render(self) -> Any:
        from rich.text import Text

        s, pacer = self.stats, self.pacer
        elapsed = max(time.monotonic() - s.started, 1e-9)
        state = "[paused: waiting for the trainer]" if pacer.paused else "running"
        return Text(f"arena {state}  groups {s.groups}  rollouts {s.rollouts} ({s.rollouts / elapsed:.1f}/s)  "
                    f"in flight {s.in_flight}/{s.inflight_cap or '?'}  failed {s.failed}  tokens {s.completion_tokens} "
                    f"({s.completion_tokens / elapsed:.0f}/s)  policy {self.policy()}  "
                    f"lead {pacer.lead()}/{pacer.bound}")

    def start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self._live = Live(self.render(), refresh_per_second=4, transient=False, console=Console(stderr=True))
        self._live.start()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self._live.update(self.render())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self._live:
            self._live.update(self.render())
            self._live.stop()
