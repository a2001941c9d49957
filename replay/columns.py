"""Decoded events -> pyarrow tables, column by column (no per-row inserts).

Token arrays become ListArrays from one concatenation of the events' numpy arrays (which are
zero-copy views into the Kafka message) plus an offsets vector: no Python lists of numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pyarrow as pa
from pydantic import TypeAdapter

from replay import tables as T
from schemas import codec
from schemas.digests import record_digest
from schemas.events import ChatMessage, ToolCall

_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOL_CALLS = TypeAdapter(list[ToolCall])


class Meta(NamedTuple):
    """Where a message sat on the log."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


def list_array(arrays: Sequence[np.ndarray], dtype: np.dtype) -> pa.ListArray:
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.dtype(dtype)
    if all(a.dtype == dtype for a in arrays):  # the frames' own views: one copy of their bytes, no per-array work
        values = np.frombuffer(b"".join(arrays), dtype=dtype)
    else:
        values = np.concatenate(arrays).astype(dtype, copy=False)
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)).cast(pa.list_(pa.from_numpy_dtype(dtype)))


def _str_lists(values: Sequence[Sequence[str]]) -> pa.Array:
    return pa.array(values, type=T.STR_LIST)


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode  # json.dumps' output, one encoder for all


def _json(values: Sequence[Any]) -> list[str]:
    return [_JSON(v) for v in values]


def _models_json(adapter: TypeAdapter, items: Sequence[Any]) -> str:
    """JSON of a list of models, or of their ``replay.frames`` structs (same field order, same bytes)."""
    if not items:
        return "[]"
    if isinstance(items[0], msgspec.Struct):
        return msgspec.json.encode(items).decode()
    return adapter.dump_json(items).decode()


def _same(items: Sequence[Any], names: str) -> dict[str, list]:
    """The columns that are the items' attributes of the same name (``names`` space-separated)."""
    return {name: list(map(attrgetter(name), items)) for name in names.split()}


def _envelope(events: Sequence[Any]) -> dict[str, Any]:
    return _same(events, "event_id run_id producer causation_id") | {
        "created_at": pa.array([e.created_at for e in events], type=T.TS),
        "schema_version": pa.array([e.schema_version for e in events], type=T.I32),
    }


def _kafka(metas: Sequence[Meta]) -> dict[str, Any]:
    return {
        "_topic": [m.topic for m in metas],
        "_partition": pa.array([m.partition for m in metas], type=T.I32),
        "_offset": pa.array([m.offset for m in metas], type=T.I64),
        "_ts": pa.array(np.fromiter((m.timestamp_ms for m in metas), dtype=np.int64, count=len(metas)), type=T.KAFKA_TS),
    }


def _policy(refs: Sequence[Any], prefix: str = "policy") -> dict[str, Any]:
    return {
        f"{prefix}_family": [p.family if p is not None else None for p in refs],
        f"{prefix}_revision": pa.array([p.revision if p is not None else None for p in refs], type=T.I64),
        f"{prefix}_checkpoint_digest": [p.checkpoint_digest if p is not None else None for p in refs],
    }


def _source(sources: Sequence[Any]) -> dict[str, Any]:
    return {
        "source_run_id": [s.run_id if s is not None else None for s in sources],
        "source_topic": [s.topic if s is not None else None for s in sources],
        "source_partition": pa.array([s.partition if s is not None else None for s in sources], type=T.I32),
        "source_offset": pa.array([s.offset if s is not None else None for s in sources], type=T.I64),
        "source_digest": [s.digest if s is not None else None for s in sources],
    }


def _table(table: T.Table, cols: dict[str, Any]) -> pa.Table:
    return pa.Table.from_pydict(cols, schema=table.schema)


