"""Argument types the sub-commands share: a count below its floor is refused by argparse, in one line naming the
flag, instead of running a job that admits nothing or loops for ever."""

from __future__ import annotations

import argparse
from typing import Callable


def at_least(floor: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        n = int(text)
        if n < floor:
            raise argparse.ArgumentTypeError(f"must be >= {floor}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse
