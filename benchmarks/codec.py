"""codec (issue 3): binary frame vs plain pydantic JSON, encode+decode, for a long Step and a TrainerBatch.

Workloads (one run measures both, on the same data):

* ``step``: one Step with 8,192 completion tokens (and a 256-token prompt);
* ``batch``: one TrainerBatch of 256 TrainingRecords of 512 completion tokens (64-token prompts).

Baseline: a plain pydantic mirror of the same models whose token ids, logprobs and masks are
``list[int]`` / ``list[float]`` fields, serialised with ``model_dump_json`` and parsed with
``model_validate_json`` (what "just use JSON" costs). The frame side is ``schemas.codec.encode``
and ``schemas.codec.decode`` (full pydantic validation of the header; arrays as zero-copy views).

Reports per workload: the median encode+decode time of each, completion tokens per second, the
speed-up, and wire bytes per completion token. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from typing import Any, Callable

import numpy as np
from pydantic import BaseModel

from schemas import codec
from schemas.batch import assemble_batch
from schemas.events import ChatMessage, Step, TrainerBatch, TrainingRecord
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision

FAMILY = "tiny-byte-lm"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


# -- the JSON baseline: the same data, arrays as number lists --------------------------------------

class PolicyRefJSON(BaseModel):
    family: str
    revision: int
    checkpoint_digest: str | None = None


class MessageJSON(BaseModel):
    role: str
    content: str | None = None


class EventJSON(BaseModel):
    """The envelope every event carries."""

    event_id: str
    event_type: str
    schema_version: int
    run_id: str
    producer: str
    created_at: datetime
    causation_id: str | None = None


class StepJSON(EventJSON):
    step_id: str
    rollout_id: str
    root_group_id: str
    index: int
    member_id: str
    target: str
    trainable: bool
    policy: PolicyRefJSON | None
    prompt: list[MessageJSON]
    completion: list[MessageJSON]
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    latency_s: float


class RecordJSON(EventJSON):
    record_id: str
    rollout_id: str
    step_ids: list[str]
    member_id: str
    group_id: str
    environment: str
    policy: PolicyRefJSON
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    loss_mask: list[int]
    reward: float
    advantage: float
    credit: str


class RevisionCountJSON(BaseModel):
    policy: PolicyRefJSON
    records: int


class AggregatesJSON(BaseModel):
    count: int
    mean: float
    std: float
    min: float
    max: float


class TrainerBatchJSON(EventJSON):
    batch_id: str
    family: str
    target: PolicyRefJSON
    max_off_policy_steps: int
    records: list[RecordJSON]
    source_revisions: list[RevisionCountJSON]
    reward: AggregatesJSON
    advantage: AggregatesJSON
    completion_tokens: int
    proof_refs: list[str]
    batch_digest: str
    lineage_digest: str


def _plain(value: Any) -> Any:
    """The event as plain Python data, arrays as lists (the baseline's native form)."""
    if isinstance(value, BaseModel):
        return {k: _plain(getattr(value, k)) for k in type(value).model_fields}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# -- the workloads ---------------------------------------------------------------------------------

def _digest(rev: int) -> str:
    return hashlib.sha256(f"{FAMILY}:{rev}".encode()).hexdigest()


def _ref(rev: int) -> PolicyRef:
    return PolicyRef(family=FAMILY, revision=rev, checkpoint_digest=_digest(rev))


def _tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, 151_936, n, dtype=np.int32)  # a real vocabulary's id range
    lps = np.log(rng.uniform(1e-6, 1.0, n)).astype(np.float32)  # finite: JSON has no NaN
    return ids, lps


