"""Verifiers: score one rollout (with its steps) according to its ScoringSpec. Pure, async, no Kafka, no I/O of its
own: the judge is a callable handed in (``consumers.judge.http_judge`` builds one over HTTP), and the rubric's
reward functions are imported and called by ``consumers.reward_functions``.

A scoring kind (``ScoringSpec.kind``) is a ``Verifier`` subclass registered with ``@register_verifier``
into ``VERIFIERS``: ``exact_match``, ``rubric``, ``llm_judge``, ``zero_sum_judge``, ``monte_carlo`` and
``recorded`` below, or one of your own in any module imported before the service starts. Each declares what it
needs (``needs_judge``, ``needs_children``, the spec fields its ``check`` demands), and the verifier service
asks ``needs_children`` / ``child_member`` instead of knowing any kind by name.

A reward function that raises or times out raises ``ScoringError``; the verifier service dead-letters the
rollout with that reason and goes on. The judge is called through a ``Judge`` callable bound to a fixed
plan target; its output only ever becomes a number in ``rewards``, never a training record.
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar, Mapping, Sequence

from consumers.reward_functions import call_func, load_func
from schemas.envelope import SourceEvent
from schemas.events import Rollout, RolloutScored, Step, StepTokens
from schemas.history import Rescore
from schemas.objectives import Demonstration
from schemas.scoring import SCORING_ARTIFACT, ScoringSpec, WeightedFunc

VERIFIER_VERSION = "1"
Judge = Callable[[str, list[dict[str, Any]]], Awaitable[str]]
"""async judge(target_name, chat_messages) -> the judge model's reply text."""


class ScoringError(Exception):
    """A rollout that cannot be scored: the reason goes to the dead-letter topic."""


@dataclass
class Verdict:
    rewards: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)
    verifier: str = ""


# -- answers -------------------------------------------------------------------------------------------
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(.+)")
_ANSWER = re.compile(r"answer\s*(?:is|:)\s*(.+)", re.I)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The final answer in a completion: \\boxed{..}, '#### ..', 'answer: ..', else the last number, else the text."""
    for pat in (_BOXED, _HASHES, _ANSWER):
        found = pat.findall(text)
        if found:
            return normalize(found[-1])
    nums = _NUMBER.findall(text)
    if nums:
        return normalize(nums[-1])
    return normalize(text)


def normalize(s: str) -> str:
    s = s.strip().strip(".").strip().replace(",", "")
    try:
        f = float(s)
        if math.isfinite(f) and f == int(f):
            return str(int(f))
        return repr(f)
    except ValueError:
        return " ".join(s.lower().split())


# -- transcript helpers --------------------------------------------------------------------------------
def _text(messages) -> str:
    return "".join(m.content or "" for m in messages)


def member_steps(steps: Sequence[Step], member: str) -> list[Step]:
    return sorted((s for s in steps if s.member_id == member), key=lambda s: s.index)


def spec_of(rollout: Rollout) -> ScoringSpec:
    raw = rollout.artifacts.get(SCORING_ARTIFACT)
    if raw is None:
        raise ScoringError(f"rollout {rollout.rollout_id} carries no artifacts[{SCORING_ARTIFACT!r}] scoring spec")
    try:
        return ScoringSpec.model_validate(raw)
    except Exception as e:  # noqa: BLE001
        raise ScoringError(f"rollout {rollout.rollout_id}: invalid scoring spec: {e}") from None


def scored_members(rollout: Rollout) -> list[str]:
    """Members that get a reward: the trainable ones, or all of them if none is trainable (eval runs)."""
    trainable = [m for m, t in rollout.members.items() if t]
    return trainable or list(rollout.members)


# -- the registry --------------------------------------------------------------------------------------
VERIFIERS: dict[str, Verifier] = {}
"""kind -> its verifier, in registration order."""


def register_verifier(cls: type[Verifier]) -> type[Verifier]:
    """Class decorator: register a scoring kind under ``cls.kind``, so a new one needs no edit anywhere else."""
    if not cls.kind or cls.kind in VERIFIERS:
        raise ValueError(f"scoring kind {cls.kind!r} is empty or already registered")
    VERIFIERS[cls.kind] = cls()
    return cls


class Verifier:
    """One scoring kind, stateless. What it declares is all the verifier service knows of it:

    * ``needs_judge``: it may ask the plan's fixed ``judge_target`` (so the spec must name one), and only
      such a kind is handed the ``Judge``;
    * ``needs_children``: it scores a parent from its child rollouts' outcomes, so the service waits for them.
    """

    kind: ClassVar[str] = ""
    needs_judge: ClassVar[bool] = False
    needs_children: ClassVar[bool] = False

    def check(self, spec: ScoringSpec) -> None:
        """Raise ``ScoringError`` when the spec lacks a field this kind needs."""
        if self.needs_judge and not spec.judge_target:
            raise ScoringError(f"{self.kind} scoring needs judge_target (a fixed target of the plan)")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        """``judge`` is None unless ``needs_judge``; ``child_outcomes`` is None unless ``needs_children``."""
        raise NotImplementedError


def verifier_of(spec: ScoringSpec) -> Verifier:
    try:
        return VERIFIERS[spec.kind]
    except KeyError:
        raise ScoringError(f"unknown scoring kind {spec.kind!r}; known: {', '.join(VERIFIERS)}") from None


def needs_children(rollout: Rollout) -> bool:
    """Whether scoring waits for the rollout's children: its kind says so and it did not fail (a failed
    rollout scores 0 at once). No spec, or a bad one, waits for nothing: ``score`` dead-letters it."""
    if rollout.status == "failed":
        return False
    try:
        return verifier_of(spec_of(rollout)).needs_children
    except ScoringError:
        return False


def child_member(parent: Rollout) -> str | None:
    """The member whose reward is a child's outcome for this parent (spec param ``child_member``); None: the
    mean over the child's members (``child_outcome``)."""
    try:
        member = spec_of(parent).params.get("child_member")
    except ScoringError:
        return None
    return member if isinstance(member, str) else None


