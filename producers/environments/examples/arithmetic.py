"""Single-turn arithmetic (``arithmetic@1.1.0``), scored by exact match or by a shaped rubric.

* ``reward="exact"``: ``scoring = {"kind": "exact_match", "answer": "<int>", "params": {"member":
  "solver", "extract": "last_integer"}}`` (the last integer in the solver's final message vs ``answer``).
* ``reward="shaped"``: a rubric, ``exact_answer`` (1.0) + ``numeric_reply`` (0.5) + ``closeness``
  (0.5). An untrained model almost never says the right integer, so exact match alone gives GRPO
  all-zero groups and nothing to learn from; partial credit for answering with a number, and for a
  number near the answer, gives a small model a gradient it can climb in a few revisions. The
  exact-match part stays visible as its own metric (``solver/reward/exact_answer``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from producers.environments.dataset import Example
from producers.environments.types import Environment
from producers.environments.episodes import SingleTurnEpisode
from schemas.scoring import ScoringSpec, WeightedFunc

VERSION = "1.2.0"
SYSTEM = "You are a careful calculator. Reply with the number only."
_INT = re.compile(r"-?\d+")
SHAPED = [WeightedFunc(fn=f"{__name__}:exact_answer", weight=1.0),
          WeightedFunc(fn=f"{__name__}:numeric_reply", weight=0.5),
          WeightedFunc(fn=f"{__name__}:closeness", weight=0.5)]


def make_dataset(num_examples: int = 200, max_operand: int = 20, seed: int = 0, ops: str = "+-",
                 digits: Sequence[int] | None = None, question: str = "What is {a} {op} {b}?",
                 exclude: Iterable[str] = (), id_prefix: str = "arith") -> list[Example]:
    """``digits``: each question draws a digit count from it and operands with that many digits at most
    (e.g. ``[1, 2]`` mixes 1- and 2-digit sums, so a small model's GRPO groups hold right and wrong answers);
    without it operands are 0..max_operand. Prompts in ``exclude`` are never produced (a held-out set)."""
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Example] = []
    for _ in range(100 * num_examples + 1000):  # bounded: a small operand range cannot hang it
        if len(out) == num_examples:
            break
        hi = 10 ** rng.choice(list(digits)) - 1 if digits else max_operand
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        prompt = question.format(a=a, b=b, op=op)
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Example(id=f"{id_prefix}-{seed}-{len(out)}", prompt=prompt, answer=str(answer),
                           info={"a": a, "b": b, "op": op}))
    if len(out) < num_examples:
        raise ValueError(f"arithmetic: only {len(out)} distinct questions found for num_examples={num_examples} "
                         "(operands too small for that many, or all held out): lower num_examples or widen operands")
    return out


def _reply(completion: list[dict[str, Any]]) -> str:
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant").strip()


def exact_answer(completion: list[dict[str, Any]], answer: str) -> float:
    """1 when the reply's last integer is the answer."""
    nums = _INT.findall(_reply(completion))
    return 1.0 if nums and int(nums[-1]) == int(answer) else 0.0


def numeric_reply(completion: list[dict[str, Any]]) -> float:
    """The share of the reply's characters that are digits or a minus sign (1 for a bare integer)."""
    text = _reply(completion)
    return sum(c.isdigit() or c == "-" for c in text) / len(text) if text else 0.0


def closeness(completion: list[dict[str, Any]], answer: str) -> float:
    """1 / (1 + |last integer - answer|); 0 without an integer of at most 4 digits."""
    nums = [n for n in _INT.findall(_reply(completion)) if len(n.lstrip("-")) <= 4]
    return 1.0 / (1.0 + abs(int(nums[-1]) - int(answer))) if nums else 0.0


def load_environment(num_examples: int = 200, max_operand: int = 20, seed: int = 0, ops: str = "+-",
                     system_prompt: str | None = SYSTEM, reward: Literal["exact", "shaped"] = "exact",
                     digits: Sequence[int] | None = None, question: str = "What is {a} {op} {b}?",
                     eval_examples: int = 0) -> Environment:
    """``eval_examples``: a held-out set of that many questions (none of them in the training set), answered
    at each revision by the arena's evaluation."""
    if reward not in ("exact", "shaped"):
        raise ValueError(f"arithmetic: reward must be 'exact' or 'shaped', got {reward!r}")

    def scoring(example: Example, state: Any = None) -> ScoringSpec:
        if reward == "shaped":
            return ScoringSpec(kind="rubric", answer=example.answer, funcs=SHAPED)
        return ScoringSpec(kind="exact_match", answer=example.answer,
                           params={"member": "solver", "extract": "last_integer"})

    train = make_dataset(num_examples, max_operand, seed, ops, digits, question)
    held_out = make_dataset(eval_examples, max_operand, seed + 1, ops, digits, question,
                            exclude=[e.prompt for e in train], id_prefix="arith-eval") if eval_examples else []
    return Environment(name="arithmetic", version=VERSION, dataset=train, eval_dataset=held_out,
                       episode=SingleTurnEpisode(system_prompt=system_prompt, member="solver"), scoring=scoring,
                       description=f"single-turn arithmetic, {reward} reward")
