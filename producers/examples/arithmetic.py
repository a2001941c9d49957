"""Single-turn arithmetic with exact-match answers (``arithmetic@1.0.0``).

Artifacts the verifier needs: ``scoring = {"kind": "exact_match", "answer": "<int>", "params":
{"member": "solver", "extract": "last_integer"}}`` (compare the last integer in the solver's final
message with ``answer``), plus ``final_text`` / ``final_by_member``.
"""

from __future__ import annotations

import random

from producers.environment import Environment, Example
from producers.episodes import SingleTurnEpisode
from schemas.scoring import ScoringSpec

VERSION = "1.0.0"
SYSTEM = "You are a careful calculator. Reply with the number only."


def make_dataset(num_examples: int = 200, max_operand: int = 20, seed: int = 0, ops: str = "+-") -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(num_examples):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Example(id=f"arith-{seed}-{i}", prompt=f"What is {a} {op} {b}?", answer=str(answer),
                           info={"a": a, "b": b, "op": op}))
    return out


def scoring(example: Example, state=None) -> ScoringSpec:
    return ScoringSpec(kind="exact_match", answer=example.answer, params={"member": "solver", "extract": "last_integer"})


def load_environment(num_examples: int = 200, max_operand: int = 20, seed: int = 0, ops: str = "+-",
                     system_prompt: str = SYSTEM) -> Environment:
    return Environment(name="arithmetic", version=VERSION,
                       dataset=make_dataset(num_examples, max_operand, seed, ops),
                       episode=SingleTurnEpisode(system_prompt=system_prompt, member="solver"), scoring=scoring,
                       description="single-turn arithmetic, exact match")
