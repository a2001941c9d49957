"""A TrainerBatch as token-aligned torch tensors, and its cuts into micro-batches.

``to_tensors(batch, packed=False)``: row i is ``prompt + completion``; ``old_logprobs[i, t]`` is the behaviour
policy's log p(input_ids[i, t] | prefix) and ``loss_mask[i, t]`` is 1 exactly on the completion tokens the record
trains on; ``advantages[i, t]`` is the record's advantage broadcast over its tokens; ``ce_weights[i, t]`` the
cross-entropy weight of a prompt token (prime-rl's echo: ``TrainingRecord.ce_spans``), None where no record has
one. ``packed=True`` concatenates the rows into one [1, sum(T)] sequence with ``cu_seqlens`` (for varlen kernels)
instead of padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from schemas.events import TrainerBatch


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
    ref_logprobs: torch.Tensor | None = None  # [B, T] float: the reference's logprobs, 0 off them; None: no row has
    ref_rows: torch.Tensor | None = None  # [B] bool: the rows that carry them, trained with ref_kl (prime-rl's opd)
    ce_weights: torch.Tensor | None = None  # [B, T] float: prompt tokens trained with cross-entropy; None: no row has

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> TrainerTensors:
        return TrainerTensors(*(None if v is None else v.to(device) for v in (
            self.input_ids, self.attention_mask, self.loss_mask, self.advantages, self.old_logprobs,
            self.prompt_lens, self.seq_lens, self.cu_seqlens, self.ref_logprobs, self.ref_rows, self.ce_weights)))

    @property
    def wanted(self) -> torch.Tensor:
        """[B, T-1]: the positions whose next token's logprob a loss reads (the loss mask's, and cross-entropy's)."""
        wanted = self.loss_mask[:, 1:] > 0
        return wanted if self.ce_weights is None else wanted | (self.ce_weights[:, 1:] > 0)

    @property
    def reference_rows(self) -> torch.Tensor:
        """Which rows train with ref_kl (none without reference logprobs)."""
        return self.ref_rows if self.ref_rows is not None else torch.zeros(
            len(self.seq_lens), dtype=torch.bool, device=self.seq_lens.device)


def to_tensors(batch: TrainerBatch, *, pad_id: int = 0, packed: bool = False) -> TrainerTensors:
    rows = []
    for r in batch.records:
        p = np.asarray(r.prompt_token_ids, dtype=np.int64)
        c = np.asarray(r.completion_token_ids, dtype=np.int64)
        ids = np.concatenate([p, c])
        lp = np.concatenate([np.zeros(len(p), np.float32), np.asarray(r.completion_logprobs, np.float32)])
        mask = np.concatenate([np.zeros(len(p), np.float32), np.asarray(r.loss_mask, np.float32)])
        adv = np.where(mask > 0, np.float32(r.advantage), np.float32(0.0)).astype(np.float32)
        ref = np.concatenate([np.zeros(len(p), np.float32), np.asarray(
            r.ref_logprobs if r.ref_logprobs is not None else np.zeros(len(c)), np.float32)])
        ce = np.zeros(len(ids), np.float32)
        for span in r.ce_spans or ():
            ce[span.start:span.end] = span.weight
        rows.append((ids, lp, mask, adv, len(p), ref, ce))
    lens = [len(x[0]) for x in rows]
    has_ref = torch.tensor([r.ref_logprobs is not None for r in batch.records])
    refs = bool(has_ref.any())
    ces = any(r.ce_spans for r in batch.records)
    if packed:
        cat = lambda k, dt: torch.from_numpy(np.concatenate([x[k] for x in rows]).astype(dt)).unsqueeze(0)  # noqa: E731
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        ids = cat(0, np.int64)
        return TrainerTensors(ids, torch.ones_like(ids, dtype=torch.bool), cat(2, np.float32), cat(3, np.float32),
                              cat(1, np.float32), torch.tensor([x[4] for x in rows]), torch.tensor(lens), cu,
                              cat(5, np.float32) if refs else None, has_ref if refs else None,
                              cat(6, np.float32) if ces else None)
    B, T = len(rows), max(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.bool)
    lm, adv, olp, ref, cew = (torch.zeros((B, T), dtype=torch.float32) for _ in range(5))
    for i, (x, lp, m, a, _, rf, ce) in enumerate(rows):
        n = len(x)
        ids[i, :n] = torch.from_numpy(x)
        att[i, :n] = True
        lm[i, :n] = torch.from_numpy(m)
        adv[i, :n] = torch.from_numpy(a)
        olp[i, :n] = torch.from_numpy(lp)
        ref[i, :n] = torch.from_numpy(rf)
        cew[i, :n] = torch.from_numpy(ce)
    return TrainerTensors(ids, att, lm, adv, olp, torch.tensor([x[4] for x in rows]), torch.tensor(lens), None,
                          ref if refs else None, has_ref if refs else None, cew if ces else None)


TrainStep = Callable[[TrainerTensors, TrainerBatch], dict[str, float]]


def padded_micro_batches(t: TrainerTensors, budget: int) -> list[tuple[list[int], int]]:
    """Consecutive rows, as many as fit ``budget`` tokens at the batch's padded width (at least one); with that
    width."""
    n, width = t.input_ids.shape
    size = max(1, min(n, budget // max(width, 1)))
    return [(list(range(lo, min(n, lo + size))), width) for lo in range(0, n, size)]


def take_rows(t: TrainerTensors, rows: slice | torch.Tensor) -> TrainerTensors:
    """Those rows, cut to the longest of them (a micro-batch of short rows carries no padding of the long ones)."""
    width = int(t.seq_lens[rows].max()) if t.seq_lens[rows].numel() else t.input_ids.shape[1]
    return TrainerTensors(t.input_ids[rows, :width], t.attention_mask[rows, :width], t.loss_mask[rows, :width],
                          t.advantages[rows, :width], t.old_logprobs[rows, :width], t.prompt_lens[rows],
                          t.seq_lens[rows], None, None if t.ref_logprobs is None else t.ref_logprobs[rows, :width],
                          None if t.ref_rows is None else t.ref_rows[rows],
                          None if t.ce_weights is None else t.ce_weights[rows, :width])
