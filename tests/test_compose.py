"""compose.yaml stays valid, its Kafka service is configured like the test fixture's broker, and every
pipeline service's command, exactly as compose.yaml writes it, starts against the test broker and closes the
loop (Rollouts -> ... -> a trained PolicyRevision), then stops cleanly on SIGTERM as `docker compose stop` asks."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from consumers.registry import SERVICES
from streams.local_broker import free_port

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = (*SERVICES, "arena")  # every registered service must be in compose.yaml


def _compose_cmd() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed: run `bash .ci/setup`", pytrace=False)


def _config(env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([*_compose_cmd(), "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_compose_file_is_valid():
    rendered = _config()
    services = yaml.safe_load(rendered)["services"]
    assert services["topics"]["command"] == ["rollout", "topics", "create"]
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in SERVICES:
        assert services[name]["command"][:3] == ["rollout", "serve", name], name
    for name in PIPELINE:
        svc = services[name]
        assert svc["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        assert svc["environment"]["ROLLOUT_BOOTSTRAP_SERVERS"] == "kafka:19092"
    assert any(v.endswith(":/data/checkpoints:rw") or v.endswith(":/data/checkpoints")
               for v in map(str, services["trainer"]["volumes"]))


def _local(command: list[str], ckdir: Path) -> list[str]:
    """A compose command run here: `rollout` from this checkout, the checkpoint volume a temp dir, and a
    free port for the arena's in-process policy server (8000 may be taken on a shared machine)."""
    out = [sys.executable, "-m", "rollout.cli", *command[1:]] if command[0] == "rollout" else list(command)
    out = [str(ckdir) if a == "/data/checkpoints" else a for a in out]
    if "--policy-port" in out:
        out[out.index("--policy-port") + 1] = str(free_port())
    return out


@pytest.mark.integration
def test_every_compose_service_starts_and_the_loop_closes(kafka_bootstrap, tmp_path, monkeypatch):
    from streams.revisions import latest_revision
    from streams.config import KafkaSettings

    prefix = f"compose-{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)  # this process reads the revisions topic too
    services = yaml.safe_load(_config({**os.environ, "ROLLOUT_TOPIC_PREFIX": prefix}))["services"]
    ckdir = tmp_path / "checkpoints"
    logs = {name: (tmp_path / f"{name}.log") for name in ("topics", *PIPELINE)}

    def env_of(name: str) -> dict[str, str]:
        env = {**os.environ, **{k: str(v) for k, v in services[name].get("environment", {}).items()}}
        env.update(ROLLOUT_BOOTSTRAP_SERVERS=kafka_bootstrap, ROLLOUT_STALL_S="120")
        assert env["ROLLOUT_TOPIC_PREFIX"] == prefix
        return env

    topics = subprocess.run(_local(services["topics"]["command"], ckdir), cwd=ROOT, env=env_of("topics"),
                            capture_output=True, text=True, timeout=120)
    assert topics.returncode == 0, topics.stdout + topics.stderr
    procs = {name: subprocess.Popen(_local(services[name]["command"], ckdir), cwd=ROOT, env=env_of(name),
                                    stdout=logs[name].open("w"), stderr=subprocess.STDOUT)
             for name in PIPELINE}
    kw = KafkaSettings.from_env().with_bootstrap(kafka_bootstrap).client_kwargs()
    try:
        deadline, revision = time.monotonic() + 240, None
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not dead, f"exited early: {dead}\n" + "\n".join(
                f"--- {n}\n{logs[n].read_text()[-2000:]}" for n in dead)
            revision = asyncio.run(latest_revision(kw, "tiny-byte-lm"))
            if revision is not None and revision.revision >= 1:
                break
            time.sleep(2)
        assert revision is not None and revision.revision >= 1, "no trained revision: " + "\n".join(
            f"--- {n}\n{logs[n].read_text()[-1500:]}" for n in PIPELINE)
        assert revision.checkpoint is not None and (ckdir / Path(revision.checkpoint.uri).name).exists()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(timeout=40)  # compose.yaml's stop_grace_period
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = "killed after 40 s"
    assert codes == {name: 0 for name in PIPELINE}, codes
    for name in ("verifier", "credit", "batcher", "trainer"):
        text = logs[name].read_text()
        assert '"service started"' in text.replace("'", '"') or "service started" in text, text[-1500:]
        assert "service stopped" in text, text[-1500:]


def test_compose_vllm_profile_commands_are_valid():
    """The `vllm` profile (real vLLM + an arena driving it) renders, and its commands parse as written."""
    proc = subprocess.run([*_compose_cmd(), "-f", str(ROOT / "compose.yaml"), "--profile", "vllm", "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    from rollout.cli import build_parser

    vllm = build_parser().parse_args(services["vllm"]["command"][1:])
    arena = build_parser().parse_args(services["arena-vllm"]["command"][1:])
    assert (vllm.service, vllm.host, vllm.port) == ("vllm", "0.0.0.0", 8000)
    from rollout.arena_cmd import policy_urls

    assert arena.policy == "vllm" and policy_urls(arena) == ["http://vllm:8000/v1"] and arena.evaluate
    assert services["arena-vllm"]["depends_on"]["vllm"]["condition"] == "service_healthy"
    # the default stack stays the tiny loop: both only start with --profile vllm
    assert services["vllm"]["profiles"] == services["arena-vllm"]["profiles"] == ["vllm"]


def test_compose_monitoring_profile_scrapes_every_process():
    """The `monitoring` profile (Prometheus, Grafana, `rollout dashboard`) renders, and Prometheus scrapes each
    process on the port streams.metrics gives it from the environment compose sets."""
    from rollout.cli import build_parser
    from streams import metrics

    proc = subprocess.run([*_compose_cmd(), "-f", str(ROOT / "compose.yaml"), "--profile", "monitoring", "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert {"prometheus", "grafana", "dashboard"} <= set(services)
    base = int(services["verifier"]["environment"]["ROLLOUT_METRICS_PORT"])
    expected = {f"{name}:{base + metrics.SERVICE_OFFSET + i}" for i, name in enumerate(SERVICES)}
    expected |= {f"arena:{base + metrics.OFFSETS['arena']}", f"arena-vllm:{base + metrics.OFFSETS['arena']}",
                 f"vllm:{base + metrics.OFFSETS['vllm']}", "vllm:8000"}
    scrape = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == expected
    dash = build_parser().parse_args(services["dashboard"]["command"][1:])
    assert (dash.host, dash.port) == ("0.0.0.0", 8050)
    assert all(services[s]["profiles"] == ["monitoring"] for s in ("prometheus", "grafana", "dashboard"))
