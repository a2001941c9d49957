"""Trainer bridge: TrainerBatches -> torch tensors -> a user's training step; and a reference trainer.

* ``to_tensors(batch, packed=False)``: token-aligned tensors. Row i is ``prompt + completion``;
  ``old_logprobs[i, t]`` is the behaviour policy's log p(input_ids[i, t] | prefix) and ``loss_mask[i, t]``
  is 1 exactly on the completion tokens the record trains on; ``advantages[i, t]`` is the record's
  advantage broadcast over its tokens. ``packed=True`` concatenates the rows into one [1, sum(T)]
  sequence with ``cu_seqlens`` (for varlen kernels) instead of padding.
* ``ReferenceTrainer``: a GRPO/PPO-style clipped policy-gradient step on the policy the checkpoint holds:
  the tiny byte-level GRU (``policy/``, ``.pt``) or a Hugging Face causal LM (``policy.hf``, a
  ``model.safetensors`` folder, trained with bf16 autocast on CPU); after each step it writes a checkpoint
  of the same kind (with its SHA-256) and returns the next ``PolicyRevision``, whose ``metrics`` carry the
  step's figures and the trainer-inference logprob mismatch: |logprob the trainer computes - logprob the
  inference server reported| over the batch tokens, each under the revision that generated it (the current
  weights, or a kept snapshot of the last few revisions: the same weights on both sides, so what remains is
  the engines' numerical difference).
* ``TrainerTask`` runs inside ``streams.transactions``: the revision event and the batch's offset commit
  in one transaction; the current revision (with its checkpoint digest) is the task's snapshot state, so
  a restarted trainer resumes from exactly the weights the log says it published.
"""

from __future__ import annotations

import asyncio
import logging
import time
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


class TinyPolicy:
    """The byte-level GRU of ``policy/``: ``.pt`` checkpoints."""

    micro_batch = 0  # whole batch at once: the model is small

    @staticmethod
    def load(ref: CheckpointRef | str | Path) -> Any:
        from policy.checkpoint import load_checkpoint

        return load_checkpoint(ref)

    @staticmethod
    def save(model: Any, directory: Path, family: str, revision: int) -> CheckpointRef:
        from policy.checkpoint import save_checkpoint

        return save_checkpoint(model, directory, family, revision)

    @staticmethod
    def logprobs(model: Any, t: TrainerTensors) -> torch.Tensor:
        logits, _ = model(t.input_ids[:, :-1])
        return torch.log_softmax(logits.float(), dim=-1).gather(2, t.input_ids[:, 1:].unsqueeze(2)).squeeze(2)


class HFPolicy:
    """A transformers causal LM (``policy.hf``): ``model.safetensors`` folders, bf16 autocast on CPU."""

    micro_batch = 8  # rows per forward/backward (gradients accumulate): bounds activation memory

    @staticmethod
    def load(ref: CheckpointRef | str | Path) -> Any:
        from policy.hf import load_model

        return load_model(ref)

    @staticmethod
    def save(model: Any, directory: Path, family: str, revision: int) -> CheckpointRef:
        from policy.hf import save_checkpoint

        return save_checkpoint(model, directory, family, revision)

    @staticmethod
    def logprobs(model: Any, t: TrainerTensors) -> torch.Tensor:
        from policy.hf import token_logprobs

        return token_logprobs(model, t.input_ids, t.attention_mask.long())


def policy_kind(ref: CheckpointRef | str | Path) -> type[TinyPolicy] | type[HFPolicy]:
    """What a checkpoint holds, from its file: ``.safetensors`` is an HF model, anything else the tiny GRU."""
    from policy.hf import is_hf_checkpoint

    return HFPolicy if is_hf_checkpoint(ref) else TinyPolicy


def _rows(t: TrainerTensors, rows: slice | torch.Tensor) -> TrainerTensors:
    return TrainerTensors(t.input_ids[rows], t.attention_mask[rows], t.loss_mask[rows], t.advantages[rows],
                          t.old_logprobs[rows], t.prompt_lens[rows], t.seq_lens[rows])


