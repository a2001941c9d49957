"""Credit assignment: RolloutScored -> TrainingRecords, one per trainable step. Pure (no Kafka, no clock).

Every strategy gives each member's steps that member's reward (per-step credit for multi-turn and
multi-agent episodes); strategies differ in the baseline that turns rewards into advantages:

* ``grpo``               group-relative: wait for all ``group_size`` rollouts of a group, then
                         A = (r - mean_group) / (std_group + eps), per member (``scale_std: false`` = Dr. GRPO)
* ``reinforce_baseline`` plain REINFORCE with a per-environment moving-average baseline: A = r - b_env
* ``ema_per_member``     per-(environment, member) EMA baseline for zero-sum self-play (prime-rl's
                         ``ema_per_member``, SPIRAL's role-conditioned advantage estimation): A = r - b_(env,m)
* ``per_step``           A = r (no baseline), each member's steps credited with that member's reward

Only trainable steps (``RolloutScored.trainable_steps``) produce records: a fixed opponent or the judge
never does. ``record_id`` derives from (rollout_id, step_id), so a retry cannot double a record.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from schemas.events import RolloutScored, TrainingRecord

STRATEGIES = ("grpo", "reinforce_baseline", "ema_per_member", "per_step")


def record_id(rollout_id: str, step_id: str) -> str:
    return hashlib.sha256(f"{rollout_id}\x00{step_id}".encode()).hexdigest()[:32]


def records_for(scored: RolloutScored, advantages: Mapping[str, float], credit: str, *, producer: str,
                causation_id: str | None = None) -> list[TrainingRecord]:
    out = []
    for st in scored.trainable_steps:
        n = len(st.completion_token_ids)
        if n == 0:
            continue
        out.append(TrainingRecord(
            run_id=scored.run_id, producer=producer, causation_id=causation_id or scored.event_id,
            record_id=record_id(scored.rollout_id, st.step_id), rollout_id=scored.rollout_id, step_ids=[st.step_id],
            member_id=st.member_id, group_id=scored.group_id, environment=scored.environment, policy=st.policy,
            prompt_token_ids=st.prompt_token_ids, completion_token_ids=st.completion_token_ids,
            completion_logprobs=st.completion_logprobs, loss_mask=np.ones(n, dtype=np.uint8),
            reward=float(scored.rewards.get(st.member_id, 0.0)),
            advantage=float(advantages.get(st.member_id, 0.0)), credit=credit))
    return out


def group_advantages(group: Sequence[RolloutScored], *, eps: float = 1e-6, scale_std: bool = True
                     ) -> dict[str, dict[str, float]]:
    """rollout_id -> member -> advantage, normalised within the group for each member."""
    members = sorted({m for s in group for m in s.rewards})
    out: dict[str, dict[str, float]] = {s.rollout_id: {} for s in group}
    for m in members:
        have = [s for s in group if m in s.rewards]
        r = np.array([s.rewards[m] for s in have], dtype=np.float64)
        a = r - r.mean()
        if scale_std:
            a = a / (r.std() + eps)
        for s, v in zip(have, a):
            out[s.rollout_id][m] = float(v)
    return out


@dataclass
class GroupBuffer:
    """Rollouts of incomplete groups, by group id, in arrival order."""

    groups: dict[str, dict[str, RolloutScored]] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)

    def add(self, s: RolloutScored, now: float) -> list[RolloutScored] | None:
        """Add a scored rollout; return the whole group when it is complete (and forget it)."""
        g = self.groups.setdefault(s.group_id, {})
        self.first_seen.setdefault(s.group_id, now)
        g.setdefault(s.rollout_id, s)  # a duplicate rollout id never counts twice
        if len(g) >= s.group_size:
            return self.pop(s.group_id)
        return None

    def pop(self, group_id: str) -> list[RolloutScored]:
        self.first_seen.pop(group_id, None)
        return list(self.groups.pop(group_id, {}).values())

    def expired(self, now: float, timeout_s: float) -> list[str]:
        return [g for g, t in self.first_seen.items() if now - t >= timeout_s]


@dataclass
class MovingBaseline:
    """EMA baselines keyed by a string; A = r - b (b before the update), then b <- alpha*b + (1-alpha)*r."""

    alpha: float = 0.9
    values: dict[str, float] = field(default_factory=dict)

    def advantage(self, key: str, reward: float) -> float:
        b = self.values.get(key)
        adv = reward - (b if b is not None else 0.0)
        self.values[key] = reward if b is None else self.alpha * b + (1 - self.alpha) * reward
        return adv


class CreditAssigner:
    """Strategy state for one partition. ``add`` returns the records ready now (and notes what it buffers)."""

    def __init__(self, strategy: str = "grpo", params: Mapping[str, Any] | None = None, *, producer: str = "credit"):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown credit strategy {strategy!r}; choose from {STRATEGIES}")
        self.strategy = strategy
        self.params = dict(params or {})
        self.producer = producer
        self.groups = GroupBuffer()
        self.baseline = MovingBaseline(alpha=float(self.params.get("alpha", 0.9)))
        self.timeout_s = float(self.params.get("group_timeout_s", 300.0))

    def add(self, scored: RolloutScored, now: float) -> list[TrainingRecord]:
        if scored.evaluation:
            return []  # held-out evaluation: scored for the record, never trained on (and never in a baseline)
        if self.strategy == "grpo":
            group = self.groups.add(scored, now)
            return self._grpo(group, "grpo") if group else []
        if self.strategy == "per_step":
            return records_for(scored, scored.rewards, "per_step", producer=self.producer)
        if self.strategy == "reinforce_baseline":
            key = scored.environment
            # one baseline per environment, updated with the mean reward over the rollout's members
            rewards = scored.rewards
            mean = sum(rewards.values()) / len(rewards) if rewards else 0.0
            b = self.baseline.values.get(key)
            self.baseline.advantage(key, mean)
            base = b if b is not None else 0.0
            return records_for(scored, {m: r - base for m, r in rewards.items()}, "reinforce_baseline",
                               producer=self.producer)
        # ema_per_member
        adv = {m: self.baseline.advantage(f"{scored.environment}|{m}", r) for m, r in sorted(scored.rewards.items())}
        return records_for(scored, adv, "ema_per_member", producer=self.producer)

    def _grpo(self, group: list[RolloutScored], credit: str) -> list[TrainingRecord]:
        adv = group_advantages(group, eps=float(self.params.get("eps", 1e-6)),
                               scale_std=bool(self.params.get("scale_std", True)))
        out: list[TrainingRecord] = []
        for s in group:
            out.extend(records_for(s, adv[s.rollout_id], credit, producer=self.producer))
        return out

    def flush_expired(self, now: float) -> tuple[list[TrainingRecord], list[tuple[list[RolloutScored], str]]]:
        """Groups past the timeout: normalised within what arrived when >= 2 rollouts, else refused with a reason."""
        records: list[TrainingRecord] = []
        refused: list[tuple[list[RolloutScored], str]] = []
        for gid in self.groups.expired(now, self.timeout_s):
            group = self.groups.pop(gid)
            n = group[0].group_size
            reason = f"group {gid} incomplete after {self.timeout_s:g}s: {len(group)}/{n} rollouts"
            if len(group) >= 2:
                records.extend(self._grpo(group, f"grpo:flushed({len(group)}/{n},timeout)"))
            else:
                refused.append((group, reason + "; a lone rollout has no group-relative advantage"))
        return records, refused

    def state(self) -> dict[str, Any]:
        return {"baseline": dict(self.baseline.values)} if self.baseline.values else {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.baseline.values = dict(state.get("baseline", {}))