# -- verifiers -----------------------------------------------------------------------------------------
_INTEGER = re.compile(r"-?\d+")


def extract(text: str, how: str | None) -> str:
    """``last_integer``: the last integer in the text; default: ``final_answer``."""
    if how == "last_integer":
        found = _INTEGER.findall(text.replace(",", ""))
        return normalize(found[-1]) if found else ""
    return final_answer(text)


def answer_reward(text: str, answer: str, how: str | None) -> float:
    """1.0 when the answer ``extract``ed from ``text`` (``how``) is ``answer``, both normalized; else 0.0."""
    return 1.0 if extract(text, how) == normalize(answer) else 0.0


@register_verifier
class ExactMatch(Verifier):
    """Each member's final answer == ``spec.answer`` -> 1.0 / 0.0. params: ``member`` (score only that
    member), ``extract`` (``last_integer`` or the default ``final_answer``)."""

    kind = "exact_match"

    def check(self, spec: ScoringSpec) -> None:
        if spec.answer is None:
            raise ScoringError("exact_match scoring needs an answer")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        answer = spec.answer or ""
        rewards, metrics = {}, {}
        only = spec.params.get("member")
        members = [only] if isinstance(only, str) and only in rollout.members else scored_members(rollout)
        for m in members:
            ms = member_steps(steps, m)
            rewards[m] = answer_reward(_text(ms[-1].completion), answer, spec.params.get("extract")) if ms \
                else float(normalize(answer) == "")  # type: ignore[arg-type]
            metrics[f"{m}/completion_tokens"] = float(sum(len(s.completion_token_ids) for s in ms))
        return Verdict(rewards, metrics, "exact_match")


async def _weighted(funcs: Sequence[WeightedFunc], kwargs: Mapping[str, Any], timeout_s: float,
                    what: str) -> dict[str, tuple[float, float]]:
    results: dict[str, tuple[float, float]] = {}
    for wf in funcs:
        try:
            fn = load_func(wf.fn)
            results[wf.fn] = (await call_func(fn, kwargs, timeout_s), wf.weight)
        except asyncio.TimeoutError:
            raise ScoringError(f"{what} {wf.fn} timed out after {timeout_s}s") from None
        except ScoringError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ScoringError(f"{what} {wf.fn} raised {type(e).__name__}: {e}") from None
    return results


