"""A reward function as slow as an LLM judge with a backlog: the verifier's work on one fetch outlasts the
consumer group's patience (tests/test_slow_processing.py imports it by name, as a rubric does)."""

import re
import time

SLOW_S = 0.5


def correct_sum(prompt, completion) -> float:
    time.sleep(SLOW_S)
    a, b = map(int, re.findall(r"\d+", prompt[-1]["content"])[:2])
    said = re.findall(r"-?\d+", completion[-1]["content"])
    return float(bool(said) and int(said[-1]) == a + b)
