"""The reference trainer: one optimizer step of a TrainerBatch, its checkpoint and its next PolicyRevision.

* ``ReferenceTrainer``: one optimizer step of the plan's objective (``consumers.trainer.objectives``: prime-rl's DPPO+KL,
  ipo or a custom loss, TRL's GRPO family, ...) on the policy the checkpoint holds:
  the tiny byte-level GRU (``policy/``, ``.pt``) or a Hugging Face causal LM (``policy.hf``, a
  ``model.safetensors`` folder, trained with bf16 autocast on a GPU or a CPU with native bf16 and served in bf16,
  float32 elsewhere: ``policy.hf.served_dtype``); after each step it writes a checkpoint
  of the same kind (with its SHA-256) and returns the next ``PolicyRevision``, whose ``metrics`` carry the
  step's figures and the trainer-inference logprob mismatch: |logprob the trainer computes - logprob the
  inference server reported| over the batch tokens, each under the revision that generated it (the current
  weights, or an earlier revision's served checkpoint read from its file: the same weights on both sides, so
  what remains is the engines' numerical difference). Memory is bounded by a token budget per forward/backward
  and log-probabilities at the trained positions only; the training state is written every few revisions.
* The batch as tensors is ``consumers.trainer.tensors``, the model kinds ``consumers.trainer.models``, the training
  states on disk ``consumers.trainer.state``, a torchrun group ``consumers.trainer.distributed``. The service
  around it (the transaction, the state committed with each revision, the take-over that trains the committed
  batches again from the log) is ``consumers.trainer.task``, the one module of the room that knows Kafka.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.settings import MICRO_BATCH_TOKENS
from consumers.trainer.distributed import (Group, device, full_state, load_full_state, load_full_weights,
                                           load_sharded, local_state, save_sharded, shard)
from consumers.trainer.models import HFPolicy, TinyPolicy, policy_kind
from consumers.trainer.objectives import LossInputs, Objective
from consumers.trainer.state import (LEGACY_TRAINING_STATE_SUFFIX, STATE_WRITER, TRAINING_STATE_SUFFIX,
                                     revision_files, state_write_path)
from consumers.trainer.tensors import TrainerTensors, take_rows
from policy import optimizers
from policy.lora import (adapter_state, base_of, has_adapters, inject, load_served, merged_model, served_state,
                         served_tensors)
from schemas.events import TrainerBatch
from schemas.objectives import DefaultLoss
from schemas.plan import OptimizerSpec
from schemas.policy import CheckpointRef, PolicyRevision

log = logging.getLogger("rollout.trainer")


def _release_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's ``malloc_trim``). A step frees gigabytes of
    activations in blocks of a few megabytes, below glibc's mmap threshold: without this they stay resident and
    the next phase's peak (the mismatch probe, the checkpoint) stacks on them. Once a step, after its optimizer
    step, not after each micro-batch: the next micro-batch reuses the freed pages, and trimming them made it fault
    them in again (the demo's step 8.8 -> 8.2 s, the two-seat shape's 80.6 -> 76.0 s; peak +130 MB and +180 MB,
    the two-seat's 2.50x its weights, gradients and AdamW; benchmarks/RESULTS.md). Under tcmalloc
    (``consumers.trainer.allocator``) there is little here to trim: tcmalloc keeps freed pages and hands them to the
    next phase and step, which is what it is there for (its peak was 160-190 MB above glibc's on the demo's step)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextmanager
def _holding(model: Any, tensors: dict[str, torch.Tensor]) -> Iterator[Any]:
    """``model`` in eval mode holding ``tensors`` (by state name; cast to each parameter's dtype, so no copy where it
    is already that) in place of its own for the block, its own put back after. The mismatch probe runs an earlier
    revision this way instead of on a deep copy loaded with it: that copy was the model's size again on the step's
    peak and, with the load, 0.3 s of a 5.5 s demo step on a 2-core AVX2 machine (benchmarks/RESULTS.md)."""
    held = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by identity: a tied weight is swapped once, for all
    training = model.training
    try:
        with torch.no_grad():
            for name, value in tensors.items():
                if name not in held:
                    continue
                p = held[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: the checkpoint's {tuple(value.shape)} does not fit the model's "
                                     f"{tuple(p.shape)}")
                own.setdefault(id(p), (p, p.data))
                p.data = value.to(device=p.device, dtype=p.dtype)
        yield model.eval()
    finally:
        for p, data in own.values():
            p.data = data
        model.train(training)


def _metric_tokens(t: TrainerTensors) -> tuple[float, float]:
    """The tokens a micro-batch's metrics are means over: the loss mask's, and cross-entropy's (echo's ``ce/``)."""
    return (float((t.loss_mask[:, 1:] > 0).sum()),
            0.0 if t.ce_weights is None else float((t.ce_weights[:, 1:] != 0).sum()))


def group_refusal(lora: Any, optimizer: Any) -> str | None:
    """Why a torchrun group cannot train with these settings (None: it can); ``rollout serve trainer`` asks at its
    start, before a batch is read (refused at the first batch, a group restarts into a poison dead letter)."""
    if lora is not None:
        return "LoRA training runs on one trainer process, not a torchrun group: start the trainer without torchrun"
    if optimizer is not None and optimizer.type == "muon":
        return ("the muon optimizer orthogonalizes whole matrices, and a torchrun group's ranks hold shards of them: "
                "train it on one process (start the trainer without torchrun)")
    return None


class ReferenceTrainer:
    """The plan's objective (``consumers.trainer.objectives``), normalised over the whole batch, on the checkpoint's model.

    Every revision's served weights are written (``publish``); its training state (float32 weights and the
    optimizer's moments, 4x the served bytes of an HF model) only every ``state_every`` revisions, and, training
    alone, in the background: the next batch's forward and backward passes only read the weights, so the write
    overlaps them and is awaited before the optimizer step changes what it reads (1.7 GB took 2.5-5 s on this
    VM's disk, in the path of every 8th revision). Only a state on the disk is named by a commit
    (``last_state``). A take-over between two states loads the last one and trains the batches committed after it
    again (``advance`` after each), then ``settle`` checks it reached the committed revision's served weights
    (``consumers.trainer.task``)."""

    def __init__(self, model: Any, family: str, revision: int, checkpoint_dir: str | Path, *, lr: float = 1e-3,
                 objective: Any = None, epochs: int = 1,
                 kind: type[TinyPolicy] | type[HFPolicy] = TinyPolicy, ref: CheckpointRef | None = None,
                 keep_checkpoints: int = 0, weight_decay: float = 0.0, served_model: str | None = None,
                 state_every: int = 1, micro_batch_tokens: int = MICRO_BATCH_TOKENS, mismatch_rows: int = 8,
                 group: Group | None = None, device: str | torch.device = "cpu",
                 last_revision: int | None = None, lora: Any = None, optimizer: OptimizerSpec | None = None) -> None:
        """``ref``: the checkpoint ``model`` was loaded from (the mismatch of that revision's tokens is measured on
        its file). ``keep_checkpoints``: keep only the newest N checkpoints this trainer wrote (0: all; never fewer
        than 2, the one before the current is what a pipelined batch came from). ``state_every``: write the
        training state every N revisions. ``micro_batch_tokens``: the token budget of one forward/backward.
        ``mismatch_rows``: at most this many rows of earlier revisions are run again under their own weights for
        the mismatch figure (the current revision's rows cost nothing: they are the training pass).
        ``last_revision``: the run's last (its max_steps): no training state is written there, since nothing trains
        after it (a take-over at the end trains the batches since the state before again, from the log).
        ``lora`` (``schemas.plan.LoraSpec``): adapters injected into the HF model (``policy.lora``; kept from an
        adapter checkpoint); only they train and have optimizer moments, and every revision is served as the spec
        says: its adapter alone, naming the base checkpoint (``ref``'s, or the one ``ref``'s adapter names), or merged.
        An adapter checkpoint trained without ``lora`` is merged into a plain model. ``optimizer``: its type and
        settings (``policy.optimizers``; default AdamW, gradients clipped at norm 1). ``objective``: what the step
        optimizes (``schemas.objectives``; default prime-rl's DPPO+KL); a derived batch's history rule overrides it."""
        self.base: CheckpointRef | None = None  # the base checkpoint each published adapter names (None: whole weights)
        if group is not None and (why := group_refusal(lora, optimizer)):
            raise ValueError(why)
        if lora is not None:
            if kind is not HFPolicy:
                raise ValueError("LoRA training needs the HF model (not the tiny model)")
            inject(model, lora)
            if lora.serving == "adapter":
                if ref is None:
                    raise ValueError("a LoRA trainer publishing adapters names their base: give the checkpoint the "
                                     "model was loaded from (ref)")
                self.base = base_of(ref) if ref.adapter else ref
        elif has_adapters(model):
            model = merged_model(model)
        # the model trained is on ``device``, and in a data-parallel group (``consumers.trainer.distributed``) it is FSDP2's
        # shard of it; rank 0 (or the only process) keeps the whole model on the CPU as well: what it writes as
        # checkpoints (the same object when training alone on the CPU)
        self.group = group
        self.device = torch.device(device)
        alone_on_cpu = group is None and self.device.type == "cpu"
        self.whole = model if group is None or group.leader else None
        self.model = model if alone_on_cpu else copy.deepcopy(model).to(self.device) if self.whole is not None \
            else model.to(self.device)
        if group is not None:
            shard(self.model)
        self.served_model = served_model  # stamped on every revision this trainer publishes
        self.family = family
        self.revision = revision
        self.dir = Path(checkpoint_dir)
        self.objective = self.trained_with = Objective(objective if objective is not None else DefaultLoss())
        self.optimizer = optimizer or OptimizerSpec()
        self.lr = lr
        self.epochs = epochs  # optimizer passes over each batch (PPO epochs; the objective bounds how far they go)
        self.kind = kind
        self.keep_checkpoints = keep_checkpoints
        self.state_every = max(1, state_every)
        self.lora = lora
        self.last_revision = last_revision
        self.micro_batch_tokens = micro_batch_tokens
        self.mismatch_rows = mismatch_rows
        self.written: dict[int, CheckpointRef] = {}  # checkpoints this trainer wrote, by revision
        self.states: dict[int, CheckpointRef] = {}  # training states on the disk, by revision and checkpoint
        self._writing: tuple[int, CheckpointRef, Future] | None = None  # the one being written in the background
        self.refs: dict[int, CheckpointRef] = {revision: ref} if ref is not None else {}  # probed for the mismatch
        self.opt = optimizers.build(self.optimizer, self.model.named_parameters(), lr=lr, weight_decay=weight_decay)

    def loss(self, t: TrainerTensors, objective: Objective, scale: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             before: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The objective on these rows (ref_kl on the rows with reference logprobs), each component divided by the
        whole batch's ``scale`` of it (``Objective.scales``); its metrics and the logprobs (of token t+1 at t).
        ``before``: these rows' logprobs on the step's first pass (later epochs' ratio)."""
        new_lp = self.kind.logprobs(self.model, t, self.micro_batch_tokens)
        out = objective.component_loss(LossInputs(
            trainer_logprobs=new_lp, inference_logprobs=t.old_logprobs[:, 1:],
            ref_logprobs=None if t.ref_logprobs is None else t.ref_logprobs[:, 1:],
            advantages=t.advantages[:, 1:], loss_mask=t.loss_mask[:, 1:] > 0, old_logprobs=before),
            t.reference_rows, scale, None if t.ce_weights is None else t.ce_weights[:, 1:])
        return out.loss, out.metrics, new_lp.detach()

    def _recompute_layers(self, on: bool) -> None:
        """Gradient checkpointing of a transformers model's layers, for rows longer than the token budget."""
        if hasattr(self.model, "gradient_checkpointing_enable"):
            if on and not self.model.is_gradient_checkpointing:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            elif not on and self.model.is_gradient_checkpointing:
                self.model.gradient_checkpointing_disable()

    def _epoch(self, t: TrainerTensors, objective: Objective, before: torch.Tensor | None
               ) -> tuple[dict[str, float], torch.Tensor]:
        """One optimizer step over the batch: micro-batches of ``micro_batch_tokens`` (rows x their padded width; a
        group's rows, whose prompt runs once, count as the one packed row they run as: ``kind.micro_batches``)
        accumulate into it. In a group each rank takes its share of the rows; every rank runs the same number of
        micro-batches (one past its share runs with no weight) so that FSDP2's collectives line up, and its
        gradients are reduced on the last one only. The objective's metrics are token-weighted means over the
        batch; ``loss`` is the batch's."""
        g = self.group
        self.opt.zero_grad()
        n, width = t.input_ids.shape
        if g:
            mine, share = g.rows(n), -(-n // g.world)
            size = max(1, min(share, self.micro_batch_tokens // max(width, 1)))
            parts = [list(range(lo, min(mine.stop, lo + size))) for lo in
                     range(mine.start, mine.start + max(1, -(-share // size)) * size, size)]
        else:  # alone: the policy's own (a group's rows together where their prompt runs once)
            planned = self.kind.micro_batches(self.model, t, self.micro_batch_tokens)
            parts, width = [rows for rows, _ in planned], max(w for _, w in planned)
        self._recompute_layers(width > self.micro_batch_tokens)
        batch_scale = objective.scales(t.loss_mask[:, 1:] > 0, t.reference_rows,  # the whole batch's, on every rank
                                       None if t.ce_weights is None else t.ce_weights[:, 1:])
        world = g.world if g else 1  # FSDP2 averages the ranks' gradients; the batch's gradient is their sum
        names = ["loss"]
        totals = torch.zeros(1, dtype=torch.float64, device=self.device)
        new_lp = torch.zeros_like(t.old_logprobs[:, 1:])
        for k, rows in enumerate(parts):
            if g:
                self.model.set_requires_gradient_sync(k == len(parts) - 1)
            index = torch.tensor(rows or [0])
            part = take_rows(t, index)
            width = part.input_ids.shape[1] - 1
            loss, metrics, lp = self.loss(part, objective, batch_scale,
                                          None if before is None else before[index, :width])
            (loss * (world if rows else 0.0)).backward()
            for name in sorted(metrics.keys() - set(names)):  # the same on every rank: each runs a micro-batch
                names.append(name)
                totals = torch.cat([totals, totals.new_zeros(1)])
            if rows:
                new_lp[rows, :width] = lp
                tokens = _metric_tokens(part)
                totals += torch.tensor([float(loss.detach())] + [float(metrics[n]) * tokens[n.startswith("ce/")]
                                                                 if n in metrics else 0.0 for n in names[1:]],
                                       dtype=torch.float64, device=self.device)
            del loss, metrics  # not trimmed here: the next micro-batch reuses these pages (``_release_freed_memory``)
        if g:
            g.all_sum(totals)
            g.all_sum(new_lp)
        tokens = tuple(max(n, 1.0) for n in _metric_tokens(t))
        if self.optimizer.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optimizer.max_norm)
        self._wait_for_state()  # it reads what the step changes
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # the gradients' memory is free for the mismatch probe and the write
        _release_freed_memory()
        values = totals.tolist()
        metrics = {n: v / tokens[n.startswith("ce/")] for n, v in zip(names[1:], values[1:])}
        return {"loss": values[0], **metrics}, new_lp

    def step(self, t: TrainerTensors, batch: TrainerBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        # a derived batch names its own rule
        objective = self.objective if batch.history is None else Objective(batch.history.objective())
        self.trained_with = objective  # named on the revision this step makes
        self.model.train()
        on_device = t.to(self.device)
        before = None
        for epoch in range(self.epochs):
            epoch_stats, new_lp = self._epoch(on_device, objective, before)
            if epoch == 0:  # the step's first pass: the weights that start it
                before = new_lp
                stats = {**epoch_stats, **(self.mismatch(t, batch, new_lp.cpu()) if self.whole is not None else {})}
            else:  # later passes show how far the epochs moved
                stats.update({f"last_epoch/{k}": v for k, v in epoch_stats.items()})
        self.model.eval()
        stats["reward_mean"] = float(np.mean([r.reward for r in batch.records]))
        stats["step_s"] = time.perf_counter() - t0
        stats["tokens"] = float(t.loss_mask.sum())
        return stats

    # -- the state a take-over resumes from, besides the served weights ---------------------------------------
    def training_state_path(self, ref: CheckpointRef, suffix: str = TRAINING_STATE_SUFFIX) -> Path:
        """Beside the checkpoint, named after it: the state that produced exactly those weights."""
        at = self.kind.location(ref)
        return at.with_name(at.name.removesuffix(".pt") + suffix)

    def _save_training_state(self, ref: CheckpointRef | None) -> None:
        """The float32 weights (an HF checkpoint serves bf16) and the optimizer's moments and step count at this
        revision, so a trainer that takes over from it trains exactly as this one would have, on this many ranks or
        another number. In a group each rank writes its own shards: nothing is gathered. Flushed to the disk
        before the commit that names it; removed only after a commit names a newer one (``prune``)."""
        self._wait_for_state()  # one at a time, in order
        where = (self.training_state_path(ref), state_write_path(self.dir, self.family, self.revision)) \
            if ref is not None else None
        if self.group is not None:  # the ranks' writes are one collective: written here, on every rank at once
            where = self.group.agree(where)
            save_sharded(local_state(self.model, self.opt), *where, writer=self.whole is not None)
            if self.whole is not None:
                self.states[self.revision] = ref
            return
        self._writing = (self.revision, ref, STATE_WRITER.submit(save_sharded, local_state(self.model, self.opt),
                                                                  *where, writer=True))

    def _wait_for_state(self) -> None:
        """The background write finished, before anything changes the weights or moments it reads. A write that
        failed (a full disk) is logged and not named by any commit: a take-over starts from the state before it and
        trains more batches again from the log; the next state is tried at its revision."""
        if self._writing is None:
            return
        rev, ref, done = self._writing
        self._writing = None
        try:
            done.result()
        except Exception as e:  # noqa: BLE001 - the log still holds every batch since the last state
            log.error("the training state of revision %d was not written (%s: %s): a take-over starts from the one "
                      "before it", rev, type(e).__name__, e)
            return
        self.states[rev] = ref

    def last_state(self) -> tuple[int, CheckpointRef] | None:
        """The newest training state on the disk (its revision and checkpoint), without waiting for one being
        written."""
        if self._writing is not None and self._writing[2].done():
            self._wait_for_state()
        newest = max(self.states, default=None)
        return None if newest is None else (newest, self.states[newest])

    def load_training_state(self, ref: CheckpointRef, revision: int | None = None) -> bool:
        """Resume the weights and optimizer saved with checkpoint ``ref`` (``_save_training_state``, or the single
        file written before states were sharded), as revision ``revision`` (default: the one held); False when
        there is none. Rank 0 looks, for the group."""
        self._wait_for_state()
        found = None
        if self.whole is not None:
            found = next((p for p in (self.training_state_path(ref),
                                      self.training_state_path(ref, LEGACY_TRAINING_STATE_SUFFIX)) if p.exists()), None)
        if self.group is not None:
            found = self.group.agree(found)
        if found is None:
            return False
        if found.name.endswith(TRAINING_STATE_SUFFIX):
            load_sharded(self.model, self.opt, found)
        else:
            blob = torch.load(found, map_location="cpu", weights_only=True) if self.whole is not None else None
            load_full_state(self.model, self.opt, blob, self.group)
        if revision is not None:
            self.revision = revision
        self.refs.setdefault(self.revision, ref)
        if self.base is not None and not ref.adapter:  # its base weights are not the checkpoint it was opened on
            log.warning("revision %d of this LoRA run was published merged: this trainer publishes merged revisions "
                        "too", self.revision)
            self.base = None
        return True

    def advance(self) -> None:
        """A committed batch trained again (a take-over between training states): its revision is reached, and
        nothing is written (its files are there already)."""
        self.revision += 1

    def settle(self, ref: CheckpointRef, revision: int) -> bool:
        """After a take-over's re-training, at ``revision``: whether the weights are the committed revision's (``ref``)
        as served.
        When they are not (training is not bit-reproducible across thread counts, devices or library versions),
        the served weights are taken, so the next revision is trained from exactly what the log committed, and
        only the optimizer's moments come from the re-training."""
        self._wait_for_state()
        self.revision = revision
        state = self._as_served(ref)
        same, served = None, None
        if self.whole is not None:
            served = self.kind.weights(ref)
            same = all(torch.equal(state[k].to(v.dtype), v) for k, v in served.items() if k in state)
        if self.group is not None:
            same = self.group.agree(same)
        if not same:
            if self.whole is not None:
                worst = max(float((state[k].float() - v.float()).abs().max()) for k, v in served.items() if k in state)
                log.warning("the re-trained weights differ from revision %d's served weights (max |diff| %.3g): "
                            "taking the served weights, the optimizer's moments from the re-training", self.revision,
                            worst)
            if self.lora is not None:  # the base takes them, the adapters restart
                load_served(self.model, served)
            else:
                load_full_weights(self.model, served if self.whole is not None else {}, self.group)
        self.refs[self.revision] = ref
        return bool(same)

    def _as_served(self, ref: CheckpointRef) -> dict[str, torch.Tensor]:
        """The weights held, as ``ref``'s checkpoint holds them: a LoRA adapter alone or merged (on the CPU, as the
        file is read), or the whole model."""
        if self.lora is None:
            return full_state(self.model, self.group)
        held = adapter_state(self.model) if ref.adapter else served_state(self.model)
        return {k: v.detach().cpu() for k, v in held.items()}

    def mismatch(self, t: TrainerTensors, batch: TrainerBatch, new_lp: torch.Tensor) -> dict[str, float]:
        """|trainer logprob - inference logprob| (mean, max) and the mismatch KL r - log r - 1 (r their ratio; prime-rl's
        figure) over the batch's trained tokens, each under the revision that generated it: the current revision's from the training pass, an earlier one's by a forward pass over at most
        ``mismatch_rows`` of its rows with its served checkpoint's weights (read from its file: no copies of past
        weights are kept). Rows of a revision whose checkpoint is not known or gone are not measured."""
        rev = torch.tensor([r.policy.revision if r.policy.family == self.family else -1 for r in batch.records])
        tokens = t.loss_mask[:, 1:] > 0
        diffs = []
        if bool((rev == self.revision).any()):
            rows = rev == self.revision
            diffs.append((new_lp[rows] - t.old_logprobs[rows, 1:])[tokens[rows]])
        budget = self.mismatch_rows
        for r in sorted(set(rev.tolist()) - {self.revision}, reverse=True):  # the newest first
            if budget <= 0 or r not in self.refs:
                continue
            try:
                weights = self.kind.weights(self.refs[r], verify=self.written.get(r) != self.refs[r])
            except FileNotFoundError:
                continue
            rows = (rev == r).nonzero().flatten()[:budget]
            budget -= len(rows)
            per_pass = max(1, self.micro_batch_tokens // t.input_ids.shape[1])  # the training pass's token budget
            with _holding(self.whole, served_tensors(self.whole, weights)) as probe:
                for chunk in rows.split(per_pass):
                    with torch.no_grad():
                        part = take_rows(t, chunk)
                        lp = self.kind.logprobs(probe, part, self.micro_batch_tokens)
                    diffs.append((lp - part.old_logprobs[:, 1:])[part.loss_mask[:, 1:] > 0])
            del weights
        _release_freed_memory()
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        if not d.numel():
            return {"mismatch_tokens": 0.0}
        return {"mismatch_mean": float(d.abs().mean()), "mismatch_max": float(d.abs().max()),
                "mismatch_kl": float((torch.exp(d) - d - 1).mean()), "mismatch_tokens": float(d.numel())}

    def publish(self, *, run_id: str, producer: str = "trainer", metrics: dict[str, float] | None = None,
                batch: TrainerBatch | None = None) -> PolicyRevision:
        """The next revision: its checkpoint written and flushed to the disk (and its training state, every
        ``state_every`` revisions: in the background when training alone, ``_save_training_state``), its parent and the batch it was trained on named. In a group every rank gathers the
        weights and rank 0 alone writes and returns the revision (the others: None). Nothing is removed here: the
        commit naming this revision may still fail (``prune`` runs after it)."""
        nxt = self.revision + 1
        state = full_state(self.model, self.group)
        ref = None
        if self.whole is not None:
            if self.whole is not self.model:
                self.whole.load_state_dict(state)
            ref = self.kind.save(self.whole, self.dir, self.family, nxt, base=self.base)
        del state
        parent, self.revision = self.revision, nxt
        probe = None
        if ref is not None and batch is not None and self.kind is HFPolicy:  # what a server that loaded it must
            from policy.hf import logprob_probe  # answer (VllmWeights)

            first = batch.records[0]
            probe = logprob_probe(self.whole, ref, [*first.prompt_token_ids, *first.completion_token_ids])
        # after the probe: the state's writer thread holds the GIL in long stretches (a torch.save a tensor), and a
        # probe beside it took 2.6-3.1 s instead of 0.3 (benchmarks/RESULTS.md)
        if nxt % self.state_every == 0 and nxt != self.last_revision:
            self._save_training_state(ref)
        if ref is None:
            return None
        self.written[nxt] = self.refs[nxt] = ref
        for old in sorted(self.refs)[:-3]:  # the mismatch probes revisions within the off-policy bound
            del self.refs[old]
        return PolicyRevision(run_id=run_id, producer=producer, family=self.family, revision=nxt, checkpoint=ref,
                              parent_revision=parent, batch_id=batch.batch_id if batch else None,
                              served_model=self.served_model,
                              batch_digest=batch.batch_digest if batch else None,
                              objective=self.trained_with.spec.model_dump(mode="json") if batch else None, probe=probe,
                              metrics={k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)})

    def prune(self, revision: int, base: int, *, fresh: bool = False) -> None:
        """After the commit that names ``revision`` and the training state at ``base`` (``fresh``: none yet, the run's
        first weights at ``base``): remove what no take-over can need any more, whoever wrote it (an earlier life of
        this trainer, before a restart, an aborted transaction or a rebalance, or a writer killed mid-write). Read
        from the disk, not from what this trainer wrote, so a take-over does not leave its predecessor's files for
        ever (1.6 GB a training state for SmolLM2). Removed: training states older than ``base``, unfinished
        state writes older than it, unfinished checkpoint writes up to ``revision``, and (``keep_checkpoints``)
        checkpoints older than the newest kept, never revision 0, the fresh base or a LoRA run's base. Nothing newer than the commit is touched (a state being written is
        named by a later one). Rank 0 alone looks: the folder is the group's. The folder is one run's: two runs of
        one family sharing a checkpoint folder would prune each other's files."""
        self.states = {r: ref for r, ref in self.states.items() if r >= base}
        if self.whole is None or not self.dir.is_dir():
            return
        keep_from = revision - max(2, self.keep_checkpoints) + 1 if self.keep_checkpoints else None
        lora_base = self.kind.location(self.base).resolve() if self.base is not None else None
        for n, kind, path in revision_files(self.dir, self.family):
            if kind == "state" and n < base or kind == "writing-state" and n < base or \
                    kind == "writing" and n <= revision or \
                    kind == "checkpoint" and keep_from is not None and 0 < n < keep_from and \
                    not (fresh and n == base) and path.resolve() != lora_base:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                self.written = {r: ref for r, ref in self.written.items()
                                if self.kind.location(ref).resolve() != path.resolve()}


def open_trainer(*, ref: CheckpointRef, revision: int, family: str, checkpoint_dir: str, group: Group | None = None,
                 **options: Any) -> ReferenceTrainer:
    """The reference trainer on checkpoint ``ref`` at ``revision``, sharded over ``group`` when there is one (every
    rank of a group opens its own: ``consumers.trainer.distributed.Lockstep``)."""
    kind = policy_kind(ref)
    return ReferenceTrainer(kind.load(ref), family, revision, checkpoint_dir, kind=kind, ref=ref, group=group,
                            device=device(), **options)


def initial_revision(family: str, checkpoint_dir: str | Path, *, seed: int = 0, run_id: str = "run",
                     served: Any = None) -> PolicyRevision:
    """Revision 0 of a family: the weights ``served`` names (``policy.served.ServedModel``: the family's own HF
    model, a local HF folder, or the packaged model standing in for it, and its note), else the packaged HF
    model for ``policy.hf.FAMILY`` and the tiny model's seeded init (written to ``checkpoint_dir``) for any other
    family; with its digest either way."""
    from policy.served import PACKAGED_NAMES, served_model

    if served is None and family in PACKAGED_NAMES:
        served = served_model(family)
    ref = served.checkpoint() if served is not None else None
    if ref is None:
        from policy.checkpoint import save_checkpoint
        from policy.model import PolicyModel

        ref = save_checkpoint(PolicyModel.from_seed(seed), checkpoint_dir, family, 0)
    return PolicyRevision(run_id=run_id, producer="trainer", family=family, revision=0, checkpoint=ref,
                          served_model=served.note if served is not None else None)
