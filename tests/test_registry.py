"""A new service over existing topics is one task module and one registry entry: this module is the task
module of a fifth service (``reward-gate``: dead-letters scored rollouts whose reward is below a floor), and
one ``SERVICES`` entry makes it a `rollout serve` command with its own flags, a `rollout status` row, an
AsyncAPI entry and a service that runs exactly-once on the broker like the others."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from consumers import testing
from consumers.registry import SERVICES
from consumers.service import Service, TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.events import DeadLetter, RolloutScored
from streams import topics
from streams.partition_task import Out

ROOT = Path(__file__).resolve().parents[1]


class RewardGateTask(TaskDefaults):  # buffers nothing, keeps no state
    def __init__(self, partition: int, cfg: ServiceSettings) -> None:
        self.floor = cfg.flush_after_s  # borrowed setting: a real service would add its own field

    async def process(self, rec: Any) -> list[Out]:
        scored = decode(rec, RolloutScored)
        low = {m: r for m, r in scored.rewards.items() if r < self.floor}
        return [dead_letter(rec, "reward-gate", "LowReward", f"rewards {low}", scored.run_id)] if low else []


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    yield lambda p: RewardGateTask(p, cfg)


GATE = Service("reward-gate", "dead-letter scored rollouts below a reward floor", inputs=(topics.SCORES,),
               outputs=(topics.DEAD_LETTERS,), wiring=f"{__name__}:wiring", options=("flush_after_s",))


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(SERVICES, GATE.name, GATE)
    return GATE


def test_the_cli_and_asyncapi_derive_the_new_service(registered, capsys, tmp_path):
    from rollout.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "reward-gate", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "--flush-after-s" in help_text and "--lr" not in help_text and "reward floor" in help_text
    assert f"Consumer group {topics.group_id('reward-gate')}" in " ".join(help_text.split())
    # the AsyncAPI app is built from the registry when imported: a module that adds the entry first
    (tmp_path / "gated.py").write_text(
        f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
        "import test_registry\nfrom consumers.registry import SERVICES\n"
        "SERVICES[test_registry.GATE.name] = test_registry.GATE\nfrom consumers.asyncapi import app  # noqa: E402\n")
    faststream = Path(sys.executable).with_name("faststream")
    out = subprocess.run([str(faststream), "docs", "gen", "gated:app", "--yaml", "--app-dir", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    spec = (tmp_path / "asyncapi.yaml").read_text()
    assert "reward-gate:scores" in spec and "reward-gate:dead-letters" in spec


@pytest.mark.integration
async def test_the_new_service_runs_and_reports_lag(registered, kafka_settings, monkeypatch):
    from consumers.runner import System
    from consumers.status import service_lag
    from tests.test_eos_pipeline import read_all

    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"reg{uuid.uuid4().hex[:8]}.")
    kw = kafka_settings.client_kwargs()
    await topics.create_topics(kw)
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(**kw)
    await prod.start()
    sent = 0
    from consumers import scoring

    for g in range(4):
        for steps, ro in testing.arithmetic_group(f"gate{g}", 4):
            scored = scoring.to_scored(ro, steps, await scoring.score(ro, steps), producer="test")
            await prod.send_and_wait(topics.SCORES.name, codec.encode(scored), key=ro.root_group_id.encode())
            sent += scored.rewards["solver"] < 0.5
    await prod.stop()
    async with System(["reward-gate"], ServiceSettings(flush_after_s=0.5), kw):
        raw = await read_all(kw, topics.DEAD_LETTERS.name, until=lambda rs: len(rs) >= sent, timeout_s=60)
        await asyncio.sleep(1.0)
        lag = {r["service"]: r for r in await service_lag(kw, sample_s=0.2)}
    letters = [codec.decode(r.value, DeadLetter) for r in raw]
    assert sent > 0 and len(letters) == sent and {d.error_type for d in letters} == {"LowReward"}
    assert lag["reward-gate"]["lag"] == 0 and lag["reward-gate"]["committed"] == 16


def test_the_batcher_is_granted_the_dead_letters_its_dropped_batch_count_follows():
    """``DroppedBatches`` reads the dead letters in the batcher: a side input of its declaration, so ``rollout
    kafka acls`` grants READ on it (without it, on a secured cluster, the count stayed 0 and a derived run
    stalled)."""
    from streams.security import Acl, service_acls

    assert Acl("User:batcher", "READ", "TOPIC", topics.DEAD_LETTERS.name) in service_acls(SERVICES["batcher"])


async def test_a_side_input_that_stopped_reading_ends_its_service_loudly():
    """A side input's follow task that died (here: its consumer refused, as a missing READ permission is) makes
    ``check`` raise ``ProcessMustRestart``: the batcher's tick ends the service with the reason (it once counted on
    with what it had seen, and a derived run stalled)."""
    from streams.poison import ProcessMustRestart
    from streams.revisions import DroppedBatches

    async def refused(_see):
        raise PermissionError("TopicAuthorizationFailedError: dead-letters")

    dropped = DroppedBatches({})
    dropped.check()  # not started: nothing to say
    dropped._task = asyncio.create_task(refused(dropped._see))
    await asyncio.gather(dropped._task, return_exceptions=True)
    with pytest.raises(ProcessMustRestart, match=r"dropped-batches side input stopped reading .*dead-letters.*"
                                                 r"PermissionError: TopicAuthorizationFailedError"):
        dropped.check()
