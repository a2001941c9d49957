"""Deterministic TrainerBatch assembly with explicit refusals (pure: no Kafka, no clock)."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from schemas.digests import batch_digest, lineage_digest, record_digest
from schemas.errors import CrossFamilyMixError, EmptyBatchError, StaleRecordError
from schemas.events import Aggregates, RevisionCount, TrainerBatch, TrainingRecord
from schemas.history import HistoryRule, history_lag
from schemas.policy import PolicyRef, PolicyRevision


def staleness(record: TrainingRecord, target: PolicyRef | PolicyRevision, history: HistoryRule | None = None) -> int:
    """How many revisions the record's source is behind the target (negative: ahead of it); for a derived run's
    record of the source family, ``history_lag``."""
    return _lag(record.policy, target, history)


def _lag(generated: PolicyRef, target: PolicyRef | PolicyRevision, history: HistoryRule | None) -> int:
    if history is not None and generated.family != target.family:
        lag = history_lag(generated, target, history)
        if lag is not None:
            return lag
    return target.revision - generated.revision


def stale_reason(record: TrainingRecord, target: PolicyRef | PolicyRevision, max_off_policy_steps: int,
                 history: HistoryRule | None = None) -> str | None:
    """Why a record may not train ``target``, or None if it may."""
    why = why_stale(record.policy, target, max_off_policy_steps, history)
    return f"record {record.record_id} {why}" if why else None


def why_stale(generated: PolicyRef, target: PolicyRef | PolicyRevision, max_off_policy_steps: int,
              history: HistoryRule | None = None) -> str | None:
    """The off-policy rule for tokens ``generated`` by a revision, trained at ``target`` (the batcher's, the
    trainer's and the audit's): why not, or None."""
    derived = history is not None and generated.family != target.family
    if generated.family != target.family and not (derived and generated.family == history.fork.family):
        return f"is from family {generated.family!r}, target is {target.family!r}"
    lag = _lag(generated, target, history)
    if lag > max_off_policy_steps:
        via = f" through the fork {history.fork}" if derived else ""
        return (f"from r{generated.revision} is {lag} revisions behind target r{target.revision}{via} "
                f"(max_off_policy_steps={max_off_policy_steps})")
    if lag < 0:
        return f"from r{generated.revision} is ahead of target r{target.revision}"
    return None


def _aggregate(values: np.ndarray) -> Aggregates:
    return Aggregates(count=int(values.size), mean=float(values.mean()), std=float(values.std()),
                      min=float(values.min()), max=float(values.max()))


def assemble_batch(records: Sequence[TrainingRecord], target: PolicyRevision, max_off_policy_steps: int,
                   *, run_id: str, producer: str, causation_id: str | None = None,
                   history: HistoryRule | None = None) -> TrainerBatch:
    """Build the batch for ``target`` from already-admitted records.

    Refuses (raises) an empty batch, a target without checkpoint, a cross-family mix, any
    record outside the off-policy bound and a record offered twice. Records are ordered by
    ``record_id`` and the batch id derives from the digest, so the same records always give
    the same batch, whatever order they arrived in. ``history``: a derived run's batch, whose records are of
    the fork's family and bounded by ``history_lag``.
    """
    if not records:
        raise EmptyBatchError(f"refusing an empty batch for {target.family}@r{target.revision}")
    target.require_checkpoint()
    families = {r.policy.family for r in records}
    if families != {target.family if history is None else history.fork.family}:
        raise CrossFamilyMixError(f"refusing to mix families {sorted(families | {target.family})} in one batch")
    for record in records:
        reason = stale_reason(record, target, max_off_policy_steps, history)
        if reason:
            raise StaleRecordError(reason)
    ordered = sorted(records, key=lambda r: r.record_id)
    ids = [r.record_id for r in ordered]
    if len(set(ids)) != len(ids):
        dupes = sorted(k for k, n in Counter(ids).items() if n > 1)
        raise ValueError(f"records offered twice to one batch: {dupes[:5]}")

    target_ref = target.ref()
    sources = _count_sources(ordered)
    b_digest = batch_digest(target.family, target_ref, (record_digest(r) for r in ordered))
    return TrainerBatch(
        run_id=run_id, producer=producer, causation_id=causation_id,
        batch_id=f"{target.family}-r{target.revision}-{b_digest[:16]}",
        family=target.family, target=target_ref, max_off_policy_steps=max_off_policy_steps,
        records=list(ordered),
        source_revisions=[RevisionCount(policy=p, records=n) for p, n in sources],
        reward=_aggregate(np.array([r.reward for r in ordered], dtype=np.float64)),
        advantage=_aggregate(np.array([r.advantage for r in ordered], dtype=np.float64)),
        completion_tokens=sum(len(r.completion_token_ids) for r in ordered),
        proof_refs=sorted({r.rollout_id for r in ordered}),
        batch_digest=b_digest,
        lineage_digest=lineage_digest(target.family, target_ref, sources),
        history=history,
    )


def _count_sources(records: Iterable[TrainingRecord]) -> list[tuple[PolicyRef, int]]:
    # PolicyRef holds no arrays but is unhashable by design (Record); key on its JSON form.
    counts: dict[str, list] = {}
    for r in records:
        key = r.policy.model_dump_json()
        counts.setdefault(key, [r.policy, 0])[1] += 1
    return sorted(((p, n) for p, n in counts.values()), key=lambda pn: pn[0].revision)


def verify_batch(batch: TrainerBatch) -> list[str]:
    """Recompute a batch's digests and counts; return what does not match (empty when intact)."""
    problems = []
    want = batch_digest(batch.family, batch.target, (record_digest(r) for r in batch.records))
    if want != batch.batch_digest:
        problems.append(f"batch {batch.batch_id}: batch digest {batch.batch_digest[:12]} != recomputed {want[:12]}")
    sources = _count_sources(batch.records)
    want_lineage = lineage_digest(batch.family, batch.target, sources)
    if want_lineage != batch.lineage_digest:
        problems.append(f"batch {batch.batch_id}: lineage digest {batch.lineage_digest[:12]} != recomputed {want_lineage[:12]}")
    return problems
