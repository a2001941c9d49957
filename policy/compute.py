"""The one thread a process runs its torch work on (off the event loop, whose heartbeats keep the process's
services in their consumer groups).

Not asyncio's default executor: libgomp gives every thread that starts a parallel region its own OpenMP team and
keeps it while the thread lives, and once a process holds more of its threads than it has cores, every team's
workers stop spinning between regions and sleep (``GOMP_SPINCOUNT``'s throttled count), to be woken for each of the
thousands of small regions of a step. One more live team made the demo's batch train 15% slower, measured alone
(benchmarks/RESULTS.md). glibc's heap arenas are per thread as well.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

COMPUTE = ThreadPoolExecutor(1, thread_name_prefix="torch")


async def computed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``COMPUTE``."""
    return await asyncio.get_running_loop().run_in_executor(COMPUTE, functools.partial(fn, *args, **kwargs))