@register_verifier
class Rubric(Verifier):
    """Weighted sum of reward functions (sync or async), each called with the keyword arguments it takes of
    prompt, completion, answer, state; ``metrics`` are logged, not rewarded. params: ``timeout_s``."""

    kind = "rubric"

    def check(self, spec: ScoringSpec) -> None:
        if not spec.funcs:
            raise ScoringError("rubric scoring needs at least one reward function")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        timeout_s = float(spec.params.get("timeout_s", 10.0))  # type: ignore[arg-type]
        rewards: dict[str, float] = {}
        metrics: dict[str, float] = {}
        for m in scored_members(rollout):
            ms = member_steps(steps, m)
            kwargs = {
                "prompt": [x.model_dump(mode="json") for x in (ms[0].prompt if ms else [])],
                "completion": [x.model_dump(mode="json") for s in ms for x in s.completion],
                "answer": spec.answer,
                "state": {"artifacts": rollout.artifacts, "seed": rollout.seed, "member": m,
                          "environment": rollout.environment, "status": rollout.status},
            }
            scored = await _weighted(spec.funcs, kwargs, timeout_s, "reward function")
            rewards[m] = sum(v * w for v, w in scored.values())
            for name, (v, _) in scored.items():
                metrics[f"{m}/reward/{name.rsplit(':', 1)[-1]}"] = v
            for name, (v, _) in (await _weighted(spec.metrics, kwargs, timeout_s, "metric")).items():
                metrics[f"{m}/metric/{name.rsplit(':', 1)[-1]}"] = v
        return Verdict(rewards, metrics, "rubric")


def transcript(steps: Sequence[Step]) -> str:
    lines = []
    for s in sorted(steps, key=lambda s: s.index):
        lines.append(f"[{s.member_id}] {_text(s.completion)}")
    return "\n".join(lines)


_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.I)


def parse_judge_score(reply: str) -> float:
    found = _SCORE.findall(reply) or _NUMBER.findall(reply)
    if not found:
        raise ScoringError(f"judge reply has no score: {reply[:200]!r}")
    return min(1.0, max(0.0, float(found[-1])))


@register_verifier
class LLMJudge(Verifier):
    """The plan's fixed ``judge_target`` grades the transcript, a score in [0, 1] for every scored member
    (unless the arena already asked it: ``artifacts["judge_score"]``). params: ``rubric``, ``timeout_s``."""

    kind = "llm_judge"
    needs_judge = True

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        if "judge_score" in rollout.artifacts:
            score = float(rollout.artifacts["judge_score"])  # type: ignore[arg-type]
        else:
            question = _text(steps[0].prompt) if steps else str(rollout.seed)
            rubric = str(spec.params.get("rubric", "Grade the answer from 0 to 1. Reply 'SCORE: <number>'."))
            msgs = [{"role": "system", "content": rubric},
                    {"role": "user", "content": f"Question:\n{question}\n\nReference answer: {spec.answer}\n\n"
                                                f"Transcript:\n{transcript(steps)}"}]
            score = await _ask(judge, spec, msgs, parse_judge_score)
        return Verdict({m: score for m in scored_members(rollout)}, {"judge_score": score},
                       f"llm_judge:{spec.judge_target}")


async def _ask(judge: Judge | None, spec: ScoringSpec, msgs, parse):
    if judge is None:
        raise ScoringError(f"{spec.kind} needs a judge client for target {spec.judge_target!r}")
    timeout_s = float(spec.params.get("timeout_s", 60.0))  # type: ignore[arg-type]
    try:
        reply = await asyncio.wait_for(judge(spec.judge_target or "", msgs), timeout_s)
    except asyncio.TimeoutError:
        raise ScoringError(f"judge {spec.judge_target} timed out after {timeout_s}s") from None
    except ScoringError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ScoringError(f"judge {spec.judge_target} failed: {type(e).__name__}: {e}") from None
    return parse(reply)


def zero_sum_rewards(players: Sequence[str], winner: str | None) -> dict[str, float]:
    a, b = players
    if winner in (None, "", "tie", "draw"):
        return {a: 0.0, b: 0.0}
    if winner not in (a, b):
        raise ScoringError(f"judge named {winner!r}, not one of the players {list(players)}")
    return {a: 1.0 if winner == a else -1.0, b: 1.0 if winner == b else -1.0}


