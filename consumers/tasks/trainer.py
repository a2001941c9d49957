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

from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.batch import stale_reason
from schemas.errors import EventDecodeError
from schemas.events import TrainerBatch
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision
from streams import topics
from streams.revisions import latest_revision, publish
from streams.transactions import Out

if TYPE_CHECKING:
    from consumers.trainer import ReferenceTrainer, TrainStep

log = logging.getLogger("rollout.trainer")

NAME = "trainer"


class TrainerTask(TaskDefaults):
    """One partition of trainer-batches (the topic has one): each batch is one optimizer step, and the step
    publishes the next revision, naming its parent and the batch (id and digest) it was trained on.

    A batch targets the latest revision the batcher knew; pipelined, the trainer may already hold a newer one.
    Every record is then checked again against the plan's bound from the revision the trainer holds, and what
    now breaks it is refused (``StaleRecordError`` dead letters, counted in the revision's metrics): nothing
    trains further off-policy than the plan allows. Nothing is buffered: a batch is trained when it arrives.
    """

    def __init__(self, partition: int, family: str, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 epochs: int = 1, train_step: TrainStep | None = None, producer: str = "trainer",
                 target_checkpoint: Callable[[Any], CheckpointRef | None] | None = None,
                 keep_checkpoints: int = 0, weight_decay: float = 0.0, served_model: str | None = None) -> None:
        # target_checkpoint: where the first batch's target revision's weights are (default: this trainer's
        # checkpoint_dir naming of the tiny model); the revisions topic says it, see ``wiring``
        self.family = family
        self.dir = Path(checkpoint_dir)
        self.lr = lr
        self.weight_decay = weight_decay
        self.served_model = served_model
        self.epochs = epochs
        self.user_step = train_step
        self.target_checkpoint = target_checkpoint
        self.producer = producer
        self.keep_checkpoints = keep_checkpoints
        self.trainer: ReferenceTrainer | None = None
        self.current: dict[str, Any] = {}
        self.refused = 0

    def load_state(self, state: dict[str, Any]) -> None:
        self.current = dict(state.get("current", {}))

    def state(self) -> dict[str, Any]:
        return {"current": self.current} if self.current else {}

    def _ensure(self, batch: TrainerBatch) -> ReferenceTrainer:
        from consumers import distributed

        if self.trainer is None:
            if self.current:
                ref = CheckpointRef(**self.current["checkpoint"])
                rev = int(self.current["revision"])
            elif self.target_checkpoint is not None and self.target_checkpoint(batch.target) is not None:
                ref, rev = self.target_checkpoint(batch.target), batch.target.revision  # first batch ever
            else:
                from policy.checkpoint import checkpoint_filename

                ck = batch.target
                digest = ck.checkpoint_digest or "0" * 64
                ref = CheckpointRef(uri=(self.dir / checkpoint_filename(ck.family, ck.revision, digest)).resolve()
                                    .as_uri(), digest=digest)
                rev = ck.revision
            opts = dict(ref=ref, revision=rev, family=self.family, checkpoint_dir=str(self.dir), lr=self.lr,
                        epochs=self.epochs, keep_checkpoints=self.keep_checkpoints, weight_decay=self.weight_decay,
                        served_model=self.served_model)
            group = distributed.current()  # under torchrun: every rank opens its shard of the same trainer
            self.trainer = distributed.Lockstep.open(group, **opts) if group else distributed.open_trainer(**opts)
            if self.current and not self.trainer.load_training_state(ref):
                log.warning("resuming from revision %d without its training state (%s missing): fresh optimizer "
                            "moments, and the served weights' precision", rev, self.trainer.training_state_path(ref))
        return self.trainer

    async def process(self, rec: Any) -> list:
        try:
            batch = decode(rec, TrainerBatch)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        if batch.family != self.family:
            return [dead_letter(rec, NAME, "CrossFamilyMixError",
                                f"batch {batch.batch_id} is {batch.family!r}; this trainer trains {self.family!r}")]
        # Loading the model and preparing tensors take seconds on a busy CPU: off the event loop, whose heartbeats
        # keep every service of this process in its consumer group (a load on the loop cost them their membership)
        trainer = await asyncio.to_thread(self._ensure, batch)
        # a derived run's batch is checked against its own target: its bound paces history (schemas.history), and
        # a batch refused whole would leave no revision for the batcher's next one to wait on
        holds = PolicyRef(family=self.family, revision=trainer.revision if batch.history is None
                          else batch.target.revision)
        keep, outs = [], []
        for r in batch.records:
            reason = stale_reason(r, holds, batch.max_off_policy_steps, batch.history)
            if reason is None:
                keep.append(r)
            else:
                outs.append(dead_letter(rec, NAME, "StaleRecordError", f"batch {batch.batch_id}: {reason} (the "
                                        f"trainer holds r{holds.revision})", batch.run_id, raw=codec.encode(r)))
        self.refused += len(outs)
        if not keep:
            log.warning("refused a whole batch", extra={"fields": {"service": NAME, "batch_id": batch.batch_id,
                                                                   "holds": holds.revision}})
            return outs
        from consumers.trainer import to_tensors

        step = batch if len(keep) == len(batch.records) else batch.model_copy(update={"records": keep})
        tensors = await asyncio.to_thread(to_tensors, step)
        stats = await asyncio.to_thread(self.user_step or trainer.step, tensors, step)
        stats.update(records=float(len(keep)), refused_records=float(len(outs)))
        rev = await asyncio.to_thread(trainer.publish, run_id=batch.run_id, producer=self.producer, metrics=stats,
                                      batch=batch)
        log.info("trained", extra={"fields": {"service": NAME, "revision": rev.revision, "batch_id": batch.batch_id,
                                              "batch_target": batch.target.revision, **stats}})
        self.current = {"revision": rev.revision, "checkpoint": rev.checkpoint.model_dump(mode="json")}
        return outs + [Out(topics.POLICY_REVISIONS.name, rev)]


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
    """Revision 0 on the log first (published here when the log has none); a fresh trainer starts from it. A
    derived run's chain starts at its fork's revision instead (``rollout derive`` published it)."""
    first = cfg.derivation.fork.revision if cfg.derivation else 0
    if cfg.derivation is None:
        await bootstrap_revision(client_kwargs, cfg.family, cfg.checkpoint_dir)
    rev0 = await latest_revision(client_kwargs, cfg.family, revision=first)
    start = (lambda target: rev0.checkpoint if target.revision == first else None) if rev0 and rev0.checkpoint \
        else None
    yield lambda p: TrainerTask(p, cfg.family, cfg.checkpoint_dir, lr=cfg.lr, epochs=cfg.epochs,
                                producer=f"{NAME}{cfg.instance}", target_checkpoint=start,
                                keep_checkpoints=cfg.keep_checkpoints, weight_decay=cfg.weight_decay,
                                served_model=cfg.served_model)