def make_step(rng: np.random.Generator, n_completion: int = 8192, n_prompt: int = 256) -> Step:
    ids, lps = _tokens(rng, n_completion)
    return Step(event_id="ev-step", run_id="bench", producer="bench", created_at=T0, step_id="step-0",
                rollout_id="rollout-0", root_group_id="group-0", index=0, member_id="solver", target="learner",
                trainable=True, policy=_ref(3), prompt=[ChatMessage(role="user", content="Prove it." * 20)],
                completion=[ChatMessage(role="assistant", content="x" * 2000)],
                prompt_token_ids=rng.integers(0, 151_936, n_prompt, dtype=np.int32),
                completion_token_ids=ids, completion_logprobs=lps, finish_reason="length", latency_s=1.5)


def make_batch(rng: np.random.Generator, n_records: int = 256, n_completion: int = 512,
               n_prompt: int = 64) -> TrainerBatch:
    records = []
    for i in range(n_records):
        ids, lps = _tokens(rng, n_completion)
        records.append(TrainingRecord(
            event_id=f"ev-rec-{i}", run_id="bench", producer="bench", created_at=T0, record_id=f"rec-{i:05d}",
            rollout_id=f"rollout-{i // 8}", step_ids=[f"step-{i}"], member_id="solver", group_id=f"group-{i // 8}",
            environment="arithmetic@1", policy=_ref(3 + i % 2),
            prompt_token_ids=rng.integers(0, 151_936, n_prompt, dtype=np.int32), completion_token_ids=ids,
            completion_logprobs=lps, loss_mask=np.ones(n_completion, dtype=np.uint8),
            reward=float(i % 2), advantage=float(i % 2) - 0.5, credit="grpo"))
    target = PolicyRevision(run_id="bench", producer="bench", family=FAMILY, revision=4,
                            checkpoint=CheckpointRef(uri="file:///ckpt/r4.pt", digest=_digest(4)))
    return assemble_batch(records, target, 2, run_id="bench", producer="bench")


# -- timing ----------------------------------------------------------------------------------------

def _time(fn: Callable[[], Any], repeats: int, min_time: float) -> tuple[float, float]:
    """(min, median) seconds of ``fn`` over at least ``repeats`` runs and ``min_time`` seconds."""
    fn()  # warm up
    times = []
    deadline = time.perf_counter() + min_time
    while len(times) < repeats or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) >= repeats * 20:
            break
    return min(times), statistics.median(times)


def measure(name: str, event: Step | TrainerBatch, json_model: type[BaseModel], completion_tokens: int,
            repeats: int, min_time: float) -> dict[str, Any]:
    cls = type(event)
    frame = codec.encode(event)
    back = codec.decode(frame, expect=cls)
    assert back == event, "frame round trip is not exact"

    baseline = json_model.model_validate(_plain(event))
    text = baseline.model_dump_json().encode()
    assert json_model.model_validate_json(text) == baseline

    fe = _time(lambda: codec.encode(event), repeats, min_time)
    fd = _time(lambda: codec.decode(frame, expect=cls), repeats, min_time)
    je = _time(lambda: baseline.model_dump_json(), repeats, min_time)
    jd = _time(lambda: json_model.model_validate_json(text), repeats, min_time)
    t_frame, t_json = fe[1] + fd[1], je[1] + jd[1]  # medians
    return {
        "workload": name,
        "completion_tokens": completion_tokens,
        "frame_bytes": len(frame),
        "json_bytes": len(text),
        "frame_bytes_per_token": round(len(frame) / completion_tokens, 3),
        "json_bytes_per_token": round(len(text) / completion_tokens, 3),
        "frame_encode_us": round(fe[1] * 1e6, 1),
        "frame_decode_us": round(fd[1] * 1e6, 1),
        "json_encode_us": round(je[1] * 1e6, 1),
        "json_decode_us": round(jd[1] * 1e6, 1),
        "frame_tokens_per_s": round(completion_tokens / t_frame),
        "json_tokens_per_s": round(completion_tokens / t_json),
        "speedup": round(t_json / t_frame, 1),
        "_frame_min_s": fe[0] + fd[0],
        "_json_min_s": je[0] + jd[0],
    }


