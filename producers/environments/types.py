"""What an environment is: a dataset of examples, an episode (the harness) and a scoring spec, under
``name@version`` (``Environment``), and ``EnvironmentUnavailable``, the one-line error of one that cannot be loaded
or run here. Loading one by name is ``producers.environments.loader``'s.

    env.ref          # "arithmetic@1.1.0", recorded in every Rollout this environment produces
    env.store        # ArtifactStore of the examples (weighted seed sampling), or a TaskStream
    env.scoring_for(example, state)   # schemas.scoring.ScoringSpec written to Rollout.artifacts["scoring"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from producers.environments.dataset import ArtifactStore, Example, TaskStream
from schemas.events import ENV_REF
from schemas.scoring import ScoringSpec

if TYPE_CHECKING:
    from producers.environments.episodes import Episode, EpisodeState


class EnvironmentUnavailable(Exception):
    """An environment a plan names that cannot be loaded or run here; the message is one line that says what
    to do (install a package, change a harness), and the CLI prints it without a traceback."""


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
