"""Reward functions as a user ships them, imported by name (a rubric's ``module:function``): one with the bug
the derived run fixes (tests/test_derive.py), and the fix. The sum asked is in the prompt ("a+b=")."""

import re


def _said(completion) -> int | None:
    found = re.findall(r"-?\d+", completion[-1]["content"])
    return int(found[-1]) if found else None


def _sum(prompt) -> int:
    a, b = map(int, re.findall(r"\d+", prompt[-1]["content"])[:2])
    return a + b


def buggy_sum(prompt, completion) -> float:
    """The bug: an off-by-one comparison rewards the answers one above the sum, never the sum itself."""
    return float(_said(completion) == _sum(prompt) + 1)


def fixed_sum(prompt, completion) -> float:
    return float(_said(completion) == _sum(prompt))
