"""Reward functions named by a ScoringSpec (``"pkg.mod:fn"``): imported by name, and called with the keyword
arguments each declares under a timeout (a sync one in a thread, so a slow one never blocks the event loop).
The rubric verifier (``consumers.scoring``) weighs what they return; ``rollout derive --rubric`` imports them
up front, so a name that does not load stops a run before anything is written."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from typing import Any, Callable, Mapping


# Modules the log's scoring specs may name that have moved since (2026-12-05: producers split into rooms). A spec
# is part of an immutable event, so a run written before a move is still scored, derived and replayed.
MOVED_MODULES = {"producers.examples.": "producers.environments.examples.",
                 "producers.verifiers_v1:": "producers.environments.verifiers_v1:"}


def load_func(path: str) -> Callable[..., Any]:
    """The object ``path`` names: ``"module:attr"``, the attribute a dotted path inside the module."""
    for old, new in MOVED_MODULES.items():
        if path.startswith(old):
            path = new + path[len(old):]
    mod, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


async def call_func(fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout_s: float) -> float:
    """Call a reward function with the keyword arguments it declares (all of them if it takes **kwargs)."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        args = dict(kwargs)
    else:
        args = {k: v for k, v in kwargs.items() if k in sig.parameters}
    if inspect.iscoroutinefunction(fn):
        value = await asyncio.wait_for(fn(**args), timeout_s)
    else:
        value = await asyncio.wait_for(asyncio.to_thread(fn, **args), timeout_s)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, timeout_s)
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {value!r}")
    return out
