"""Builders of valid events for the contract tests (fixed ids and timestamps where asked)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import numpy as np

from schemas.events import ChatMessage, Rollout, Step, TrainingRecord
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision

FAMILY = "tiny-byte-lm"
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
ENV = "arithmetic@1"


def ckpt_digest(revision: int, family: str = FAMILY) -> str:
    return hashlib.sha256(f"{family}:{revision}".encode()).hexdigest()


def ref(revision: int, family: str = FAMILY) -> PolicyRef:
    return PolicyRef(family=family, revision=revision, checkpoint_digest=ckpt_digest(revision, family))


def revision(rev: int, family: str = FAMILY, *, checkpoint: bool = True) -> PolicyRevision:
    return PolicyRevision(
        event_id=f"rev-{family}-{rev}", run_id="run-1", producer="trainer", created_at=T0,
        family=family, revision=rev, parent_revision=rev - 1 if rev else None,
        checkpoint=CheckpointRef(uri=f"file:///ckpt/{family}/r{rev}.pt", digest=ckpt_digest(rev, family))
        if checkpoint else None)


def step(n_tokens: int = 8, *, logprobs: np.ndarray | None = None, token_ids: np.ndarray | None = None,
         step_id: str = "step-1", trainable: bool = True, rev: int = 0) -> Step:
    ids = np.arange(n_tokens, dtype="<i4") if token_ids is None else token_ids
    lps = (-np.linspace(0.0, 3.0, len(ids), dtype="<f4")) if logprobs is None else logprobs
    return Step(
        event_id=f"ev-{step_id}", run_id="run-1", producer="arena-0", created_at=T0, causation_id=None,
        step_id=step_id, rollout_id="rollout-1", root_group_id="group-1", index=0, member_id="solver",
        target="learner", trainable=trainable, policy=ref(rev) if trainable else None,
        prompt=[ChatMessage(role="user", content="What is 2+3?")],
        completion=[ChatMessage(role="assistant", content="5")],
        prompt_token_ids=np.array([87, 104, 97, 116], dtype="<i4"), completion_token_ids=ids,
        completion_logprobs=lps, finish_reason="stop", latency_s=0.25)


def record(i: int = 0, *, rev: int = 0, family: str = FAMILY, n_tokens: int = 6,
           logprobs: np.ndarray | None = None, reward: float = 1.0, advantage: float = 0.5) -> TrainingRecord:
    ids = (np.arange(n_tokens, dtype="<i4") + i) % 256
    lps = (-np.linspace(0.1, 2.0, n_tokens, dtype="<f4") - np.float32(i) / 100) if logprobs is None else logprobs
    return TrainingRecord(
        event_id=f"ev-rec-{i}", run_id="run-1", producer="credit-0", created_at=T0,
        record_id=f"rec-{i:05d}", rollout_id=f"rollout-{i // 4}", step_ids=[f"step-{i}"], member_id="solver",
        group_id=f"group-{i // 4}", environment=ENV, policy=ref(rev, family),
        prompt_token_ids=np.array([1, 2, 3], dtype="<i4"), completion_token_ids=ids,
        completion_logprobs=lps, loss_mask=np.ones(len(ids), dtype="u1"),
        reward=reward, advantage=advantage, credit="grpo")


def rollout(**kw) -> Rollout:
    base = dict(event_id="ev-rollout-1", run_id="run-1", producer="arena-0", created_at=T0,
                rollout_id="rollout-1", episode_type="single_turn", environment=ENV, example_id="ex-1",
                seed={"question": "2+3"}, step_ids=["step-1"], members={"solver": True},
                group_id="group-1", root_group_id="group-1", group_size=4, policy=ref(0), status="completed")
    base.update(kw)
    return Rollout(**base)


# -- the checked-in event fixtures (tests/fixtures/events/<event_type>.v1.bin) ---------------------

FIXTURE_LOGPROBS = np.array([-0.5, -0.0, np.nan, -np.inf, -1e-30, -12.25], dtype="<f4")


def fixture_events() -> dict[str, "Event"]:
    """One event of each type with fixed ids, timestamps and contents: the frames were written
    once by ``tests/fixtures/events/make_fixtures.py`` and must keep decoding to these values."""
    from schemas.admission import (AdmissionClaim, AdmissionDone, AdmissionRebase, AdmissionRefund, AdmissionRelease,
                                   AdmissionRenew)
    from schemas.batch import assemble_batch
    from schemas.events import DeadLetter, RolloutReferenced, RolloutScored, StepReference, StepTokens
    from schemas.objectives import Reference

    lps = FIXTURE_LOGPROBS
    ids = np.array([53, 10, 0, 255, 2**31 - 1, 7], dtype="<i4")
    s = step(len(ids), logprobs=lps, token_ids=ids, step_id="step-1", rev=3)
    scored = RolloutScored(
        event_id="ev-scored-1", run_id="run-1", producer="verifier-0", created_at=T0, causation_id="ev-rollout-1",
        rollout_id="rollout-1", group_id="group-1", root_group_id="group-1", group_size=4, environment=ENV,
        example_id="ex-1", status="completed", rewards={"solver": 1.0}, metrics={"len": 6.0},
        verifier="exact_match", verifier_version="1",
        trainable_steps=[StepTokens(step_id="step-1", member_id="solver", policy=ref(3),
                                    prompt_token_ids=s.prompt_token_ids, completion_token_ids=ids,
                                    completion_logprobs=lps)])
    rec = record(0, rev=3, n_tokens=len(ids), logprobs=lps, reward=1.0, advantage=0.75)
    batch = assemble_batch([rec, record(1, rev=4)], revision(4), 2, run_id="run-1", producer="batcher-0",
                           causation_id="ev-rec-0")
    batch = batch.model_copy(update={"event_id": "ev-batch-1", "created_at": T0})
    dead = DeadLetter(event_id="ev-dead-1", run_id="run-1", producer="verifier-0", created_at=T0,
                      origin_topic="rollouts", origin_partition=2, origin_offset=41, origin_key=b"group-1",
                      raw=b"RLEV\x01\x04junk", error_type="EventDecodeError", error_message="truncated frame",
                      service="verifier")
    common = dict(run_id="run-1", producer="arena-0", created_at=T0, claim_id="claim-1", arena_id="arena-0")
    claim = AdmissionClaim(event_id="ev-claim-1", **common, family=FAMILY, group_id="group-1", rollouts=4,
                           seen_revision=3, batch_size=16, max_off_policy_steps=1, lease_s=600.0)
    done = AdmissionDone(event_id="ev-done-1", **common)
    renew = AdmissionRenew(event_id="ev-renew-1", **common)
    release = AdmissionRelease(event_id="ev-release-1", **common, reason="lease of 600s expired (arena arena-0)")
    refund = AdmissionRefund(event_id="ev-refund-1", run_id="run-1", producer="credit", created_at=T0,
                             group_id="group-1", reason="gate 'zero_advantage': all 4 advantages within [0, 0]")
    rebase = AdmissionRebase(event_id="ev-rebase-1", run_id="run-1", producer="batcher-0", created_at=T0, family=FAMILY,
                             revision=5, claims=7, reason="batch b-1 went out with 3 records, no admitted group still "
                             "coming")
    referenced = RolloutReferenced(
        event_id="ev-referenced-1", run_id="run-1", producer="reference-0", created_at=T0, causation_id="ev-scored-1",
        scored=scored, root_group_id="group-1",
        reference=Reference(model="teacher", base_url="http://teacher:8001/v1", revision="/models/teacher"),
        steps=[StepReference(step_id="step-1", ref_logprobs=lps[::-1].copy())])
    events = [revision(3), s, rollout(), scored, referenced, rec, batch, dead, claim, done, renew, release, refund,
              rebase]
    return {e.EVENT_TYPE: e for e in events}
