"""Canonical encoding and SHA-256 digests: what a replay recomputes to prove a batch is intact.

Canonical encoding of a value (version 1):

* JSON, keys sorted, separators ``,`` and ``:``, UTF-8, floats in Python's shortest
  round-trip repr;
* every numeric array replaced by ``{"dtype": "<i4", "n": len, "sha256": hex}`` of its
  little-endian bytes (so a float32 logprob must match bit for bit);
* datetimes as ISO 8601, bytes as base64;
* write metadata left out (``event_id``, ``created_at``, ``producer``, ``causation_id``): a
  record re-emitted after a crash has a new event id but the same content digest;
* an optional field added after v1 (``ADDED_OPTIONAL``) left out while at its default (None, or False for a flag).

Each digest hashes a domain tag (``rollout-log/<kind>/v1``), a newline, then the encoding.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from datetime import datetime
from typing import Any, Iterable

import numpy as np
from pydantic import BaseModel

from schemas.policy import PolicyRef

WRITE_METADATA = frozenset({"event_id", "created_at", "producer", "causation_id"})
# Optional fields added to an event after its digests were pinned: left out of the encoding while at their default,
# so an event that never had them (every one written before) keeps its digest.
ADDED_OPTIONAL = frozenset({"served_model", "source", "history", "fork", "derivation", "plan", "objective",
                            "probe", "ref_logprobs", "train_source", "partial",
                            "demonstration", "observation_roles", "ce_spans", "concurrency"})


_SCALARS = frozenset({str, int, float, bool, type(None)})


_ALWAYS = object()  # a value no field holds: the field is always encoded


@functools.cache
def _content_fields(cls: type[BaseModel]) -> tuple[tuple[str, Any], ...]:
    """Each content field with the value that leaves it out: if added after v1, its default (None where it has none);
    else a sentinel."""
    return tuple((k, _ALWAYS if k not in ADDED_OPTIONAL else None if f.is_required() else f.default)
                 for k, f in cls.model_fields.items() if k not in WRITE_METADATA)



def _plain(value: Any) -> Any:
    # most of a record is scalars: they return first (a batch digests every record: 20+ values each)
    if type(value) in _SCALARS:
        return value
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, unset in _content_fields(type(value)) if (v := getattr(value, k)) is not unset}
    if isinstance(value, np.ndarray):
        le = value.astype(value.dtype.newbyteorder("<"), copy=False)
        return {"dtype": le.dtype.str, "n": int(le.shape[0]), "sha256": hashlib.sha256(le.tobytes()).hexdigest()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value


def canonical_bytes(value: Any) -> bytes:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(kind: str, value: Any) -> str:
    return hashlib.sha256(f"rollout-log/{kind}/v1\n".encode() + canonical_bytes(value)).hexdigest()


def record_digest(record: BaseModel) -> str:
    return digest("record", record)


def batch_digest(family: str, target: PolicyRef, record_digests: Iterable[str]) -> str:
    """Independent of arrival order: the record digests are sorted before hashing."""
    return digest("batch", {"family": family, "target": target, "records": sorted(record_digests)})


def lineage_digest(family: str, target: PolicyRef, sources: Iterable[tuple[PolicyRef, int]]) -> str:
    """Covers the target revision and every source revision (with its record count)."""
    ordered = sorted(({"policy": p, "records": n} for p, n in sources), key=lambda s: s["policy"].revision)
    return digest("lineage", {"family": family, "target": target, "sources": ordered})
