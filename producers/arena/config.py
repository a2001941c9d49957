"""The arena's settings, one frozen object: what a command line or a benchmark chooses. What the arena works with
(the emitter, the revision follower, the weight loader, the admissions ledger, loaded environments) is passed
beside it, not in it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producers.arena.limits import ADMISSION_LEASE_S, ROLLOUT_TIMEOUT_S


@dataclass(frozen=True)
class ArenaConfig:
    policy_base_url: str | Sequence[str] | None = None
    """The learner's server, or several (a pool: ``producers.inference.pool``), when the plan's learner names none."""
    concurrency: int = 32
    """Training rollouts in flight at most."""
    cores: int | None = None
    """The machine's cores, given where the arena is a process of its own (``rollout arena``): its process tree is
    then its episodes' and servers', so a start the recipe does not set is held to a few episodes a core until the
    episodes are known (``producers.arena.concurrency``). None: an arena inside another process (a test, a
    benchmark), whose tree holds processes that are not its episodes': not held."""
    eval_concurrency: int = 64
    """Held-out answers in flight at most, beside ``concurrency``: the demo's 48 questions in one wave, not two (at
    32 the last evaluation took 9.5 s where 48 at once take 5 s; benchmarks/RESULTS.md)."""
    progress: bool = False
    run_id: str | None = None
    """The run its events belong to (default: a new id)."""
    producer_name: str = "arena"
    """What its events say produced them."""
    arena_id: str | None = None
    """This arena among the run's many: its claims on the admissions ledger (default ``default_arena_id``)."""
    seed: int = 0
    base_revision: int | None = None
    """The revision it starts from (default 0)."""
    client_options: Mapping[str, Any] = field(default_factory=dict)
    """``InferenceClient`` options (retries, backoff, timeouts)."""
    evaluate: bool = False
    """Answer every environment's held-out set at the plan's cadence."""
    eval_sampling: Mapping[str, Any] | None = None
    """Sampling of held-out answers (default greedy: temperature 0)."""
    admission_lease_s: float = ADMISSION_LEASE_S
    max_failed_groups: int = 8
    """Stop (``RunFailing``) after this many training groups in a row whose every rollout failed (0: never)."""
    rollout_timeout_s: float = ROLLOUT_TIMEOUT_S
    """A rollout's deadline (its setup and episode, sub-episodes included; its cleanup gets as long again): one past
    it is recorded failed with that reason, so a hung tool call or sandbox cannot hold its group, and the batch that
    owes it, for ever (0: none)."""
