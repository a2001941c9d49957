"""The examples an environment draws from: ``Example`` (one dataset row), ``ArtifactStore`` (a weighted sampling
buffer, the default) and ``TaskStream`` (examples drawn lazily from a stream that may never end, with bounded
memory). Episodes see examples; an ``Environment`` (``producers.environments.types``) holds one of these."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One dataset row: a prompt (text, or chat messages), an optional answer, free metadata."""

    id: str
    prompt: str | list[dict[str, Any]]
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # what the episode runs, when it is more than the prompt (a verifiers Task); never serialized
    payload: Any = field(default=None, compare=False, repr=False)

    def seed_dict(self) -> dict[str, Any]:
        return {"example_id": self.id, "prompt": self.prompt, "answer": self.answer, "info": dict(self.info)}


class ArtifactStore:
    """A weighted sampling buffer of seeds (examples, proposed problems, few-shot items).

    ``sample(rng)`` draws an item with probability proportional to its weight; weights can be
    changed (``set_weight``) and items added while the arena runs (e.g. to up-weight hard ones).
    """

    def __init__(self, items: Iterable[Example] = (), weights: Iterable[float] | None = None) -> None:
        self._items: list[Example] = []
        self._weights: list[float] = []
        self._index: dict[str, int] = {}
        ws = list(weights) if weights is not None else None
        for i, item in enumerate(items):
            self.add(item, 1.0 if ws is None else ws[i])

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def add(self, item: Example, weight: float = 1.0) -> None:
        if weight < 0:
            raise ValueError("weights must be >= 0")
        if item.id in self._index:
            self._weights[self._index[item.id]] = weight
            self._items[self._index[item.id]] = item
            return
        self._index[item.id] = len(self._items)
        self._items.append(item)
        self._weights.append(float(weight))

    def set_weight(self, item_id: str, weight: float) -> None:
        if weight < 0:
            raise ValueError("weights must be >= 0")
        self._weights[self._index[item_id]] = float(weight)

    def weight(self, item_id: str) -> float:
        return self._weights[self._index[item_id]]

    def get(self, item_id: str) -> Example:
        return self._items[self._index[item_id]]

    def sample(self, rng: random.Random) -> Example:
        if not self._items or sum(self._weights) <= 0:
            raise ValueError("cannot sample from an empty artifact store (or one whose weights are all 0)")
        return rng.choices(self._items, weights=self._weights, k=1)[0]


class TaskStream:
    """Examples drawn lazily from a stream that may never end (a generated or endless taskset).

    A shuffle buffer of ``buffer`` examples is filled from the stream; each draw takes a seeded random one
    and the next example from the stream takes its place. Memory holds the buffer only, each example is
    drawn once per pass, and draws are reproducible for a seed. A finite stream starts a new pass when the
    buffer runs dry (prime-rl's standard sampler cycles through the taskset). The first fill happens here, so
    a stream that raises while loading fails at start-up, not mid-run.
    """

    def __init__(self, open_stream: Callable[[], Iterator[Example]], buffer: int = 256) -> None:
        if buffer < 1:
            raise ValueError("buffer must be >= 1")
        self._open, self.buffer = open_stream, buffer
        self._it: Iterator[Example] | None = open_stream()
        self._buf: list[Example] = []
        self.passes, self.drawn = 1, 0
        self._fill()
        if not self._buf:
            raise ValueError("the task stream yielded no task")

    def _fill(self) -> None:
        while self._it is not None and len(self._buf) < self.buffer:
            try:
                self._buf.append(next(self._it))
            except StopIteration:
                self._it = None
        if not self._buf and self.drawn:  # a finite stream, all drawn: the next pass
            self._it, self.passes = self._open(), self.passes + 1
            self._fill()

    def __len__(self) -> int:
        """Examples buffered now (a stream's length is unknown)."""
        return len(self._buf)

    def __iter__(self) -> Iterator[Example]:
        return iter(list(self._buf))

    def sample(self, rng: random.Random) -> Example:
        self._fill()
        i = rng.randrange(len(self._buf))
        ex, self._buf[i] = self._buf[i], self._buf[-1]
        self._buf.pop()
        self.drawn += 1
        return ex