def split_costs(full: dict[str, Any], envelope: dict[str, Any], records: int) -> dict[str, Any]:
    """Separate a batch's cost into per-record envelope cost and per-token array cost.

    ``envelope`` is the same batch shape with 1-token records; the difference is what the token
    arrays cost (best-of timings, to keep noise out of a difference of two numbers).
    """
    extra_tokens = full["completion_tokens"] - envelope["completion_tokens"]
    frame_ns = max(full["_frame_min_s"] - envelope["_frame_min_s"], 0.0) / extra_tokens * 1e9
    json_ns = max(full["_json_min_s"] - envelope["_json_min_s"], 0.0) / extra_tokens * 1e9
    return {
        "frame_us_per_record_envelope": round(envelope["_frame_min_s"] / records * 1e6, 2),
        "json_us_per_record_envelope": round(envelope["_json_min_s"] / records * 1e6, 2),
        "frame_ns_per_token_arrays": round(frame_ns, 3),
        "json_ns_per_token_arrays": round(json_ns, 3),
        # a lower bound when the frame's array cost is below timing resolution (floored at 0.1 ns/token)
        "token_arrays_speedup": round(json_ns / max(frame_ns, 0.1), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks codec", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    parser.add_argument("--tokens", type=int, default=8192, help="completion tokens of the Step")
    parser.add_argument("--records", type=int, default=256, help="records in the TrainerBatch")
    parser.add_argument("--record-tokens", type=int, default=512, help="completion tokens per record")
    args = parser.parse_args(argv)
    repeats, min_time = (5, 0.3) if args.quick else (30, 2.0)

    rng = np.random.default_rng(3)
    step = make_step(rng, args.tokens)
    batch = make_batch(rng, args.records, args.record_tokens)
    thin = make_batch(rng, args.records, 1)  # same envelopes, 1-token arrays
    results = [
        measure("step", step, StepJSON, args.tokens, repeats, min_time),
        measure("batch", batch, TrainerBatchJSON, args.records * args.record_tokens, repeats, min_time),
    ]
    envelope = measure("batch_1tok", thin, TrainerBatchJSON, args.records, repeats, min_time)
    split = split_costs(results[1], envelope, args.records)

    print(f"codec benchmark ({'quick' if args.quick else 'full'}), {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; medians of encode+decode")
    print(f"{'workload':<8} {'tokens':>8} {'frame enc+dec':>14} {'json enc+dec':>14} {'speedup':>8} "
          f"{'frame B/tok':>11} {'json B/tok':>10}")
    for r in results:
        print(f"{r['workload']:<8} {r['completion_tokens']:>8} "
              f"{(r['frame_encode_us'] + r['frame_decode_us']) / 1e3:>11.3f} ms "
              f"{(r['json_encode_us'] + r['json_decode_us']) / 1e3:>11.3f} ms {r['speedup']:>7.1f}x "
              f"{r['frame_bytes_per_token']:>11.2f} {r['json_bytes_per_token']:>10.2f}")
    print(f"batch split: envelope {split['frame_us_per_record_envelope']} us/record (frame) vs "
          f"{split['json_us_per_record_envelope']} us/record (json); token arrays "
          f"{split['frame_ns_per_token_arrays']} ns/token (frame) vs {split['json_ns_per_token_arrays']} ns/token "
          f"(json): {split['token_arrays_speedup']}x")
    summary = {
        "benchmark": "codec",
        "quick": args.quick,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        **{f"{r['workload']}_{k}": v for r in results for k, v in r.items()
           if k != "workload" and not k.startswith("_")},
        **{f"batch_{k}": v for k, v in split.items()},
        "target_speedup": 20,
        "step_meets_target": results[0]["speedup"] >= 20,
        "batch_token_arrays_meet_target": split["token_arrays_speedup"] >= 20,
    }
    print(json.dumps(summary, sort_keys=True))
    return 0