@register_verifier
class ZeroSumJudge(Verifier):
    """The judge names a winner among the two ``players``: +1 / -1, 0 on a tie (unless the arena recorded
    one: ``artifacts["winner"]``). params: ``judge_prompt``, a template given ``{transcript}`` and the params."""

    kind = "zero_sum_judge"
    needs_judge = True

    def check(self, spec: ScoringSpec) -> None:
        super().check(spec)
        if len(spec.players) != 2:
            raise ScoringError("zero_sum_judge scoring needs exactly two players")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        players = list(spec.players)
        verdict = rollout.artifacts.get("winner", rollout.artifacts.get("judge_verdict", ...))
        if verdict is ...:
            template = spec.params.get("judge_prompt")
            if isinstance(template, str):
                fields = {k: v for k, v in spec.params.items() if isinstance(v, (str, int, float))}
                try:
                    text = template.format(**{**fields, "transcript": transcript(steps)})
                except (KeyError, IndexError, ValueError) as e:
                    raise ScoringError(f"judge_prompt does not format: {e}") from None
                msgs = [{"role": "user", "content": text}]
            else:
                msgs = [{"role": "system", "content": f"You judge a contest between {players[0]} and {players[1]}. "
                                                      f"Reply 'WINNER: <name>' or 'WINNER: tie'."},
                        {"role": "user", "content": transcript(steps)}]

            def parse(reply: str) -> str:
                m = re.search(r"winner\s*[:=]\s*([\w\-]+)", reply, re.I)
                if m:
                    return m.group(1)
                named = [x for x in (*players, "tie") if re.search(rf"\b{re.escape(x)}\b", reply)]
                return named[0] if len(named) == 1 else reply.strip()

            verdict = await _ask(judge, spec, msgs, parse)
        rewards = zero_sum_rewards(players, None if verdict is None else str(verdict))
        return Verdict(rewards, {"tie": float(all(v == 0 for v in rewards.values()))},
                       f"zero_sum_judge:{spec.judge_target}")


def monte_carlo_reward(outcomes: Sequence[float], params: Mapping[str, Any]) -> float:
    """Proposer's reward from its solvers' outcomes (each in [0, 1]).

    mode ``mean`` (default): the solve rate; ``inverse``: 1 - solve rate (an adversarial proposer);
    ``band``: 1.0 when low <= solve rate <= high (a problem neither trivial nor impossible), else 0.0.
    """
    if not outcomes:
        raise ScoringError("monte_carlo: no child outcomes")
    rate = sum(outcomes) / len(outcomes)
    if "target_pass_rate" in params:  # producers' proposer/solver: 1 - 2*|pass_rate - target|
        return 1.0 - 2.0 * abs(rate - float(params["target_pass_rate"]))
    mode = params.get("mode", "mean")
    if mode == "mean":
        return rate
    if mode == "inverse":
        return 1.0 - rate
    if mode == "band":
        return 1.0 if float(params.get("low", 0.2)) <= rate <= float(params.get("high", 0.8)) else 0.0
    raise ScoringError(f"monte_carlo: unknown mode {mode!r}")


def child_outcome(scored: RolloutScored, member: str | None = None) -> float:
    """A child rollout's outcome: its ``member``'s reward, or the mean over its members."""
    if member is not None and member in scored.rewards:
        return scored.rewards[member]
    vals = list(scored.rewards.values())
    return sum(vals) / len(vals) if vals else 0.0


def monte_carlo(rollout: Rollout, spec: ScoringSpec, outcomes: Sequence[float]) -> Verdict:
    """params: ``proposer`` (the rewarded member; default the trainable ones), ``proposal_valid`` false ->
    ``invalid_reward``; the reward from the children's pass rate (``monte_carlo_reward``)."""
    p = spec.params
    members = [p["proposer"]] if isinstance(p.get("proposer"), str) and p["proposer"] in rollout.members \
        else scored_members(rollout)
    rate = sum(outcomes) / len(outcomes) if outcomes else 0.0
    if p.get("proposal_valid") is False:
        r = float(p.get("invalid_reward", -1.0))  # type: ignore[arg-type]
    else:
        r = monte_carlo_reward(outcomes, p)
    return Verdict({m: r for m in members}, {"children": float(len(outcomes)), "pass_rate": rate}, "monte_carlo")