class ReferenceTrainer:
    """Clipped policy gradient (PPO/GRPO objective, token-mean over the loss mask) on the checkpoint's model."""

    def __init__(self, model: Any, family: str, revision: int, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 clip: float = 0.2, max_grad_norm: float = 1.0, epochs: int = 1,
                 kind: type[TinyPolicy] | type[HFPolicy] = TinyPolicy, keep_revisions: int = 3) -> None:
        self.model = model
        self.family = family
        self.revision = revision
        self.dir = Path(checkpoint_dir)
        self.clip = clip
        self.max_grad_norm = max_grad_norm
        self.lr = lr
        self.epochs = epochs  # optimizer passes over each batch (PPO epochs; the clip bounds how far they go)
        self.kind = kind
        # the weights of recent revisions (this one included), to measure the trainer-inference mismatch on
        # tokens an earlier revision generated: with pipelining, a batch rarely comes from the current weights
        self.keep_revisions = keep_revisions
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._probe: Any = None
        self._snapshot()
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if kind is HFPolicy \
            else torch.optim.Adam(model.parameters(), lr=lr)

    def loss(self, t: TrainerTensors, denom: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        new_lp = self.kind.logprobs(self.model, t)  # logp of token t+1
        mask = t.loss_mask[:, 1:]
        old_lp = t.old_logprobs[:, 1:]
        adv = t.advantages[:, 1:]
        ratio = torch.exp(new_lp - old_lp)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip) * adv
        per_tok = -torch.minimum(unclipped, clipped)
        denom = mask.sum().clamp(min=1.0) if denom is None else denom
        loss = (per_tok * mask).sum() / denom
        with torch.no_grad():
            frac = (((ratio - 1).abs() > self.clip).float() * mask).sum() / denom
            kl = ((old_lp - new_lp) * mask).sum() / denom
        return loss, {"loss": float(loss.detach()), "clip_frac": float(frac), "approx_kl": float(kl),
                      "new_lp": new_lp.detach()}

    def _epoch(self, t: TrainerTensors) -> tuple[dict[str, float], torch.Tensor]:
        """One optimizer step over the batch (micro-batches accumulate into it)."""
        self.opt.zero_grad()
        n = t.input_ids.shape[0]
        size = self.kind.micro_batch or n
        denom = t.loss_mask[:, 1:].sum().clamp(min=1.0)
        totals = {"loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
        new_lp = torch.zeros_like(t.old_logprobs[:, 1:])
        for i in range(0, n, size):
            part = _rows(t, slice(i, i + size))
            loss, st = self.loss(part, denom)
            loss.backward()
            new_lp[i:i + size, :part.input_ids.shape[1] - 1] = st.pop("new_lp")
            for k in totals:
                totals[k] += st[k]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        return totals, new_lp

    def step(self, t: TrainerTensors, batch: TrainerBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.model.train()
        for epoch in range(self.epochs):
            epoch_stats, new_lp = self._epoch(t)
            if epoch == 0:  # on-policy: the current weights, before any update
                stats = {**epoch_stats, **self.mismatch(t, batch, new_lp)}
            else:  # later passes show how far the epochs moved
                stats.update(clip_frac=epoch_stats["clip_frac"], approx_kl=epoch_stats["approx_kl"])
        self.model.eval()
        stats["reward_mean"] = float(np.mean([r.reward for r in batch.records]))
        stats["step_s"] = time.perf_counter() - t0
        stats["tokens"] = float(t.loss_mask.sum())
        return stats

    def _snapshot(self) -> None:
        self.snapshots[self.revision] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for old in sorted(self.snapshots)[:-self.keep_revisions]:
            del self.snapshots[old]

    def mismatch(self, t: TrainerTensors, batch: TrainerBatch, new_lp: torch.Tensor) -> dict[str, float]:
        """|trainer logprob - inference logprob| over the batch tokens, each recomputed under the revision that
        generated it (the current weights, or a kept snapshot); tokens of older revisions are not measured."""
        rev = torch.tensor([r.policy.revision if r.policy.family == self.family else -1 for r in batch.records])
        tokens = t.loss_mask[:, 1:] > 0
        diffs = []
        for r in sorted(set(rev.tolist()) & set(self.snapshots)):
            rows = rev == r
            if r == self.revision:
                lp = new_lp[rows]
            else:  # a forward pass with that revision's weights, on its rows only
                if self._probe is None:
                    import copy

                    self._probe = copy.deepcopy(self.model)
                self._probe.load_state_dict(self.snapshots[r])
                with torch.no_grad():
                    lp = self.kind.logprobs(self._probe.eval(), _rows(t, rows))
            diffs.append((lp - t.old_logprobs[rows, 1:]).abs()[tokens[rows]])
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        if not d.numel():
            return {"mismatch_tokens": 0.0}
        return {"mismatch_mean": float(d.mean()), "mismatch_max": float(d.max()), "mismatch_tokens": float(d.numel())}

    def publish(self, *, run_id: str, producer: str = "trainer",
                metrics: dict[str, float] | None = None) -> PolicyRevision:
        nxt = self.revision + 1
        ref = self.kind.save(self.model, self.dir, self.family, nxt)
        rev = PolicyRevision(run_id=run_id, producer=producer, family=self.family, revision=nxt, checkpoint=ref,
                             parent_revision=self.revision,
                             metrics={k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)})
        self.revision = nxt
        self._snapshot()
        return rev


def initial_revision(family: str, checkpoint_dir: str | Path, *, seed: int = 0, run_id: str = "run") -> PolicyRevision:
    """Revision 0 of a family: the packaged HF model as prepared (``policy.hf.FAMILY``), else the tiny model's
    seeded init written to ``checkpoint_dir``; with its digest either way."""
    from policy import hf

    if family == hf.FAMILY:
        ref = hf.prepare_model().checkpoint
    else:
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
        from consumers.services import decode

        self.pending.append((rec, decode(rec, TrainerBatch)))

    def tick(self, now: float) -> list:
        return []

    def _ensure(self, batch: TrainerBatch) -> ReferenceTrainer:
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
        # in a worker thread: a real model's step takes seconds, and the services' clients must keep running
        stats = await asyncio.to_thread(self.user_step or trainer.step, tensors, merged)
        rev = await asyncio.to_thread(trainer.publish, run_id=batch.run_id, producer=self.producer, metrics=stats)
        stats.update(revision=rev.revision, batch_target=batch.target.revision, records=len(merged.records),
                     batches=len(batches))
        self.history.append(stats)
        log.info("trained", extra={"fields": {"service": "trainer", **stats}})
        self.current = {"revision": rev.revision, "checkpoint": rev.checkpoint.model_dump(mode="json")}
        return [Out(topics.POLICY_REVISIONS.name, rev)]


async def latest_revision(client_kwargs: dict[str, Any], family: str, *, idle_polls: int = 2,
                          revision: int | None = None) -> PolicyRevision | None:
    """The newest committed PolicyRevision of ``family`` on the log, or the given ``revision`` of it (None if
    the log has none)."""
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
                if rev.family != family:
                    continue
                if revision is not None:
                    if rev.revision == revision and latest is None:
                        latest = rev
                elif latest is None or rev.revision > latest.revision:
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
    rev0 = await latest_revision(client_kwargs, cfg.family, revision=0)  # where a fresh trainer starts from
    start = (lambda target: rev0.checkpoint if target.revision == 0 else None) if rev0 and rev0.checkpoint else None
    proc = TransactionalProcessor(
        "trainer", [topics.TRAINER_BATCHES.name], topics.TRAINER_BATCHES.partitions,
        lambda p: TrainerTask(p, cfg.family, ckdir, lr=cfg.lr, epochs=cfg.epochs, producer=f"trainer{cfg.instance}",
                              target_checkpoint=start),
        client_kwargs,
        instance=cfg.instance)
    if stop is not None:
        proc.stopping = stop
    else:
        proc.install_signal_handlers()
    log.info("service started", extra={"fields": {"service": "trainer", "instance": cfg.instance,
                                                  "group": proc.group_id}})
    await proc.run()
