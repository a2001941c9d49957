"""Environments by name: what a plan's source names, loaded as an ``Environment`` (``producers.environments.types``:
a dataset of examples, an episode and a scoring spec, under ``name@version``).

    env = load_environment("producers.environments.examples.arithmetic:load_environment", num_examples=50)
    env.ref          # "arithmetic@1.1.0", recorded in every Rollout this environment produces

A plan's source names the environment (``environment_from_spec``):

* a short name of this project's examples (``arithmetic``, ``debate``, ``proposer-solver``: dashes become
  underscores, ``producers.environments.examples.<name>``) or ``"pkg.mod:load_environment"`` (or ``"pkg.mod"``): called with
  the source's ``args``;
* anything else is a verifiers environment id (a taskset id, an env id, a hub id ``owner/name@version``),
  resolved by verifiers' own loader from the source's env table (``producers.environments.verifiers_loader``).

A dataset is a list (or an ``ArtifactStore``: weighted sampling with replacement) or a ``TaskStream``: examples
drawn lazily from a stream that may never end, with bounded memory (``producers.environments.dataset``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from producers.environments.types import Environment
from producers.environments.types import EnvironmentUnavailable  # noqa: F401 - rollout/demo.py imports it from here


def _resolve(path: str) -> Callable[..., Environment]:
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, attr or "load_environment", None)
    if fn is None:
        raise ImportError(f"{module_name} has no {attr or 'load_environment'}")
    return fn


def load_environment(path: str, **args: Any) -> Environment:
    """Load ``package.module:load_environment`` (or a short example name) with keyword arguments."""
    candidates = [path]
    if ":" not in path and "." not in path:
        candidates.insert(0, f"producers.environments.examples.{path.replace('-', '_')}:load_environment")
    errors = []
    for cand in candidates:
        try:
            fn = _resolve(cand)
        except ImportError as e:
            errors.append(f"{cand}: {e}")
            continue
        env = fn(**args)
        if not isinstance(env, Environment):
            raise TypeError(f"{cand} returned {type(env).__name__}, not an Environment")
        return env
    raise ImportError(f"cannot load environment {path!r}: " + "; ".join(errors))


def is_own_environment(env_id: str) -> bool:
    """Whether ``env_id`` names this project's example environments or a ``module:function`` path."""
    if ":" in env_id:
        return True
    if "/" in env_id or "@" in env_id or "+" in env_id:
        return False  # a hub id or a verifiers env+taskset pairing
    name = env_id if "." in env_id else f"producers.environments.examples.{env_id.replace('-', '_')}"
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is not installed
        return False


def environment_from_spec(spec: Any) -> Environment:
    """An Environment from a plan's EnvSpec: one of ours by short name or module path, else a verifiers
    environment resolved from the source's env table (``producers.environments.verifiers_loader``)."""
    if is_own_environment(spec.id):
        return load_environment(spec.id, **dict(spec.args or {}))
    from producers.environments.verifiers_loader import load_source  # the verifiers adapter: imported for its sources only

    return load_source(spec)
