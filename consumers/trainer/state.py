"""The trainer's training states on disk (weights and optimizer moments of a revision, beside its checkpoint),
written in the background one at a time, and what a checkpoint folder holds by revision (what pruning reads)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TRAINING_STATE_SUFFIX = ".train"
"""``<checkpoint stem>.train/`` beside the checkpoints: a revision's training state (``ReferenceTrainer``), a
torch.distributed.checkpoint folder (each rank writes its own shards; it loads on any number of ranks)."""
LEGACY_TRAINING_STATE_SUFFIX = ".train.pt"
"""What the training state was before it was sharded: one ``torch.save`` file, still read."""


def state_write_path(folder: Path, family: str, revision: int) -> Path:
    """Where a training state is written before it is renamed to its place (hidden: not a checkpoint)."""
    from policy.checkpoint import checkpoint_stem

    return folder / f".{checkpoint_stem(family, revision)}.train.tmp{os.getpid()}"


def revision_files(folder: Path, family: str) -> list[tuple[int, str, Path]]:
    """The family's files in a checkpoint folder, by revision and kind: ``checkpoint`` (a ``.pt`` file or an HF
    folder), ``state`` (a training state), ``writing`` (a checkpoint write never renamed into place) and
    ``writing-state`` (a training state's; before they named their family, ``.train-r<N>.tmp<pid>``)."""
    from schemas.policy import family_slug

    stem = re.escape(family_slug(family)) + r"-r(\d{6})"
    kinds = [("checkpoint", rf"{stem}-[0-9a-f]{{12}}(?:\.pt)?"),
             ("state", rf"{stem}-[0-9a-f]{{12}}(?:{re.escape(TRAINING_STATE_SUFFIX)}|"
                       rf"{re.escape(LEGACY_TRAINING_STATE_SUFFIX)})"),
             ("writing", rf"{stem}\.tmp\d+"),
             ("writing-state", rf"\.{stem}\.train\.tmp\d+|\.train-r(\d+)\.tmp\d+")]
    patterns = [(kind, re.compile(p)) for kind, p in kinds]
    out = []
    for path in folder.iterdir():
        for kind, pattern in patterns:
            if m := pattern.fullmatch(path.name):
                out.append((int(next(g for g in m.groups() if g is not None)), kind, path))
                break
    return out


STATE_WRITER = ThreadPoolExecutor(1, thread_name_prefix="training-state")
"""Training states are written here, one at a time, while the trainer goes on (``ReferenceTrainer``)."""


def wait_for_training_states() -> None:
    """Every training state this process started writing is on the disk (or failed): before anything removes or
    copies them. Its worker thread is joined at exit, so a process that ends leaves no half-written one."""
    STATE_WRITER.submit(lambda: None).result()
