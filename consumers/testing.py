"""Synthetic events for tests and the benchmark: arithmetic episodes built directly from the schemas.

(consumers never import producers; these stand in for the arena's output.)
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np

from schemas.events import ChatMessage, Rollout, Step, TrainingRecord
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision, family_slug
from schemas.scoring import ScoringSpec

FAMILY = "tiny"
ENV = "arith@1"


def fake_checkpoint(family: str, revision: int) -> CheckpointRef:
    return CheckpointRef(uri=f"file:///tmp/{family_slug(family)}-r{revision}.pt",
                         digest=hashlib.sha256(f"{family}/{revision}".encode()).hexdigest())


def revision(revision: int = 0, family: str = FAMILY, run_id: str = "run") -> PolicyRevision:
    return PolicyRevision(run_id=run_id, producer="test", family=family, revision=revision,
                          checkpoint=fake_checkpoint(family, revision),
                          parent_revision=revision - 1 if revision > 0 else None)


def step(rollout_id: str, root: str, idx: int, member: str, text: str, *, trainable: bool = True,
         policy: PolicyRef | None = None, n_tokens: int | None = None, run_id: str = "run",
         target: str = "learner", prompt_text: str = "q") -> Step:
    n = n_tokens if n_tokens is not None else max(1, len(text))
    toks = np.frombuffer((text.encode() * (n // max(1, len(text)) + 1))[:n], dtype=np.uint8).astype(np.int32)
    return Step(run_id=run_id, producer="test", step_id=f"{rollout_id}-s{idx}", rollout_id=rollout_id,
                root_group_id=root, index=idx, member_id=member, target=target, trainable=trainable,
                policy=policy if trainable else None,
                prompt=[ChatMessage(role="user", content=prompt_text)],
                completion=[ChatMessage(role="assistant", content=text)],
                prompt_token_ids=np.arange(8, dtype=np.int32), completion_token_ids=toks,
                completion_logprobs=np.full(n, -0.5, dtype=np.float32), finish_reason="stop", latency_s=0.01)


def arithmetic_group(group_id: str, size: int = 4, *, revision_: int = 0, family: str = FAMILY, seed: int = 0,
                     n_tokens: int | None = None, run_id: str = "run", spec: dict[str, Any] | None = None
                     ) -> list[tuple[list[Step], Rollout]]:
    """One prompt, ``size`` single-turn rollouts; about half answer correctly."""
    rng = random.Random(f"{group_id}/{seed}")
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    pol = PolicyRef(family=family, revision=revision_)
    out = []
    for i in range(size):
        rid = f"{group_id}-r{i}"
        ans = a + b if rng.random() < 0.5 else a + b + rng.randint(1, 9)
        st = step(rid, group_id, 0, "solver", f"The answer is {ans}", policy=pol, n_tokens=n_tokens, run_id=run_id,
                  prompt_text=f"{a}+{b}=")
        ro = Rollout(run_id=run_id, producer="test", rollout_id=rid, episode_type="single_turn", environment=ENV,
                     example_id=f"{a}+{b}", seed={"a": a, "b": b}, step_ids=[st.step_id], members={"solver": True},
                     artifacts={"scoring": spec or ScoringSpec(kind="exact_match", answer=str(a + b)).model_dump(mode="json")},
                     group_id=group_id, root_group_id=group_id, group_size=size, policy=pol, status="completed")
        out.append(([st], ro))
    return out


def training_record(i: int, *, revision_: int = 0, family: str = FAMILY, n: int = 8, reward: float = 1.0,
                    prompt: int = 4) -> TrainingRecord:
    """``n`` completion tokens after ``prompt`` prompt tokens."""
    return TrainingRecord(run_id="run", producer="test", record_id=f"rec-{i:06d}", rollout_id=f"ro-{i}",
                          step_ids=[f"ro-{i}-s0"], member_id="solver", group_id=f"g-{i // 4}", environment=ENV,
                          policy=PolicyRef(family=family, revision=revision_),
                          prompt_token_ids=np.arange(prompt, dtype=np.int32),
                          completion_token_ids=np.arange(n, dtype=np.int32),
                          completion_logprobs=np.full(n, -1.0, dtype=np.float32),
                          loss_mask=np.ones(n, dtype=np.uint8), reward=reward, advantage=reward - 0.5, credit="test")
