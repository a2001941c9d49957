"""Regenerate rlt_sum_quiz/data/{train,test}.jsonl deterministically.

    python tests/envs/rlt-sum-quiz/scripts/make_data.py

Draws 348 distinct (a, b) pairs of 1- and 2-digit numbers with a fixed seed: the
first 48 are the test split, the other 300 the train split (no pair is in both).
The files are committed; rerunning this rewrites them byte for byte.
"""

import json
import random
from pathlib import Path

SEED = 20260801
TEST, TRAIN = 48, 300
DATA = Path(__file__).resolve().parent.parent / "rlt_sum_quiz" / "data"


def row(a: int, b: int) -> dict:
    return {
        "id": f"sum-{a}-{b}",
        "a": a,
        "b": b,
        "prompt": f"What is {a} + {b}? Answer with a number.",
        "answer": a + b,
    }


def main() -> None:
    rng = random.Random(SEED)
    # Half the pairs draw each operand from 1..9 or 10..99 at random, so both
    # 1-digit and 2-digit additions (and mixes) appear in each split.
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < TEST + TRAIN:
        a = rng.randint(1, 9) if rng.random() < 0.4 else rng.randint(10, 99)
        b = rng.randint(1, 9) if rng.random() < 0.4 else rng.randint(10, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    DATA.mkdir(parents=True, exist_ok=True)
    for name, chunk in (("test", pairs[:TEST]), ("train", pairs[TEST:])):
        with open(DATA / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for a, b in chunk:
                f.write(json.dumps(row(a, b), sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
