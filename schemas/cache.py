"""Where rollout-log keeps what it fetches and prepares on a machine (Kafka's jars, the prepared model, the
instances' files): one setting, ``ROLLOUT_CACHE_DIR``, that every room reads from here."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE_DIR") or Path.home() / ".cache" / "rollout-log")
