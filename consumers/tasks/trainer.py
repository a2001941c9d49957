"""trainer: TrainerBatches -> one optimizer step each -> the next PolicyRevision (``consumers.trainer``).

The revision event and the batch's offset commit go in one transaction; the current revision (with its
checkpoint digest) is the task's snapshot state, so a restarted trainer resumes from exactly the weights
the log says it published. torch is imported only when the first batch arrives.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from consumers.service import TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.errors import EventDecodeError
from schemas.events import TrainerBatch
from schemas.policy import CheckpointRef, PolicyRevision
from streams import topics
from streams.revisions import latest_revision, publish
from streams.transactions import Out

if TYPE_CHECKING:
    from consumers.trainer import ReferenceTrainer, TrainStep

log = logging.getLogger("rollout.trainer")

NAME = "trainer"


class TrainerTask:
    """One partition of trainer-batches (the topic has one): train, publish the next revision.

    ``min_records``: take one optimizer step (one revision) per at least this many records, accumulating
    smaller batches (the batcher's batches are partition-local, so several make one plan ``batch_size``;
    the arena paces admission by that size). Waiting batches are buffered input (changelog snapshot).
    """

    def __init__(self, partition: int, family: str, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 epochs: int = 1, train_step: TrainStep | None = None, producer: str = "trainer",
                 min_records: int = 1,
                 target_checkpoint: Callable[[Any], CheckpointRef | None] | None = None) -> None:
        # target_checkpoint: where the first batch's target revision's weights are (default: this trainer's
        # checkpoint_dir naming of the tiny model); the revisions topic says it, see checkpoint_from_log
        self.min_records = min_records
        self.pending: list[tuple[Any, TrainerBatch]] = []
        self.family = family
        self.dir = Path(checkpoint_dir)
        self.lr = lr
        self.epochs = epochs
        self.user_step = train_step
        self.target_checkpoint = target_checkpoint
        self.producer = producer
        self.trainer: ReferenceTrainer | None = None
        self.current: dict[str, Any] = {}
        self.history: list[dict[str, float]] = []

    def load_state(self, state: dict[str, Any]) -> None:
        self.current = dict(state.get("current", {}))

    def state(self) -> dict[str, Any]:
        return {"current": self.current} if self.current else {}

    def buffered(self) -> dict[str, list[int]]:
        return {rec.topic: [r.offset for r, _ in self.pending] for rec, _ in self.pending[:1]}

    def restore(self, rec: Any) -> None:
        self.pending.append((rec, decode(rec, TrainerBatch)))

    def tick(self, now: float) -> list:
        return []

    def _ensure(self, batch: TrainerBatch) -> ReferenceTrainer:
        from consumers.trainer import ReferenceTrainer, policy_kind

        if self.trainer is None:
            if self.current:
                ref = CheckpointRef(**self.current["checkpoint"])
                rev = int(self.current["revision"])
            elif self.target_checkpoint is not None and self.target_checkpoint(batch.target) is not None:
                ref, rev = self.target_checkpoint(batch.target), batch.target.revision  # first batch ever
            else:
                from policy.checkpoint import checkpoint_filename

                ck = batch.target
                ref = CheckpointRef(uri=(self.dir / checkpoint_filename(ck.family, ck.revision)).resolve().as_uri(),
                                    digest=ck.checkpoint_digest or "0" * 64)
                rev = ck.revision
            kind = policy_kind(ref)
            self.trainer = ReferenceTrainer(kind.load(ref), self.family, rev, self.dir, lr=self.lr,
                                            epochs=self.epochs, kind=kind)
        return self.trainer

    async def process(self, rec: Any) -> list:
        try:
            batch = decode(rec, TrainerBatch)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        if batch.family != self.family:
            return [dead_letter(rec, NAME, "CrossFamilyMixError",
                                f"batch {batch.batch_id} is {batch.family!r}; this trainer trains {self.family!r}")]
        self.pending.append((rec, batch))
        if sum(len(b.records) for _, b in self.pending) < self.min_records:
            return []
        batches = [b for _, b in self.pending]
        self.pending = []
        trainer = self._ensure(batches[0])
        if len(batches) == 1:
            merged = batches[0]
        else:  # one step over all of them (records keep their own lineage; the step's target is the newest)
            merged = batches[-1].model_copy(update={"records": [r for b in batches for r in b.records]})
        from consumers.trainer import to_tensors

        tensors = to_tensors(merged)
        # in a worker thread: a real model's step takes seconds, and the services' clients must keep running
        stats = await asyncio.to_thread(self.user_step or trainer.step, tensors, merged)
        rev = await asyncio.to_thread(trainer.publish, run_id=batch.run_id, producer=self.producer, metrics=stats)
        stats.update(revision=rev.revision, batch_target=batch.target.revision, records=len(merged.records),
                     batches=len(batches))
        self.history.append(stats)
        log.info("trained", extra={"fields": {"service": "trainer", **stats}})
        self.current = {"revision": rev.revision, "checkpoint": rev.checkpoint.model_dump(mode="json")}
        return [Out(topics.POLICY_REVISIONS.name, rev)]


async def bootstrap_revision(client_kwargs: dict[str, Any], family: str, checkpoint_dir: str | Path, *,
                             seed: int = 0, run_id: str = "run") -> PolicyRevision | None:
    """Publish revision 0 (seeded init, written to ``checkpoint_dir``) when the log has no revision of ``family``.

    A fresh deployment needs a first revision: the arena serves it and the batcher targets it. Two trainers
    starting at once may both publish it; the seeded init makes both copies identical (same checkpoint
    digest), and every reader keeps the highest revision number, so a duplicate revision 0 is harmless.
    Returns the revision published, or None when the log already had one.
    """
    if await latest_revision(client_kwargs, family) is not None:
        return None
    from consumers.trainer import initial_revision

    rev0 = initial_revision(family, checkpoint_dir, seed=seed, run_id=run_id)
    await publish(client_kwargs, rev0)
    log.info("published revision 0", extra={"fields": {"service": NAME, "family": family,
                                                       "digest": rev0.checkpoint.digest}})
    return rev0


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    """Revision 0 on the log first (published here when the log has none); a fresh trainer starts from it."""
    await bootstrap_revision(client_kwargs, cfg.family, cfg.checkpoint_dir)
    rev0 = await latest_revision(client_kwargs, cfg.family, revision=0)
    start = (lambda target: rev0.checkpoint if target.revision == 0 else None) if rev0 and rev0.checkpoint else None
    yield lambda p: TrainerTask(p, cfg.family, cfg.checkpoint_dir, lr=cfg.lr, epochs=cfg.epochs,
                                producer=f"{NAME}{cfg.instance}", min_records=cfg.step_records,
                                target_checkpoint=start)
