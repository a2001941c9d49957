"""A package's public names imported on first use (PEP 562), so that importing one light submodule
(``schemas.policy`` for a constant, ``schemas.plan`` for a recipe) does not load every model of the package."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``where[name]`` (a submodule) when ``name`` is first
    read, and keeps the value in the package (later reads do not call it again)."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
