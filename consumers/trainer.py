"""Trainer bridge: TrainerBatches -> torch tensors -> a user's training step; and a reference trainer.

* ``to_tensors(batch, packed=False)``: token-aligned tensors. Row i is ``prompt + completion``;
  ``old_logprobs[i, t]`` is the behaviour policy's log p(input_ids[i, t] | prefix) and ``loss_mask[i, t]``
  is 1 exactly on the completion tokens the record trains on; ``advantages[i, t]`` is the record's
  advantage broadcast over its tokens. ``packed=True`` concatenates the rows into one [1, sum(T)]
  sequence with ``cu_seqlens`` (for varlen kernels) instead of padding.
* ``ReferenceTrainer``: a GRPO/PPO-style clipped policy-gradient step on the local tiny policy model
  (``policy/``); after each step it writes a checkpoint (with its SHA-256) and returns the next
  ``PolicyRevision``.
* ``TrainerTask`` runs inside ``streams.transactions``: the revision event and the batch's offset commit
  in one transaction; the current revision (with its checkpoint digest) is the task's snapshot state, so
  a restarted trainer resumes from exactly the weights the log says it published.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from schemas.events import TrainerBatch
from schemas.policy import CheckpointRef, PolicyRevision

log = logging.getLogger("rollout.trainer")


@dataclass
class TrainerTensors:
    input_ids: torch.Tensor      # [B, T] long (padded) or [1, N] (packed)
    attention_mask: torch.Tensor  # [B, T] bool
    loss_mask: torch.Tensor      # [B, T] float
    advantages: torch.Tensor     # [B, T] float
    old_logprobs: torch.Tensor   # [B, T] float
    prompt_lens: torch.Tensor    # [B] long
    seq_lens: torch.Tensor       # [B] long
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32 when packed

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def to_tensors(batch: TrainerBatch, *, pad_id: int = 0, packed: bool = False) -> TrainerTensors:
    rows = []
    for r in batch.records:
        p = np.asarray(r.prompt_token_ids, dtype=np.int64)
        c = np.asarray(r.completion_token_ids, dtype=np.int64)
        ids = np.concatenate([p, c])
        lp = np.concatenate([np.zeros(len(p), np.float32), np.asarray(r.completion_logprobs, np.float32)])
        mask = np.concatenate([np.zeros(len(p), np.float32), np.asarray(r.loss_mask, np.float32)])
        adv = np.where(mask > 0, np.float32(r.advantage), np.float32(0.0)).astype(np.float32)
        rows.append((ids, lp, mask, adv, len(p)))
    lens = [len(x[0]) for x in rows]
    if packed:
        cat = lambda k, dt: torch.from_numpy(np.concatenate([x[k] for x in rows]).astype(dt)).unsqueeze(0)  # noqa: E731
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        ids = cat(0, np.int64)
        return TrainerTensors(ids, torch.ones_like(ids, dtype=torch.bool), cat(2, np.float32), cat(3, np.float32),
                              cat(1, np.float32), torch.tensor([x[4] for x in rows]), torch.tensor(lens), cu)
    B, T = len(rows), max(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.bool)
    lm, adv, olp = (torch.zeros((B, T), dtype=torch.float32) for _ in range(3))
    for i, (x, lp, m, a, _) in enumerate(rows):
        n = len(x)
        ids[i, :n] = torch.from_numpy(x)
        att[i, :n] = True
        lm[i, :n] = torch.from_numpy(m)
        adv[i, :n] = torch.from_numpy(a)
        olp[i, :n] = torch.from_numpy(lp)
    return TrainerTensors(ids, att, lm, adv, olp, torch.tensor([x[4] for x in rows]), torch.tensor(lens))


TrainStep = Callable[[TrainerTensors, TrainerBatch], dict[str, float]]


class ReferenceTrainer:
    """Clipped policy gradient (PPO/GRPO objective, token-mean over the loss mask) on ``policy.PolicyModel``."""

    def __init__(self, model: Any, family: str, revision: int, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 clip: float = 0.2, max_grad_norm: float = 1.0, epochs: int = 1) -> None:
        self.model = model
        self.family = family
        self.revision = revision
        self.dir = Path(checkpoint_dir)
        self.clip = clip
        self.max_grad_norm = max_grad_norm
        self.lr = lr
        self.epochs = epochs  # optimizer passes over each batch (PPO epochs; the clip bounds how far they go)
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)

    def loss(self, t: TrainerTensors) -> tuple[torch.Tensor, dict[str, float]]:
        logits, _ = self.model(t.input_ids[:, :-1])
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        new_lp = logp_all.gather(2, t.input_ids[:, 1:].unsqueeze(2)).squeeze(2)  # logp of token t+1
        mask = t.loss_mask[:, 1:]
        old_lp = t.old_logprobs[:, 1:]
        adv = t.advantages[:, 1:]
        ratio = torch.exp(new_lp - old_lp)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip) * adv
        per_tok = -torch.minimum(unclipped, clipped)
        denom = mask.sum().clamp(min=1.0)
        loss = (per_tok * mask).sum() / denom
        with torch.no_grad():
            frac = (((ratio - 1).abs() > self.clip).float() * mask).sum() / denom
            kl = ((old_lp - new_lp) * mask).sum() / denom
        return loss, {"loss": float(loss.detach()), "clip_frac": float(frac), "approx_kl": float(kl)}

    def step(self, t: TrainerTensors, batch: TrainerBatch) -> dict[str, float]:
        self.model.train()
        for epoch in range(self.epochs):
            self.opt.zero_grad()
            loss, epoch_stats = self.loss(t)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.opt.step()
            # the first pass is on-policy (its loss is the batch's); later ones show how far the epochs moved
            stats = epoch_stats if epoch == 0 else {**stats, "clip_frac": epoch_stats["clip_frac"],
                                                    "approx_kl": epoch_stats["approx_kl"]}
        self.model.eval()
        stats["reward_mean"] = batch.reward.mean
        return stats

    def publish(self, *, run_id: str, producer: str = "trainer") -> PolicyRevision:
        from policy.checkpoint import save_checkpoint

        nxt = self.revision + 1
        ref = save_checkpoint(self.model, self.dir, self.family, nxt)
        rev = PolicyRevision(run_id=run_id, producer=producer, family=self.family, revision=nxt, checkpoint=ref,
                             parent_revision=self.revision)
        self.revision = nxt
        return rev


def initial_revision(family: str, checkpoint_dir: str | Path, *, seed: int = 0, run_id: str = "run") -> PolicyRevision:
    """Revision 0 from a seeded init, written to disk with its digest."""
    from policy.checkpoint import save_checkpoint
    from policy.model import PolicyModel

    ref = save_checkpoint(PolicyModel.from_seed(seed), checkpoint_dir, family, 0)
    return PolicyRevision(run_id=run_id, producer="trainer", family=family, revision=0, checkpoint=ref)


class TrainerTask:
    """One partition of trainer-batches (the topic has one): train, publish the next revision.

    ``min_records``: take one optimizer step (one revision) per at least this many records, accumulating
    smaller batches (the batcher's batches are partition-local, so several make one plan ``batch_size``;
    the arena paces admission by that size). Waiting batches are buffered input (changelog snapshot).
    """

    def __init__(self, partition: int, family: str, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 epochs: int = 1, train_step: TrainStep | None = None, producer: str = "trainer",
                 min_records: int = 1) -> None:
        self.min_records = min_records
        self.pending: list[tuple[Any, TrainerBatch]] = []
        self.family = family
        self.dir = Path(checkpoint_dir)
        self.lr = lr
        self.epochs = epochs
        self.user_step = train_step
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
        from consumers.services import decode

        self.pending.append((rec, decode(rec, TrainerBatch)))

    def tick(self, now: float) -> list:
        return []

    def _ensure(self, batch: TrainerBatch) -> ReferenceTrainer:
        if self.trainer is None:
            from policy.checkpoint import load_checkpoint

            if self.current:
                model = load_checkpoint(CheckpointRef(**self.current["checkpoint"]))
                rev = int(self.current["revision"])
            else:  # first batch ever: start from the weights the batch targets
                ck = batch.target
                from policy.checkpoint import checkpoint_filename

                ref = CheckpointRef(uri=(self.dir / checkpoint_filename(ck.family, ck.revision)).resolve().as_uri(),
                                    digest=ck.checkpoint_digest or "0" * 64)
                model = load_checkpoint(ref)
                rev = ck.revision
            self.trainer = ReferenceTrainer(model, self.family, rev, self.dir, lr=self.lr, epochs=self.epochs)
        return self.trainer

    async def process(self, rec: Any) -> list:
        from consumers.services import dead_letter, decode
        from schemas.errors import EventDecodeError
        from streams import topics
        from streams.transactions import Out

        try:
            batch = decode(rec, TrainerBatch)
        except EventDecodeError as e:
            return [dead_letter(rec, "trainer", type(e).__name__, str(e))]
        if batch.family != self.family:
            return [dead_letter(rec, "trainer", "CrossFamilyMixError",
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
        tensors = to_tensors(merged)
        stats = (self.user_step or trainer.step)(tensors, merged)
        rev = trainer.publish(run_id=batch.run_id, producer=self.producer)
        stats.update(revision=rev.revision, batch_target=batch.target.revision, records=len(merged.records),
                     batches=len(batches))
        self.history.append(stats)
        log.info("trained", extra={"fields": {"service": "trainer", **stats}})
        self.current = {"revision": rev.revision, "checkpoint": rev.checkpoint.model_dump(mode="json")}
        return [Out(topics.POLICY_REVISIONS.name, rev)]


async def latest_revision(client_kwargs: dict[str, Any], family: str, *, idle_polls: int = 2) -> PolicyRevision | None:
    """The newest committed PolicyRevision of ``family`` on the log (None if it has none)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from consumers.services import decode
    from schemas.errors import EventDecodeError
    from streams import topics

    c = AIOKafkaConsumer(**client_kwargs, group_id=None, enable_auto_commit=False,
                         isolation_level="read_committed", auto_offset_reset="earliest")
    await c.start()
    latest: PolicyRevision | None = None
    try:
        tps = [TopicPartition(topics.POLICY_REVISIONS.name, p) for p in range(topics.POLICY_REVISIONS.partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        end = await c.end_offsets(tps)
        idle = 0

        async def behind() -> bool:
            return any([await c.position(tp) < end[tp] for tp in tps])

        # a trailing transaction marker can keep the position just short of the end: stop when idle too
        while idle < idle_polls and await behind():
            got = await c.getmany(timeout_ms=500)
            idle = 0 if got else idle + 1
            for rec in (r for recs in got.values() for r in recs):
                try:
                    rev = decode(rec, PolicyRevision)
                except EventDecodeError:
                    continue
                if rev.family == family and (latest is None or rev.revision > latest.revision):
                    latest = rev
    finally:
        await c.stop()
    return latest


async def bootstrap_revision(client_kwargs: dict[str, Any], family: str, checkpoint_dir: str | Path, *,
                             seed: int = 0, run_id: str = "run") -> PolicyRevision | None:
    """Publish revision 0 (seeded init, written to ``checkpoint_dir``) when the log has no revision of ``family``.

    A fresh deployment needs a first revision: the arena serves it and the batcher targets it. Two trainers
    starting at once may both publish it; the seeded init makes both copies identical (same checkpoint
    digest), and every reader keeps the highest revision number, so a duplicate revision 0 is harmless.
    Returns the revision published, or None when the log already had one.
    """
    from aiokafka import AIOKafkaProducer

    from streams import serde, topics

    if await latest_revision(client_kwargs, family) is not None:
        return None
    rev0 = initial_revision(family, checkpoint_dir, seed=seed, run_id=run_id)
    producer = AIOKafkaProducer(**client_kwargs, enable_idempotence=True)
    await producer.start()
    try:
        key, value, headers = serde.to_message(rev0)
        await producer.send_and_wait(topics.POLICY_REVISIONS.name, value, key=key, headers=headers)
    finally:
        await producer.stop()
    log.info("published revision 0", extra={"fields": {"service": "trainer", "family": family,
                                                       "digest": rev0.checkpoint.digest}})
    return rev0


async def serve_trainer(cfg: Any, client_kwargs: dict[str, Any], stop: Any = None) -> None:
    from streams import topics
    from streams.transactions import TransactionalProcessor

    ckdir = cfg.checkpoint_dir or ".state/checkpoints"
    await bootstrap_revision(client_kwargs, cfg.family, ckdir)
    proc = TransactionalProcessor(
        "trainer", [topics.TRAINER_BATCHES.name], topics.TRAINER_BATCHES.partitions,
        lambda p: TrainerTask(p, cfg.family, ckdir, lr=cfg.lr, epochs=cfg.epochs, producer=f"trainer{cfg.instance}"),
        client_kwargs,
        instance=cfg.instance)
    if stop is not None:
        proc.stopping = stop
    else:
        proc.install_signal_handlers()
    log.info("service started", extra={"fields": {"service": "trainer", "instance": cfg.instance,
                                                  "group": proc.group_id}})
    await proc.run()