@register_verifier
class MonteCarlo(Verifier):
    """A parent (proposer) scored from its children's (solvers') outcomes by ``monte_carlo``; param
    ``child_member``: the member whose reward is a child's outcome (default: the mean over its members)."""

    kind = "monte_carlo"
    needs_children = True

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        return monte_carlo(rollout, spec, child_outcomes or ())


@register_verifier
class Recorded(Verifier):
    """The rewards a rollout came with, per member, in param ``rewards``: an imported run's (``rollout
    import-traces`` records each seat's trace reward so), which a derived run re-credits and re-trains as they
    were, or re-scores with ``--rubric``."""

    kind = "recorded"

    def check(self, spec: ScoringSpec) -> None:
        rewards = spec.params.get("rewards")
        if not isinstance(rewards, dict) or not all(isinstance(v, int | float) for v in rewards.values()):
            raise ScoringError("recorded scoring needs params.rewards: {member: reward}")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: Judge | None,
                    child_outcomes: Sequence[float] | None) -> Verdict:
        rewards = spec.params["rewards"]
        return Verdict({m: float(rewards.get(m, 0.0)) for m in scored_members(rollout)}, {}, "recorded")


async def score(rollout: Rollout, steps: Sequence[Step], *, judge: Judge | None = None,
                child_outcomes: Sequence[float] | None = None, rescore: Rescore | None = None) -> Verdict:
    """Score a rollout with the spec it carries (a derived run's ``rescore`` replacing parts of it). Failed
    rollouts score 0 for every member, without scoring."""
    if rollout.status == "failed":
        return Verdict({m: 0.0 for m in rollout.members}, {"failed": 1.0}, "failed")
    if rescore is not None and SCORING_ARTIFACT not in rollout.artifacts:  # a rollout that came with no spec
        spec = rescore.apply(ScoringSpec(kind=rescore.kind or "rubric"))
    else:
        spec = spec_of(rollout) if rescore is None else rescore.apply(spec_of(rollout))
    v = verifier_of(spec)
    v.check(spec)
    if v.needs_children and child_outcomes is None:
        raise ScoringError(f"{spec.kind} scoring needs the children's outcomes")
    return await v.score(rollout, steps, spec, judge=judge if v.needs_judge else None,
                         child_outcomes=child_outcomes if v.needs_children else None)


def trainable_steps(steps: Sequence[Step]) -> list[StepTokens]:
    """Tokens of the trainable steps only: a fixed opponent's or the judge's never become training data."""
    return [StepTokens.of(s) for s in sorted(steps, key=lambda s: s.index) if s.trainable and s.policy is not None]


def to_scored(rollout: Rollout, steps: Sequence[Step], verdict: Verdict, *, producer: str,
              causation_id: str | None = None, derived: tuple[str, SourceEvent, Rescore | None] | None = None,
              demonstration: Demonstration | None = None) -> RolloutScored:
    """``derived``: a derived run's (own run id, the source Rollout's place on the log, its re-scoring).
    ``demonstration``: the rollout's source self-distills (opsd): its demonstration text goes with the score."""
    run_id, source, rescore = derived if derived is not None else (rollout.run_id, None, None)
    return RolloutScored(
        run_id=run_id, producer=producer, source=source, causation_id=causation_id or rollout.event_id,
        rollout_id=rollout.rollout_id, group_id=rollout.group_id, root_group_id=rollout.root_group_id,
        group_size=rollout.group_size, environment=rollout.environment, example_id=rollout.example_id,
        parent_rollout_id=rollout.parent_rollout_id, status=rollout.status, rewards=verdict.rewards,
        metrics=verdict.metrics, verifier=verdict.verifier or "verifier",
        verifier_version=VERIFIER_VERSION + (f"+{rescore.version()}" if rescore is not None else ""),
        trainable_steps=trainable_steps(steps) if rollout.status != "failed" else [], evaluation=rollout.evaluation,
        train_source=rollout.train_source,
        demonstration=demonstration.text_in(rollout.artifacts) if demonstration is not None else None)
