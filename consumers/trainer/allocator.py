"""tcmalloc under the process that trains, where the machine has it.

An optimizer pass on a CPU allocates and frees gigabytes of tensors (the head's logits chunk, activations,
gradients). glibc's malloc maps every block over 32 MB, and trims smaller ones, straight back to the kernel, so the
next pass faults fresh zeroed pages in: on the demo's step 440,000 page faults (1.7 GB) and 0.8-1.2 s of kernel CPU
a pass, on 2 cores. tcmalloc keeps freed pages for reuse: ~2,000 faults a pass, and the pass 1.1-1.3 s instead of
1.9-2.1 s (benchmarks/RESULTS.md, issue 53). PyTorch's CPU performance guide recommends it for the same reason.

The allocator is chosen when a process starts (``LD_PRELOAD``), so a command that trains starts itself again under
it, once, before it does anything (``reexec``). Its children (vLLM, the arena, harnesses) get the ``LD_PRELOAD`` the
command was started with: vLLM with tcmalloc was measured within noise, and the rest allocate little.
``ROLLOUT_ALLOCATOR=system`` keeps glibc's. Without the library (Debian's ``libtcmalloc-minimal4``, which
``.ci/setup`` installs) the command runs on glibc's allocator, as before.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

ENV = "ROLLOUT_ALLOCATOR"  # "tcmalloc" (the default where the library is found) or "system"
_BEFORE = "_ROLLOUT_LD_PRELOAD_BEFORE"  # set across the exec: the LD_PRELOAD the children get back
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def library() -> str | None:
    """The path of a tcmalloc shared library on this machine, or None."""
    for d in _DIRS:
        for name in _NAMES:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found  # a bare soname the loader resolves, or None


def in_use() -> bool:
    """Whether this process runs on tcmalloc (it is mapped into it)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libtcmalloc" in line for line in maps)
    except OSError:
        return False


def name() -> str:
    """The malloc this process runs on, as the benchmarks report it: "tcmalloc" or "glibc"."""
    return "tcmalloc" if in_use() else "glibc"


def preload(current: str | None) -> str | None:
    """``LD_PRELOAD`` with tcmalloc put first, before ``current`` (a user's own preloads), or None without the
    library."""
    lib = library()
    if lib is None:
        return None
    return f"{lib}:{current}" if current else lib


def reexec() -> None:
    """Start this command again with tcmalloc preloaded, unless it already runs on it, ``ROLLOUT_ALLOCATOR=system``
    says not to, or the library is missing. Call it before the command does anything: it does not return when it
    starts the command again. In the started process it only hands the children their ``LD_PRELOAD`` back."""
    if _BEFORE in os.environ:  # the command started again (whether or not the loader could preload the library)
        before = os.environ.pop(_BEFORE)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if os.environ.get(ENV, "tcmalloc").strip().lower() == "system" or in_use():
        return
    before = os.environ.get("LD_PRELOAD", "")
    preloaded = preload(before)
    if preloaded is None:
        return
    os.environ[_BEFORE] = before
    os.environ["LD_PRELOAD"] = preloaded
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
