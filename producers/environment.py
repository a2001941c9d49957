"""Environments: a dataset of examples, an episode (the harness) and a scoring spec, under ``name@version``.

    env = load_environment("producers.examples.arithmetic:load_environment", num_examples=50)
    env.ref          # "arithmetic@1.1.0", recorded in every Rollout this environment produces
    env.store        # ArtifactStore of the examples (weighted seed sampling)
    env.scoring_for(example, state)   # schemas.scoring.ScoringSpec written to Rollout.artifacts["scoring"]

A plan's source names the environment (``environment_from_spec``):

* a short name of this project's examples (``arithmetic``, ``debate``, ``proposer-solver``: dashes become
  underscores, ``producers.examples.<name>``) or ``"pkg.mod:load_environment"`` (or ``"pkg.mod"``): called with
  the source's ``args``;
* anything else is a verifiers environment id (a taskset id, an env id, a hub id ``owner/name@version``),
  resolved by verifiers' own loader from the source's env table (``producers.verifiers_loader``).

A dataset is a list (or an ``ArtifactStore``: weighted sampling with replacement) or a ``TaskStream``: examples
drawn lazily from a stream that may never end, with bounded memory.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas.events import ENV_REF
from schemas.scoring import ScoringSpec

if TYPE_CHECKING:
    from producers.episodes import Episode, EpisodeState


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


class EnvironmentUnavailable(Exception):
    """An environment a plan names that cannot be loaded or run here; the message is one line that says what
    to do (install a package, change a harness), and the CLI prints it without a traceback."""


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


ScoringFor = ScoringSpec | Callable[[Example, "EpisodeState"], ScoringSpec]


@dataclass
class Environment:
    name: str
    version: str
    dataset: Sequence[Example] | ArtifactStore | TaskStream
    episode: Episode
    scoring: ScoringFor
    sampling: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    # held-out questions, never sampled for training: the arena answers them at each revision (evaluation)
    eval_dataset: Sequence[Example] = ()
    store: ArtifactStore | TaskStream = field(init=False)

    def __post_init__(self) -> None:
        self.store = self.dataset if isinstance(self.dataset, (ArtifactStore, TaskStream)) \
            else ArtifactStore(self.dataset)
        if not ENV_REF.match(self.ref):
            raise ValueError(f"environment reference {self.ref!r} must look like name@version")
        if len(self.store) == 0:
            raise ValueError(f"environment {self.ref} has an empty dataset")
        if isinstance(self.store, TaskStream):
            return  # a stream is never read whole; held-out examples are a separate, named set
        overlap = {e.id for e in self.eval_dataset} & {e.id for e in self.store}
        if overlap:
            raise ValueError(f"environment {self.ref}: eval examples {sorted(overlap)[:5]} are also training examples")

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def scoring_for(self, example: Example, state: EpisodeState) -> ScoringSpec:
        return self.scoring(example, state) if callable(self.scoring) else self.scoring


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
        candidates.insert(0, f"producers.examples.{path.replace('-', '_')}:load_environment")
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
    name = env_id if "." in env_id else f"producers.examples.{env_id.replace('-', '_')}"
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is not installed
        return False


def environment_from_spec(spec: Any) -> Environment:
    """An Environment from a plan's EnvSpec: one of ours by short name or module path, else a verifiers
    environment resolved from the source's env table (``producers.verifiers_loader``)."""
    if is_own_environment(spec.id):
        return load_environment(spec.id, **dict(spec.args or {}))
    from producers.verifiers_loader import load_source

    return load_source(spec)
