"""Plain Python functions as OpenAI-style tools: schemas from type hints and docstrings, dispatch.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first addend
            b: the second addend
        '''
    tool_schema(add) == {"type": "function", "function": {"name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first addend"},
        ...}, "required": ["a", "b"], "additionalProperties": False}}}

Parameters with defaults are optional; ``Optional[X]``/``X | None``, ``list[X]``, ``dict``, ``Literal``,
``Enum`` and pydantic-able types are mapped through a pydantic TypeAdapter. Parameters listed in
``hidden`` (state injected by a StatefulToolEpisode, e.g. a sandbox handle) are left out of the schema.
Docstring ``Args:`` sections in Google style (``name: text`` or ``name (type): text``) and Sphinx
``:param name: text`` lines supply parameter descriptions.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import TypeAdapter

_GOOGLE_ARG = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^\s*:param\s+(?:\w+\s+)?(\w+)\s*:\s*(.*)$")
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google- or Sphinx-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            section, current = m.group(1).lower(), None
            continue
        sm = _SPHINX_ARG.match(line)
        if sm:
            current = sm.group(1)
            params[current] = sm.group(2).strip()
            section = "args"
            continue
        if line.strip().startswith(":return") or line.strip().startswith(":rtype"):
            section, current = "returns", None
            continue
        if section in ("args", "arguments", "parameters"):
            gm = _GOOGLE_ARG.match(line)
            if gm and (len(line) - len(line.lstrip())) <= 4:
                current = gm.group(1).lstrip("*")
                params[current] = gm.group(2).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
        elif section is None:
            desc.append(line)
    description = " ".join(p.strip() for p in "\n".join(desc).strip().split("\n\n")[0].splitlines()).strip()
    return description, params


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def tool_schema(fn: Callable[..., Any], *, hidden: Iterable[str] = (), name: str | None = None) -> dict[str, Any]:
    """The OpenAI ``tools`` entry for ``fn``."""
    hidden = set(hidden)
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to raw ones
        hints = {k: p.annotation for k, p in sig.parameters.items()}
    description, docs = parse_docstring(fn.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in sig.parameters.items():
        if pname in hidden or pname in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = hints.get(pname, p.annotation)
        if ann is inspect.Parameter.empty:
            prop: dict[str, Any] = {"type": "string"}
        else:
            prop = _strip_titles(TypeAdapter(ann).json_schema())
            if "$defs" in prop:  # keep nested models self-contained
                prop = _inline_refs(prop)
        if pname in docs:
            prop["description"] = docs[pname]
        if p.default is not inspect.Parameter.empty:
            try:
                json.dumps(p.default)
                prop["default"] = p.default
            except TypeError:
                pass
        else:
            required.append(pname)
        properties[pname] = prop
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    defs = schema.pop("$defs", {})

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "$ref" in x and x["$ref"].startswith("#/$defs/"):
                return walk(defs[x["$ref"].split("/")[-1]])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(schema)


class ToolError(Exception):
    """A tool call that could not be dispatched (unknown tool, bad JSON, wrong arguments)."""


class ToolRegistry:
    """Functions by name, with their schemas; ``call`` parses the model's JSON and dispatches."""

    def __init__(self, tools: Iterable[Callable[..., Any]] = (), hidden: Iterable[str] = ()) -> None:
        self.hidden = set(hidden)
        self.functions: dict[str, Callable[..., Any]] = {}
        for fn in tools:
            self.add(fn)

    def add(self, fn: Callable[..., Any], name: str | None = None) -> None:
        self.functions[name or fn.__name__] = fn

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(fn, hidden=self.hidden, name=n) for n, fn in self.functions.items()]

    def parse_arguments(self, name: str, arguments: str) -> dict[str, Any]:
        if name not in self.functions:
            raise ToolError(f"unknown tool {name!r}; available: {sorted(self.functions)}")
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolError(f"arguments of {name} are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ToolError(f"arguments of {name} must be a JSON object")
        return args

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Run the tool (sync ones in a thread); the result as the text fed back to the model."""
        fn = self.functions.get(name)
        if fn is None:
            raise ToolError(f"unknown tool {name!r}; available: {sorted(self.functions)}")
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            raise ToolError(f"bad arguments for {name}: {e}") from None
        if inspect.iscoroutinefunction(fn):
            result = await fn(**args)
        else:
            result = await asyncio.to_thread(fn, **args)
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result)
        except TypeError:
            return str(result)
