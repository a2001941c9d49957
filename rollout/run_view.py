"""The live view of a run (``rollout demo``, ``rollout rl``): revisions, rewards and lags read from the log as
they come, one progress line redrawn."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    """What the live line and the summary show, fed by a tail of the scores and revisions topics."""

    phase: str = "starting"
    train: dict[int, list[float]] = field(default_factory=dict)   # revision -> rewards of training rollouts
    parts: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # reward component -> revision -> values
    evals: dict[int, list[float]] = field(default_factory=dict)   # revision -> correct (0/1) per eval question
    revisions: dict[int, dict[str, float]] = field(default_factory=dict)  # revision -> trainer metrics
    scored: int = 0       # training rollouts scored
    eval_scored: int = 0  # evaluation rollouts scored
    started: float = field(default_factory=time.monotonic)

    def add_score(self, s: Any) -> None:
        if s.evaluation:
            self.eval_scored += 1
        else:
            self.scored += 1
        rev = s.trainable_steps[0].policy.revision if s.trainable_steps else None
        if rev is None:
            return
        if s.evaluation:
            exact = next((v for k, v in s.metrics.items() if k.endswith("/reward/exact_answer")), None)
            value = exact if exact is not None else max(s.rewards.values(), default=0.0)
            self.evals.setdefault(rev, []).append(1.0 if value >= 1.0 else 0.0)
            return
        self.train.setdefault(rev, []).extend(s.rewards.values())
        for name, v in s.metrics.items():
            if "/reward/" in name:
                self.parts.setdefault(name.rsplit("/", 1)[-1], {}).setdefault(rev, []).append(v)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        out = [f"[{elapsed:5.0f}s] {self.phase}"]
        if self.revisions:
            r = max(self.revisions)
            m = self.revisions[r]
            out.append(f"revision r{r}")
            if "reward_mean" in m:
                out.append(f"batch reward {m['reward_mean']:.3f}")
            if "mismatch_mean" in m:
                out.append(f"mismatch {m['mismatch_mean']:.3f}")
        done = {k: v for k, v in self.evals.items() if v}
        if done:
            r = max(done)
            out.append(f"eval r{r} {mean(done[r]):.0%} (r{min(done)} {mean(done[min(done)]):.0%})")
        out.append(f"scored {self.scored}")
        return "  ".join(out)


def mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else 0.0


async def follow_log(kw: dict, progress: Progress, stop: asyncio.Event) -> None:
    """Follow scores and revisions (read_committed, no group) until ``stop``, then read to the end."""
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from schemas.events import PolicyRevision, RolloutScored
    from streams import topics

    c = AIOKafkaConsumer(topics.SCORES.name, topics.POLICY_REVISIONS.name, **kw, group_id=None,
                         isolation_level="read_committed", auto_offset_reset="earliest",
                         max_partition_fetch_bytes=64 * 1024 * 1024)
    await c.start()
    idle = 0
    try:
        while not stop.is_set() or idle < 3:
            got = await c.getmany(timeout_ms=300)
            idle = 0 if got else idle + 1
            for recs in got.values():
                for r in recs:
                    try:
                        ev = codec.decode(r.value)
                    except Exception:  # noqa: BLE001 - the services dead-letter bad frames; not ours to show
                        continue
                    if isinstance(ev, RolloutScored):
                        progress.add_score(ev)
                    elif isinstance(ev, PolicyRevision):
                        progress.revisions[ev.revision] = dict(ev.metrics)
    finally:
        await c.stop()


async def show_progress(progress: Progress, stop: asyncio.Event, enabled: bool) -> None:
    if not enabled:
        return
    from rich.console import Console
    from rich.live import Live

    with Live(progress.line(), console=Console(stderr=True), refresh_per_second=2, transient=False) as live:
        while not stop.is_set():
            live.update(progress.line())
            await asyncio.sleep(0.5)
        live.update(progress.line())
