"""compose.yaml stays valid, and its Kafka service is configured like the test fixture's broker."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compose_cmd() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed: run `bash .ci/setup`", pytrace=False)


def test_compose_file_is_valid():
    proc = subprocess.run([*_compose_cmd(), "-f", str(ROOT / "compose.yaml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = proc.stdout
    assert "- topics\n    - create" in rendered  # the topics service really runs `rollout topics create`
    assert "KAFKA_PROCESS_ROLES: broker,controller" in rendered
    assert "service_healthy" in rendered