def policy_revisions(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    cols = _envelope(events) | _same(events, "family revision parent_revision batch_id batch_digest") | {
        "checkpoint_uri": [e.checkpoint.uri if e.checkpoint else None for e in events],
        "checkpoint_digest": [e.checkpoint.digest if e.checkpoint else None for e in events],
        "metrics": [list(e.metrics.items()) for e in events],
        **{name: [e.metrics.get(name) for e in events] for name in T.REVISION_METRIC_COLUMNS},
        "objective_type": [e.objective.get("type") if e.objective else None for e in events],
        "objective": [json.dumps(e.objective, sort_keys=True) if e.objective else None for e in events],
        "probed": [e.probe is not None for e in events],
        **_policy([e.fork for e in events], "fork"), **_source([e.source for e in events]),
    } | _kafka(metas)
    return {"policy_revisions": _table(T.POLICY_REVISIONS, cols)}


def steps(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    prompt_ids = [e.prompt_token_ids for e in events]
    completion_ids = [e.completion_token_ids for e in events]
    cols = _envelope(events) | _same(events, "step_id rollout_id root_group_id member_id target trainable policy_exact "
                                             "finish_reason latency_s") | {
        "step_index": [e.index for e in events],
        **_policy([e.policy for e in events]),
        "prompt": [_models_json(_MESSAGES, e.prompt) for e in events],
        "completion": [_models_json(_MESSAGES, e.completion) for e in events],
        "tool_calls": [_models_json(_TOOL_CALLS, e.tool_calls) for e in events],
        "prompt_token_ids": list_array(prompt_ids, np.int32),
        "completion_token_ids": list_array(completion_ids, np.int32),
        "completion_logprobs": list_array([e.completion_logprobs for e in events], np.float32),
        "n_prompt_tokens": pa.array([a.shape[0] for a in prompt_ids], type=T.I32),
        "n_completion_tokens": pa.array([a.shape[0] for a in completion_ids], type=T.I32),
    } | _kafka(metas)
    return {"steps": _table(T.STEPS, cols)}


def rollouts(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    cols = _envelope(events) | _same(events, "rollout_id episode_type environment example_id parent_rollout_id "
                                             "group_id root_group_id group_size status failure_reason evaluation "
                                             "train_source") | {
        "seed": _json([e.seed for e in events]),
        "step_ids": _str_lists([e.step_ids for e in events]),
        "members": _json([e.members for e in events]),
        "trainable_members": _str_lists([sorted(m for m, t in e.members.items() if t) for e in events]),
        "artifacts": _json([e.artifacts for e in events]),
        "child_rollout_ids": _str_lists([e.child_rollout_ids for e in events]),
        **_policy([e.policy for e in events]),
    } | _kafka(metas)
    return {"rollouts": _table(T.ROLLOUTS, cols)}


def scores(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    cols = _envelope(events) | _same(events, "rollout_id group_id root_group_id group_size environment example_id "
                                             "parent_rollout_id status verifier verifier_version evaluation "
                                             "train_source") | {
        "rewards": [list(e.rewards.items()) for e in events],
        "metrics": [list(e.metrics.items()) for e in events],
        "trainable_step_ids": _str_lists([[s.step_id for s in e.trainable_steps] for e in events]),
        **_source([e.source for e in events]),
    } | _kafka(metas)
    rewards = [(e.event_id, e.rollout_id, m, r) for e in events for m, r in e.rewards.items()]
    long = dict(zip(("score_event_id", "rollout_id", "member_id", "reward"), map(list, zip(*rewards)))) if rewards else {
        f.name: [] for f in T.SCORE_REWARDS.schema}
    return {"scores": _table(T.SCORES, cols), "score_rewards": _table(T.SCORE_REWARDS, long)}


def reference_scores(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    lps = [[s.ref_logprobs for s in e.steps] for e in events]
    flat = [np.concatenate(x) if x else np.empty(0, np.float32) for x in lps]
    cols = _envelope(events) | {
        **{k: [getattr(e.scored, k) for e in events] for k in ("rollout_id", "group_id", "root_group_id",
                                                                 "train_source")},
        "score_event_id": [e.scored.event_id for e in events],
        "reference_model": [e.reference.model for e in events],
        "reference_base_url": [e.reference.base_url for e in events],
        "reference_revision": [e.reference.revision for e in events],
        "step_ids": _str_lists([[s.step_id for s in e.steps] for e in events]),
        "ref_logprobs": pa.array([[x.tolist() for x in steps] for steps in lps],
                                 type=pa.list_(pa.list_(pa.float32()))),
        "n_tokens": pa.array([len(f) for f in flat], type=T.I32),
        "ref_logprob_mean": [float(f.mean()) if len(f) else None for f in flat],
    } | _kafka(metas)
    return {"reference_scores": _table(T.REFERENCE_SCORES, cols)}


def training_records(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    completion_ids = [e.completion_token_ids for e in events]
    masks = [e.loss_mask for e in events]
    cols = _envelope(events) | _same(events, "record_id rollout_id member_id group_id environment reward advantage "
                                             "credit") | {
        "step_ids": _str_lists([e.step_ids for e in events]),
        **_policy([e.policy for e in events]),
        "prompt_token_ids": list_array([e.prompt_token_ids for e in events], np.int32),
        "completion_token_ids": list_array(completion_ids, np.int32),
        "completion_logprobs": list_array([e.completion_logprobs for e in events], np.float32),
        "loss_mask": list_array(masks, np.uint8),
        "n_completion_tokens": pa.array([a.shape[0] for a in completion_ids], type=T.I32),
        "n_trained_tokens": pa.array([int(np.count_nonzero(m)) for m in masks], type=T.I32),
        "record_digest": [record_digest(e) for e in events],
        **_source([e.source for e in events]),
        "ref_logprobs": pa.array([None if e.ref_logprobs is None else e.ref_logprobs.tolist() for e in events],
                                 type=pa.list_(pa.float32())),
        "ce_spans": [None if not e.ce_spans else json.dumps([[s.start, s.end, s.weight] for s in e.ce_spans])
                     for e in events],
        "n_ce_tokens": pa.array([sum(s.end - s.start for s in e.ce_spans or ()) for e in events], type=T.I32),
    } | _kafka(metas)
    return {"training_records": _table(T.TRAINING_RECORDS, cols)}


def trainer_batches(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    cols = _envelope(events) | _same(events, "batch_id family max_off_policy_steps completion_tokens batch_digest "
                                             "lineage_digest") | {
        "target_revision": [e.target.revision for e in events],
        "target_checkpoint_digest": [e.target.checkpoint_digest for e in events],
        "n_records": [len(e.records) for e in events],
        "reward_mean": [e.reward.mean for e in events],
        "reward_std": [e.reward.std for e in events],
        "reward_min": [e.reward.min for e in events],
        "reward_max": [e.reward.max for e in events],
        "advantage_mean": [e.advantage.mean for e in events],
        "advantage_std": [e.advantage.std for e in events],
        "proof_refs": _str_lists([e.proof_refs for e in events]),
        "history_source_run_id": [e.history.source_run_id if e.history else None for e in events],
        "history_fork_family": [e.history.fork.family if e.history else None for e in events],
        "history_fork_revision": pa.array([e.history.fork.revision if e.history else None for e in events],
                                          type=T.I64),
        "history_importance": [e.history.importance if e.history else None for e in events],
        "history_clip": [e.history.clip if e.history else None for e in events],
    } | _kafka(metas)
    recs = [(e, m, i, r) for e, m in zip(events, metas) for i, r in enumerate(e.records)]
    records = {
        "batch_id": [e.batch_id for e, _, _, _ in recs],
        "batch_offset": pa.array([m.offset for _, m, _, _ in recs], type=T.I64),
        "position": pa.array([i for _, _, i, _ in recs], type=T.I32),
        "record_id": [r.record_id for *_, r in recs],
        "record_digest": [record_digest(r) for *_, r in recs],
        "record_event_id": [r.event_id for *_, r in recs],
        "rollout_id": [r.rollout_id for *_, r in recs],
        "member_id": [r.member_id for *_, r in recs],
        **_policy([r.policy for *_, r in recs]),
        "reward": [r.reward for *_, r in recs],
        "advantage": [r.advantage for *_, r in recs],
        "n_completion_tokens": pa.array([r.completion_token_ids.shape[0] for *_, r in recs], type=T.I32),
    }
    srcs = [(e, m, s) for e, m in zip(events, metas) for s in e.source_revisions]
    sources = {
        "batch_id": [e.batch_id for e, _, _ in srcs],
        "batch_offset": pa.array([m.offset for _, m, _ in srcs], type=T.I64),
        **_policy([s.policy for *_, s in srcs]),
        "records": [s.records for *_, s in srcs],
    }
    return {"trainer_batches": _table(T.TRAINER_BATCHES, cols), "batch_records": _table(T.BATCH_RECORDS, records),
            "batch_sources": _table(T.BATCH_SOURCES, sources)}


_SUBJECT = ("record_id", "rollout_id", "step_id", "batch_id")


def _raw_subject(raw: bytes) -> tuple[str | None, str | None]:
    try:
        event = codec.decode(raw)
    except Exception:  # a dead letter's raw bytes are often exactly what failed to decode
        try:
            return codec.peek(raw)[0], None
        except Exception:
            return None, None
    for name in _SUBJECT:
        if hasattr(event, name):
            return event.EVENT_TYPE, getattr(event, name)
    return event.EVENT_TYPE, event.event_id


def dead_letters(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    subjects = [_raw_subject(e.raw) for e in events]
    cols = _envelope(events) | _same(events, "origin_topic origin_partition origin_offset origin_key raw error_type "
                                             "error_message service partial") | {
        "raw_event_type": [s[0] for s in subjects],
        "raw_subject_id": [s[1] for s in subjects],
    } | _kafka(metas)
    return {"dead_letters": _table(T.DEAD_LETTERS, cols)}


def admissions(events: Sequence[Any], metas: Sequence[Meta]) -> dict[str, pa.Table]:
    """Claims, done groups and releases in one table: the fields an event type lacks are NULL."""
    framing = {f.name for f in T.ENVELOPE + T.KAFKA}
    fields = [f.name for f in T.ADMISSIONS.schema if f.name not in framing]
    cols = _envelope(events) | {name: [getattr(e, name, None) for e in events] for name in fields} | {
        "event_type": [e.EVENT_TYPE for e in events]} | _kafka(metas)
    return {"admissions": _table(T.ADMISSIONS, cols)}


class BadMessage(NamedTuple):
    meta: Meta
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]
    error: str


def replay_errors(bad: Sequence[BadMessage]) -> dict[str, pa.Table]:
    cols = _same(bad, "key value error") | {
        "headers": [json.dumps({k: (v.decode(errors="replace") if v is not None else None) for k, v in b.headers})
                    for b in bad],
    } | _kafka([b.meta for b in bad])
    return {"replay_errors": _table(T.REPLAY_ERRORS, cols)}


BUILDERS = {
    "policy_revision": policy_revisions, "step": steps, "rollout": rollouts, "rollout_scored": scores,
    "rollout_referenced": reference_scores,
    "training_record": training_records, "trainer_batch": trainer_batches, "dead_letter": dead_letters,
    "admission_claim": admissions, "admission_done": admissions, "admission_renew": admissions,
    "admission_release": admissions, "admission_refund": admissions, "admission_rebase": admissions,
}
