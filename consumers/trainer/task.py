"""trainer: TrainerBatches -> one optimizer step each -> the next PolicyRevision (``consumers.trainer``).

The revision event and the batch's offset commit go in one transaction; the current revision (with its
checkpoint digest), the last training state and the batches trained since are the task's state, so a restarted
trainer resumes from exactly the weights the log says it published. torch is imported off the event loop: on the
process's torch thread, where a fresh run's trainer opens as the service starts (``WarmStart``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import DEFAULT_STATE_EVERY, MICRO_BATCH_TOKENS, ServiceSettings
from policy.compute import computed
from schemas import codec
from schemas.batch import stale_reason
from schemas.errors import EventDecodeError
from schemas.events import TrainerBatch
from schemas.objectives import ObjectiveError
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision
from streams import topics
from streams.records_at import records_at
from streams.revisions import RevisionFollower, latest_revision, publish
from streams.partition_task import Out

if TYPE_CHECKING:
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import TrainStep

log = logging.getLogger("rollout.trainer")

NAME = "trainer"


class TrainerTask(TaskDefaults):
    """One partition of trainer-batches (the topic has one): each batch is one optimizer step, and the step
    publishes the next revision, naming its parent and the batch (id and digest) it was trained on.

    A batch targets the latest revision the batcher knew; pipelined, the trainer may already hold a newer one.
    Every record is then checked again against the plan's bound from the revision the trainer holds, and what
    now breaks it is refused (``StaleRecordError`` dead letters, counted in the revision's metrics): nothing
    trains further off-policy than the plan allows. Nothing is buffered: a batch is trained when it arrives.

    The state committed with each revision names the revision (its checkpoint and digest), the last training
    state on the disk (one is written every ``state_every`` revisions, in the background: named from the first
    commit after it is flushed; at first, the weights the run started from with a fresh optimizer) and the offsets
    of the batches trained after it. A take-over loads that training state, reads those
    batches back from the log and trains them again (``records_at``), and checks it reached the committed
    revision's served weights (``ReferenceTrainer.settle``): the log, not a state written every step, makes the
    optimizer durable. Files a take-over may need are removed only once a commit names newer ones (``committed``).
    """

    def __init__(self, partition: int, family: str, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 epochs: int = 1, train_step: TrainStep | None = None, producer: str = "trainer",
                 target_checkpoint: Callable[[Any], CheckpointRef | None] | None = None,
                 keep_checkpoints: int = 0, weight_decay: float = 0.0, served_model: str | None = None,
                 state_every: int = DEFAULT_STATE_EVERY, micro_batch_tokens: int = MICRO_BATCH_TOKENS,
                 read_records: Callable[[str, int, list[int]], Awaitable[list[Any]]] | None = None,
                 max_steps: int | None = None, lora: Any = None, optimizer: Any = None, objective: Any = None,
                 warm: WarmStart | None = None) -> None:
        """``target_checkpoint``: where the first batch's target revision's weights are (default: this trainer's
        checkpoint_dir naming of the tiny model); the revisions topic says it, see ``wiring``. ``read_records(topic,
        partition, offsets)``: committed records read back from the log (a take-over's batches to train again);
        without it a take-over resumes from the last training state's moments and the committed weights.
        ``warm``: a trainer already opened on the run's first revision (``WarmStart``)."""
        self.partition = partition
        self.family = family
        self.dir = Path(checkpoint_dir)
        self.user_step = train_step
        self.target_checkpoint = target_checkpoint
        self.producer = producer
        self.read_records = read_records
        self.max_steps = max_steps  # the run's last revision: nothing is trained past it
        self.options = dict(lr=lr, epochs=epochs, keep_checkpoints=keep_checkpoints, weight_decay=weight_decay,
                            served_model=served_model, state_every=state_every, micro_batch_tokens=micro_batch_tokens,
                            last_revision=max_steps, lora=lora, optimizer=optimizer,
                            objective=objective)
        self.warm = warm
        self.trainer: ReferenceTrainer | None = None
        self.current: dict[str, Any] = {}  # the revision: {"revision", "checkpoint"}
        self.base: dict[str, Any] = {}  # the last training state: {"revision", "checkpoint", "fresh"?}
        self.since: list[list[Any]] = []  # [topic, offset] of each batch trained after it
        self.refused = 0

    def load_state(self, state: dict[str, Any]) -> None:
        self.current = dict(state.get("current", {}))
        self.base = dict(state.get("base", {}))
        self.since = [list(x) for x in state.get("since", [])]

    def state(self) -> dict[str, Any]:
        return {"current": self.current, "base": self.base, "since": self.since} if self.current else {}

    def committed(self) -> None:
        if self.trainer is not None and self.current:
            base = self.base or {"revision": self.current["revision"]}  # a state from before bases were named
            self.trainer.prune(int(self.current["revision"]), int(base["revision"]), fresh=bool(base.get("fresh")))

    def _open(self, ref: CheckpointRef, revision: int) -> ReferenceTrainer:
        from consumers.trainer import distributed
        from consumers.trainer.step import open_trainer

        opts = dict(ref=ref, revision=revision, family=self.family, checkpoint_dir=str(self.dir), **self.options)
        group = distributed.current()  # under torchrun: every rank opens its shard of the same trainer
        return distributed.Lockstep.open(group, open_trainer, **opts) if group else open_trainer(**opts)

    def _first(self, batch: TrainerBatch) -> tuple[CheckpointRef, int]:
        """The weights the first batch ever is trained from: its target revision's."""
        found = self.target_checkpoint(batch.target) if self.target_checkpoint is not None else None
        if found is not None:
            return found, batch.target.revision
        from policy.checkpoint import checkpoint_filename

        ck = batch.target
        digest = ck.checkpoint_digest or "0" * 64
        return CheckpointRef(uri=(self.dir / checkpoint_filename(ck.family, ck.revision, digest)).resolve()
                             .as_uri(), digest=digest), ck.revision

    def _ensure(self, batch: TrainerBatch, committed: list[TrainerBatch]) -> ReferenceTrainer:
        """The trainer at the committed revision: opened on the first batch's target, or taken over (``committed``:
        the batches trained after the last training state, read back from the log)."""
        if self.trainer is not None:
            return self.trainer
        warm = self.warm.take() if self.warm is not None else None
        if not self.current:
            ref, rev = self._first(batch)
            same = warm is not None and warm.revision == rev and warm.refs.get(rev) == ref
            self.trainer = warm if same else self._open(ref, rev)
            self.base = {"revision": rev, "checkpoint": ref.model_dump(mode="json"), "fresh": True}
            return self.trainer
        del warm  # a take-over: its weights are the committed revision's, not the run's first
        ref, rev = CheckpointRef(**self.current["checkpoint"]), int(self.current["revision"])
        # a state committed before training states were written every few revisions names none: its own is beside it
        base = self.base or {"revision": rev, "checkpoint": self.current["checkpoint"]}
        base_ref, base_rev = CheckpointRef(**base["checkpoint"]), int(base["revision"])
        if base.get("fresh"):  # no training state yet: the run's first weights, a fresh optimizer
            trainer = self._open(base_ref, base_rev)
        else:
            trainer = self._open(ref, rev)
            if not trainer.load_training_state(base_ref, revision=base_rev):
                log.warning("resuming from revision %d without its training state (%s missing): fresh optimizer "
                            "moments, and the served weights' precision", rev, trainer.training_state_path(base_ref))
                self.base, self.since = {"revision": rev, "checkpoint": self.current["checkpoint"], "fresh": True}, []
                self.trainer = trainer
                return trainer
        if len(committed) == len(self.since):
            for b in committed:
                self._train(trainer, b)
                trainer.advance()
            if trainer.revision != rev:
                raise RuntimeError(f"re-training from revision {base_rev} reached r{trainer.revision}, not the "
                                   f"committed r{rev}: the state committed with it is inconsistent")
        else:
            log.warning("%d of the %d batches trained after revision %d's training state are no longer in the log: "
                        "resuming with its optimizer moments and revision %d's served weights", len(self.since) -
                        len(committed), len(self.since), base_rev, rev)
        if base_rev != rev:
            trainer.settle(ref, rev)
        log.info("took over", extra={"fields": {"service": NAME, "revision": rev, "training_state": base_rev,
                                                "retrained": len(committed)}})
        self.trainer = trainer
        return trainer

    def _train(self, trainer: ReferenceTrainer, batch: TrainerBatch
               ) -> tuple[TrainerBatch | None, list[Any], dict[str, float]]:
        """One optimizer step on the batch's records that the revision the trainer holds may still train (a
        derived run's batch is checked against its own target: its bound paces history, ``schemas.history``); the
        records refused, and the step's figures. Nothing when every record is refused."""
        from consumers.trainer.tensors import to_tensors

        holds = PolicyRef(family=self.family, revision=trainer.revision if batch.history is None
                          else batch.target.revision)
        keep, refused = [], []
        for r in batch.records:
            reason = stale_reason(r, holds, batch.max_off_policy_steps, batch.history)
            (keep.append(r) if reason is None else refused.append((r, f"batch {batch.batch_id}: {reason} (the "
                                                                      f"trainer holds r{holds.revision})")))
        if not keep:
            return None, refused, {}
        step = batch if len(keep) == len(batch.records) else batch.model_copy(update={"records": keep})
        stats = (self.user_step or trainer.step)(to_tensors(step), step)
        stats.update(records=float(len(keep)), refused_records=float(len(refused)))
        return step, refused, stats

    async def _committed_batches(self) -> list[TrainerBatch]:
        """The batches trained after the last training state, read back from the log (a take-over)."""
        if self.trainer is not None or not self.since or self.read_records is None:
            return []
        recs = []
        for topic in dict.fromkeys(t for t, _ in self.since):
            recs += await self.read_records(topic, self.partition, [o for t, o in self.since if t == topic])
        return [decode(r, TrainerBatch) for r in recs]

    async def process(self, rec: Any) -> list:
        try:
            batch = decode(rec, TrainerBatch)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        if batch.family != self.family:
            return [dead_letter(rec, NAME, "CrossFamilyMixError",
                                f"batch {batch.batch_id} is {batch.family!r}; this trainer trains {self.family!r}")]
        committed = await self._committed_batches()
        # loading the model, taking over and training take seconds to minutes on a busy CPU: on the process's one
        # torch thread (``policy.compute``)
        trainer = await computed(self._ensure, batch, committed)
        if self.max_steps is not None and trainer.revision >= self.max_steps:
            why = (f"batch {batch.batch_id}: the run's last revision (max_steps {self.max_steps}) is trained; "
                   "records generated past it are not")
            self.refused += len(batch.records)
            return [dead_letter(rec, NAME, "RunComplete", why, batch.run_id, raw=codec.encode(r))
                    for r in batch.records]
        try:
            step, refused, stats = await computed(self._train, trainer, batch)
        except ObjectiveError as e:  # the weights are untouched: the next batch trains from the same revision
            log.error("the objective refused batch %s: %s", batch.batch_id, e)
            self.refused += len(batch.records)
            return [dead_letter(rec, NAME, "ObjectiveError", f"batch {batch.batch_id}: {e}", batch.run_id)]
        outs = [dead_letter(rec, NAME, "StaleRecordError", why, batch.run_id, raw=codec.encode(r),
                            partial=step is not None) for r, why in refused]
        self.refused += len(outs)
        if step is None:
            log.warning("refused a whole batch", extra={"fields": {"service": NAME, "batch_id": batch.batch_id,
                                                                   "holds": trainer.revision}})
            return outs
        rev = await computed(trainer.publish, run_id=batch.run_id, producer=self.producer, metrics=stats,
                              batch=batch)
        log.info("trained", extra={"fields": {"service": NAME, "revision": rev.revision, "batch_id": batch.batch_id,
                                              "batch_target": batch.target.revision, **stats}})
        self.current = {"revision": rev.revision, "checkpoint": rev.checkpoint.model_dump(mode="json")}
        self.since.append([rec.topic, rec.offset])
        state = trainer.last_state()  # on the disk: a state still being written is named by a later commit
        if state is not None and (not self.base or self.base.get("fresh") or state[0] > int(self.base["revision"])):
            at, ref = state
            self.base = {"revision": at, "checkpoint": ref.model_dump(mode="json")}
            self.since = self.since[len(self.since) - (rev.revision - at):]  # the batches trained after it
        return outs + [Out(topics.POLICY_REVISIONS.name, rev)]


class WarmStart:
    """The trainer opened on the run's first revision before any batch arrives, on the process's torch thread
    (``policy.compute``): in ``rollout demo`` and ``rollout rl`` the model loads while vLLM starts instead of after
    the first batch (7.7 s of the demo's first revision, benchmarks/RESULTS.md). Handed once, to the first batch
    ever that starts from that revision; a take-over, or a first batch that targets another revision, opens its
    own and this one is dropped."""

    def __init__(self, open_first: Callable[[], ReferenceTrainer]) -> None:
        from policy.compute import COMPUTE

        self._future: Future | None = COMPUTE.submit(open_first)

    def take(self) -> ReferenceTrainer | None:
        """The opened trainer, once; None after that, or when opening it failed (the batch's own open then says
        why). Called on the torch thread, where the opening ran first."""
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - the batch opens its own, and that raises
            log.warning("opening the trainer ahead of the first batch failed: %s", e)
            return None


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
    from consumers.trainer.step import initial_revision

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
    async with RevisionFollower(client_kwargs, cfg.family) as follower:  # one read: the first and the newest
        revs = [rev for _, rev in await follower.read_to_end()]
    rev0 = next((r for r in revs if r.revision == first), None)
    start = (lambda target: rev0.checkpoint if target.revision == first else None) if rev0 and rev0.checkpoint \
        else None
    options = dict(lr=cfg.lr, epochs=cfg.epochs, producer=f"{NAME}{cfg.instance}", target_checkpoint=start,
                   keep_checkpoints=cfg.keep_checkpoints, weight_decay=cfg.weight_decay,
                   served_model=cfg.served_model, state_every=cfg.state_every,
                   micro_batch_tokens=cfg.micro_batch_tokens, max_steps=cfg.max_steps, lora=cfg.lora,
                   optimizer=cfg.optimizer, objective=cfg.objective)
    from consumers.trainer import distributed

    # a fresh run (no revision after its first: a trainer joining a run under way takes over instead), and not
    # under torchrun, whose ranks open their shards together (``TrainerTask._open``)
    fresh = start is not None and max(r.revision for r in revs) == first and distributed.current() is None
    warm = WarmStart(lambda: TrainerTask(0, cfg.family, cfg.checkpoint_dir, **options)._open(rev0.checkpoint, first)) \
        if fresh else None
    yield lambda p: TrainerTask(p, cfg.family, cfg.checkpoint_dir, **options, warm=warm,
                                read_records=lambda topic, p, offsets: records_at(client_kwargs, topic, p, offsets))
