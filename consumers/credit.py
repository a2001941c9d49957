"""Credit assignment: RolloutScored -> TrainingRecords, one per trainable step. Pure (no Kafka, no clock).

Every strategy gives each member's steps that member's reward (per-step credit for multi-turn and
multi-agent episodes); strategies differ in the baseline that turns rewards into advantages. Each is a
``CreditStrategy`` subclass registered with ``@register_strategy`` into ``STRATEGIES`` (grpo,
reinforce_baseline, ema_per_member, per_step below), so a new one is one class, in any module imported
before the service starts: the service only asks ``CreditAssigner.buffers``, never a strategy's name.

Only trainable steps (``RolloutScored.trainable_steps``) produce records: a fixed opponent or the judge
never does. A ref_kl source's scores (prime-rl's opd) come with their reference's logprobs (``RolloutReferenced``,
``CreditAssigner.add_referenced``): no strategy credits them. ``record_id`` derives from (rollout_id, step_id), so a retry cannot double a record.
prime-rl's echo (``echo_roles`` among the strategy's params) adds to each record of a later turn the prompt tokens the
environment wrote since the member's previous call, trained with cross-entropy at their role's weight (``echo_spans``).

Admission gates (prime-rl's ``advantage_range``, ``schemas.plan.AdmissionGate``) look at a credited group's
records: a group a gate rejects yields none, and is listed in ``CreditAssigner.withheld`` so the service gives its
batch slots back to the arenas (``schemas.admission.AdmissionRefund``); so is a group whose every rollout failed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from schemas.events import CeSpan, RolloutReferenced, RolloutScored, StepTokens, TrainingRecord
from schemas.plan import REF_KL, AdmissionGate


def _whole_group_failed(rollouts: Sequence[RolloutScored], whole_groups: bool) -> bool:
    """Whether these rollouts are a whole group (a strategy that waits for groups, or groups of one) and all failed.
    Its slots are given back so the batch fills with another group; the arena stops the run once groups keep
    failing (``--max-failed-groups``). Left alone, its slots were held by records never coming: a recipe whose every
    rollout failed waited for a revision until the arena gave up, and exited 0."""
    return (whole_groups or rollouts[0].group_size == 1) and all(s.status == "failed" for s in rollouts)


def record_id(rollout_id: str, step_id: str, derived_run: str | None = None) -> str:
    """A derived run's records differ from the source run's own for the same step (both replay into one
    database), hence its run id in the hash."""
    key = f"{rollout_id}\x00{step_id}" + (f"\x00{derived_run}" if derived_run else "")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def echo_spans(steps: Sequence[StepTokens], roles: Mapping[str, float]) -> dict[str, list[CeSpan]]:
    """prime-rl's echo: in each step's prompt, the tokens the environment added since the same member's previous
    call (its feedback, a tool's output: ``StepTokens.observation_roles``), weighted by their role's alpha; a first
    call's prompt is not. They are the prompt's tokens after what it shares with the previous call's prompt and
    completion, as the chat template renders them (role tags included: prime-rl's fallback for a renderer without
    per-token content). Left out: a turn of roles with different weights (one span cannot hold them: the message
    boundaries in tokens are not known here), a role not in ``roles``, and a prompt that does not extend the
    previous call's prompt (a template that re-renders the history)."""
    out: dict[str, list[CeSpan]] = {}
    last: dict[str, StepTokens] = {}
    for st in steps:
        prev, last[st.member_id] = last.get(st.member_id), st
        weights = {float(roles.get(r, 0.0)) for r in st.observation_roles or ()}
        if prev is None or len(weights) != 1 or 0.0 in weights:
            continue
        before = np.concatenate([prev.prompt_token_ids, prev.completion_token_ids])
        prompt = np.asarray(st.prompt_token_ids)
        n = min(len(before), len(prompt))
        differ = np.flatnonzero(before[:n] != prompt[:n])
        shared = int(differ[0]) if len(differ) else n
        if shared >= len(prev.prompt_token_ids) and shared < len(prompt):
            out[st.step_id] = [CeSpan(start=max(shared, 1), end=len(prompt), weight=weights.pop())]
    return out


def records_for(scored: RolloutScored, advantages: Mapping[str, float], credit: str, *, producer: str,
                causation_id: str | None = None, ref_logprobs: Mapping[str, np.ndarray] | None = None,
                echo_roles: Mapping[str, float] | None = None) -> list[TrainingRecord]:
    """``ref_logprobs``: each step's reference logprobs (a ref_kl source's), carried onto its record.
    ``echo_roles``: prime-rl's echo, each record's environment tokens trained with cross-entropy (``echo_spans``)."""
    spans = echo_spans(scored.trainable_steps, echo_roles) if echo_roles else {}
    out = []
    for st in scored.trainable_steps:
        n = len(st.completion_token_ids)
        if n == 0:
            continue
        out.append(TrainingRecord(
            run_id=scored.run_id, producer=producer, causation_id=causation_id or scored.event_id,
            record_id=record_id(scored.rollout_id, st.step_id, scored.run_id if scored.source else None),
            rollout_id=scored.rollout_id, step_ids=[st.step_id],
            member_id=st.member_id, group_id=scored.group_id, environment=scored.environment, policy=st.policy,
            prompt_token_ids=st.prompt_token_ids, completion_token_ids=st.completion_token_ids,
            completion_logprobs=st.completion_logprobs, loss_mask=np.ones(n, dtype=np.uint8),
            reward=float(scored.rewards.get(st.member_id, 0.0)),
            advantage=float(advantages.get(st.member_id, 0.0)), credit=credit, source=scored.source,
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[st.step_id], ce_spans=spans.get(st.step_id)))
    return out


def gate_rejects(advantages: Sequence[float], gates: Sequence[AdmissionGate]) -> str | None:
    """Why the first gate rejecting a group with these trainable advantages does (prime-rl's ``AdvRangeGate``:
    every advantage within ``[reject_min, reject_max]``); None when every gate admits it. A group with no
    trainable advantage is admitted, as prime-rl admits one without an advantage stream."""
    if not advantages:
        return None
    for g in gates:
        if all(g.reject_min <= a <= g.reject_max for a in advantages):
            return (f"gate {g.name!r}: all {len(advantages)} advantages within [{g.reject_min:g}, "
                    f"{g.reject_max:g}]")
    return None


def group_advantages(group: Sequence[RolloutScored], *, eps: float = 1e-6, scale_std: bool = True,
                     scale_mean: bool = False, length_penalty: Mapping[str, float] | None = None
                     ) -> dict[str, dict[str, float]]:
    """rollout_id -> member -> advantage, normalised within the group for each member: by its standard deviation
    (``scale_std``), or by its mean (``scale_mean``, MaxRL: 0 for a group whose mean is not positive).
    ``length_penalty`` (``{"output": w, "input": w, "turns": w}``): rewards shaped first (``length_shaped``)."""
    members = sorted({m for s in group for m in s.rewards})
    out: dict[str, dict[str, float]] = {s.rollout_id: {} for s in group}
    for m in members:
        have = [s for s in group if m in s.rewards]
        r = np.array([s.rewards[m] for s in have], dtype=np.float64)
        if length_penalty:
            r = length_shaped(r, [_lengths(s, m) for s in have], length_penalty)
        a = r - r.mean()
        if scale_mean:
            a = a / r.mean() if r.mean() > 0 else np.zeros_like(a)
        elif scale_std:
            a = a / (r.std() + eps)
        for s, v in zip(have, a):
            out[s.rollout_id][m] = float(v)
    return out


def length_shaped(rewards: np.ndarray, lengths: Sequence[tuple[int, int, int]], weights: Mapping[str, float]
                  ) -> np.ndarray:
    """prime-rl's linear length penalty, before the group baseline: each reward less the group's pass rate (its mean
    reward, at least 0) times ``w_output * output / max output + w_input * input / max input + w_turns * turns /
    max turns`` (``lengths``: each rollout's (output tokens, input tokens, turns); a group max of 0 counts as 1)."""
    n = np.array(lengths, dtype=np.float64).reshape(len(rewards), 3)
    w = np.array([weights.get("output", 0.0), weights.get("input", 0.0), weights.get("turns", 0.0)])
    frac = (n / np.maximum(n.max(axis=0), 1.0)) @ w
    return rewards - max(float(rewards.mean()), 0.0) * frac


def _lengths(s: RolloutScored, member: str) -> tuple[int, int, int]:
    """A member's (output tokens, input tokens, turns) in a rollout: its completions, the rest of its longest
    context (prompts, other seats' turns, tool results), its model calls."""
    steps = [st for st in s.trainable_steps if st.member_id == member]
    output = sum(len(st.completion_token_ids) for st in steps)
    total = max((len(st.prompt_token_ids) + len(st.completion_token_ids) for st in steps), default=0)
    return output, max(total - output, 0), len(steps)


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


Advantages = dict[str, Mapping[str, float]]
"""rollout_id -> member -> advantage."""

STRATEGIES: dict[str, type[CreditStrategy]] = {}
"""The registry, in registration order: strategy name -> class (also the CLI's ``--credit`` choices)."""


def register_strategy(cls: type[CreditStrategy]) -> type[CreditStrategy]:
    """Class decorator: register a strategy under its ``name``, so a new one needs no edit anywhere else."""
    if not cls.name or cls.name in STRATEGIES:
        raise ValueError(f"credit strategy name {cls.name!r} is empty or already registered")
    STRATEGIES[cls.name] = cls
    return cls


class CreditStrategy:
    """One way to turn rewards into advantages; one instance per partition, holding that partition's state.

    ``buffers``: the strategy needs a whole group at once, so ``CreditAssigner`` holds rollouts until their
    group is complete (or flushes it on timeout); otherwise each rollout is credited as it arrives, alone.
    """

    name: ClassVar[str] = ""
    buffers: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params

    def advantages(self, rollouts: Sequence[RolloutScored]) -> Advantages:
        """Advantages for these rollouts: a whole group when ``buffers``, else the single new one."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a restart must get back (a baseline), stored with the consumer's offsets; {} if nothing."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state`` returned before a restart."""


@register_strategy
class Grpo(CreditStrategy):
    """Group-relative: wait for all ``group_size`` rollouts of a group, then per member
    A = (r - mean_group) / (std_group + eps); ``scale_std: false`` drops the division (Dr. GRPO);
    ``scale_mean``: divided by the group mean instead (MaxRL); ``length_penalty``: the rewards shaped by length
    first (``length_shaped``)."""

    name = "grpo"
    buffers = True

    def advantages(self, rollouts: Sequence[RolloutScored]) -> Advantages:
        return group_advantages(rollouts, eps=float(self.params.get("eps", 1e-6)),
                                scale_std=bool(self.params.get("scale_std", True)),
                                scale_mean=bool(self.params.get("scale_mean", False)),
                                length_penalty=self.params.get("length_penalty"))


class _Baselined(CreditStrategy):
    """A strategy with EMA baselines, which outlive a restart through ``state``."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.baseline = MovingBaseline(alpha=float(params.get("alpha", 0.9)))

    def state(self) -> dict[str, Any]:
        return {"baseline": dict(self.baseline.values)} if self.baseline.values else {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.baseline.values = dict(state.get("baseline", {}))


@register_strategy
class ReinforceBaseline(_Baselined):
    """Plain REINFORCE, A = r - b_env: one EMA baseline per environment, updated with the mean reward over
    the rollout's members."""

    name = "reinforce_baseline"

    def advantages(self, rollouts: Sequence[RolloutScored]) -> Advantages:
        out: Advantages = {}
        for s in rollouts:
            mean = sum(s.rewards.values()) / len(s.rewards) if s.rewards else 0.0
            base = self.baseline.values.get(s.environment, 0.0)
            self.baseline.advantage(s.environment, mean)
            out[s.rollout_id] = {m: r - base for m, r in s.rewards.items()}
        return out


@register_strategy
class EmaPerMember(_Baselined):
    """A = r - b_(env, member), one EMA baseline per (environment, member), for zero-sum self-play
    (prime-rl's ``ema_per_member``, SPIRAL's role-conditioned advantage estimation)."""

    name = "ema_per_member"

    def advantages(self, rollouts: Sequence[RolloutScored]) -> Advantages:
        return {s.rollout_id: {m: self.baseline.advantage(f"{s.environment}|{m}", r)
                               for m, r in sorted(s.rewards.items())} for s in rollouts}


@register_strategy
class PerStep(CreditStrategy):
    """A = r, no baseline: each member's steps credited with that member's reward."""

    name = "per_step"

    def advantages(self, rollouts: Sequence[RolloutScored]) -> Advantages:
        return {s.rollout_id: s.rewards for s in rollouts}


def check_gates(strategy: str, gates: Sequence[AdmissionGate]) -> None:
    """Refuse admission gates with a strategy that credits each rollout alone: a gate judges a whole group."""
    if gates and not STRATEGIES[strategy].buffers:
        raise ValueError(f"admission gates judge a whole group, and credit strategy {strategy!r} credits each "
                         "rollout alone: use a group strategy (grpo) or drop the recipe's curriculum.gates")


class CreditAssigner:
    """Strategy state for one partition. ``add`` returns the records ready now (and notes what it buffers)."""

    def __init__(self, strategy: str = "grpo", params: Mapping[str, Any] | None = None, *, producer: str = "credit",
                 gates: Sequence[AdmissionGate] = ()):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown credit strategy {strategy!r}; choose from {tuple(STRATEGIES)}")
        self.params = dict(params or {})
        self.strategy = STRATEGIES[strategy](self.params)
        self.producer = producer
        self.groups = GroupBuffer()
        self.timeout_s = float(self.params.get("group_timeout_s", 300.0))
        check_gates(strategy, gates)
        self.gates = list(gates)
        self.withheld: list[tuple[str, str, str]] = []  # (group id, run id, why) of gated groups: the caller drains

    @property
    def buffers(self) -> bool:
        """Whether ``add`` may hold a rollout back (so the caller keeps its input record until released)."""
        return self.strategy.buffers

    def add(self, scored: RolloutScored, now: float) -> list[TrainingRecord]:
        if scored.evaluation:
            return []  # held-out evaluation: scored for the record, never trained on (and never in a baseline)
        if not self.buffers:
            return self._credit([scored], self.strategy.name)
        group = self.groups.add(scored, now)
        return self._credit(group, self.strategy.name) if group else []

    def add_referenced(self, ev: RolloutReferenced) -> list[TrainingRecord]:
        """A ref_kl source's score with its reference's logprobs: records with no advantage (prime-rl's opd assigns
        none), each carrying its tokens' reference logprobs; no group waits and no gate judges it (there is no
        advantage to judge). A lone rollout that failed gives its slot back, as ``_credit`` does."""
        s = ev.scored
        if s.evaluation:
            return []
        records = records_for(s, {}, REF_KL, producer=self.producer, causation_id=ev.event_id,
                              ref_logprobs={st.step_id: st.ref_logprobs for st in ev.steps})
        if not records and _whole_group_failed([s], False):
            self.withheld.append((s.group_id, s.run_id, "the rollout failed: nothing to train"))
        return records

    def _credit(self, rollouts: list[RolloutScored], credit: str) -> list[TrainingRecord]:
        adv = self.strategy.advantages(rollouts)
        records = [r for s in rollouts for r in records_for(s, adv[s.rollout_id], credit, producer=self.producer,
                                                           echo_roles=self.params.get("echo_roles"))]
        why = gate_rejects([r.advantage for r in records], self.gates) if self.gates else None
        if why is None and not records and _whole_group_failed(rollouts, self.buffers):
            why = f"every rollout of the group failed ({len(rollouts)} of {rollouts[0].group_size}): nothing to train"
        if why is None:
            return records
        self.withheld.append((rollouts[0].group_id, rollouts[0].run_id, why))
        return []

    def flush_expired(self, now: float) -> tuple[list[TrainingRecord], list[tuple[list[RolloutScored], str]]]:
        """Groups past the timeout: credited within what arrived when >= 2 rollouts, else refused with a reason."""
        records: list[TrainingRecord] = []
        refused: list[tuple[list[RolloutScored], str]] = []
        for gid in self.groups.expired(now, self.timeout_s):
            group = self.groups.pop(gid)
            n = group[0].group_size
            reason = f"group {gid} incomplete after {self.timeout_s:g}s: {len(group)}/{n} rollouts"
            if len(group) >= 2:
                records.extend(self._credit(group, f"{self.strategy.name}:flushed({len(group)}/{n},timeout)"))
            else:
                refused.append((group, reason + "; a lone rollout has no group-relative advantage"))
        return records, refused

    def state(self) -> dict[str, Any]:
        return self.strategy.state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.strategy.load_state(state)
