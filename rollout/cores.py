"""Who computes on which cores when vLLM and the trainer share one machine's CPUs (``rollout demo``, ``rollout rl``).

Both run OpenMP thread pools. Sized to every core each, they oversubscribe the machine: a pool that waits for
its slowest thread waits for one the other pool took the core from, and both slow down far more than half
(benchmarks/RESULTS.md, "cores"). So the loop gives each its own cores: vLLM binds its threads to one part
(``VLLM_CPU_OMP_THREADS_BIND``), and the process that trains (the services, the trainer, and the arena it starts)
is pinned to the rest with as many torch threads. Generation of the next batch and training of the current one
still overlap, each on its own cores. On one core there is nothing to split: both keep it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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


def _ranges(cores: tuple[int, ...]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
