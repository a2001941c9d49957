"""Who computes on which cores when vLLM and the trainer share one machine's CPUs (``rollout demo``, ``rollout rl``).

Both run OpenMP thread pools. Sized to every core each and running at once, they oversubscribe the machine. Three
ways out, ``--cores``:

* ``turns`` (the default below ``SPLIT_FROM`` cores, for plans whose rollouts yield one record each): both keep
  every core and never run at once: the run's
  off-policy bound is 0 (stricter than any plan's), so the arena generates a batch only once the revision it
  trains is published, and the trainer trains while the arena waits. On the 2-core machine this was the fastest
  (benchmarks/RESULTS.md, "cores"): a trainer step of 9.3 s instead of 13.4 (shared) or 13.8 (split). What waits
  meanwhile, the local broker and the arena, steps back to ``BACKGROUND_NICE`` so it does not preempt the trainer.
* ``split`` (the default from ``SPLIT_FROM`` cores): each its own half: vLLM binds its threads to one part
  (``VLLM_CPU_OMP_THREADS_BIND``), and the process that trains (services, trainer, the arena it starts) is pinned
  to the rest with as many torch threads; generation of the next batch overlaps training, with the plan's bound.
* ``shared``: both on every core at once, with the plan's bound (what the loop did before; ``auto`` below
  ``SPLIT_FROM`` cores for a plan with seats, routed members or a verifiers env, see ``choose``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from schemas.plan import GenerationPlan


MODES = ("auto", "turns", "split", "shared")
SPLIT_FROM = 4
"""From this many usable cores ``auto`` splits them; below, generation and training take turns."""


def choose(mode: str, plan: GenerationPlan, cores: set[int] | None = None) -> str:
    """The mode ``auto`` stands for on this machine and plan; any other mode as it is. Below ``SPLIT_FROM`` cores
    ``auto`` takes turns only when each rollout yields one training record (one trainable member, no seats, no
    routed members, no verifiers env, whose seats and turns are its own): until a rollout is counted the admission
    ledger counts one record a rollout, so with a bound of 0 a two-seat game's first groups filled batches 2 and 3
    with records one revision behind, refused (benchmarks/RESULTS.md). Such a plan shares the cores instead."""
    if mode != "auto":
        return mode
    if len(cores if cores is not None else os.sched_getaffinity(0)) >= SPLIT_FROM:
        return "split"
    return "turns" if plan.one_record_per_rollout else "shared"


@dataclass(frozen=True)
class CoreSplit:
    vllm: tuple[int, ...]
    trainer: tuple[int, ...]

    def __str__(self) -> str:
        return f"vLLM on cores {_ranges(self.vllm)}, the trainer on {_ranges(self.trainer)}"


def split_cores(cores: set[int] | None = None) -> CoreSplit | None:
    """Half the cores this process may use for each (vLLM the upper half, an odd one to the trainer); None with
    fewer than two."""
    usable = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(usable) < 2:
        return None
    half = (len(usable) + 1) // 2
    return CoreSplit(vllm=tuple(usable[half:]), trainer=tuple(usable[:half]))


def vllm_bind(split: CoreSplit) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for its cores: a comma-separated list of ranges."""
    return _ranges(split.vllm)


def pin_this_process(split: CoreSplit) -> None:
    """This process's threads (those running and those it starts, child processes too) on the trainer's cores,
    and torch's intra-op pool as large as they are."""
    cores = set(split.trainer)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    import torch

    torch.set_num_threads(len(cores))


BACKGROUND_NICE = 10
"""Where generation and training take turns, the processes off the trainer's path run at this nice value: the
local Kafka broker (its scheduling group, for the run) and the arena (in the trainer's group: it waits while the
trainer trains). Their 10-15% of a core (an idle broker alone takes ~10%) arrives as short wake-ups that preempt
one of torch's two OpenMP threads, and the other then waits at the next barrier. Measured (benchmarks/RESULTS.md,
"quiet neighbours"): the demo's trainer step 6.86/6.59 s -> 6.48/6.17 s, its wall time 303/280 s -> 284/277 s, in
two alternated pairs. At 19 the broker answered a metadata request too late once (the demo's drain failed)."""


def step_back(pid: int, nice: int = BACKGROUND_NICE) -> Callable[[], None]:
    """Run process ``pid`` at ``nice`` until the returned function is called. With the kernel's autogroups (a
    process started in a session of its own, as the local broker is, is weighed as one group against the others)
    the group's nice value is what counts, and an unprivileged user may put it back; without them each thread's
    nice value counts, and it stays until the process restarts (raising a priority again needs privileges).
    Best effort: a process that is gone or not ours is left as it is."""
    group = Path(f"/proc/{pid}/autogroup")
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
            before = int(group.read_text().split("nice")[1])
            group.write_text(str(nice))
            return lambda: _write(group, before)
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
    except (OSError, IndexError, ValueError):
        pass
    return lambda: None


def _write(path: Path, value: int) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        pass


def _ranges(cores: tuple[int, ...]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
