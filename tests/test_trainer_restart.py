"""The trainer as its own process, SIGKILLed mid-run and restarted: it resumes from the last revision it
published (its changelog state), trains every batch exactly once, one optimizer step per batch, and the
replayed run's revision chain is unbroken from the latest revision back to revision 0 (real broker)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from consumers.trainer import initial_revision
from replay.audit import run_audit
from replay.ingest import Replayer
from schemas import codec
from schemas.events import DeadLetter, TrainerBatch
from schemas.policy import PolicyRevision
from streams import topics
from streams.revisions import publish
from tests.test_eos_pipeline import read_all, seed_groups

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def _trainer(bootstrap: str, prefix: str, ckdir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix,
           "ROLLOUT_SESSION_TIMEOUT_MS": "6000", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "consumers", "serve", "trainer", "--family", testing.FAMILY,
                             "--checkpoint-dir", str(ckdir), "--lr", "1e-3"], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


async def _revisions(kw) -> list[PolicyRevision]:
    return [codec.decode(r.value, PolicyRevision) for r in
            await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=0.5, timeout_s=10)]


async def _wait_revision(kw, at_least: int, timeout_s: float = 90) -> None:
    for _ in range(int(timeout_s / 0.5)):
        if max(r.revision for r in await _revisions(kw)) >= at_least:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"no revision {at_least}")


async def test_trainer_sigkilled_and_restarted_trains_every_batch_once(kafka_settings, kafka_bootstrap, monkeypatch,
                                                                         tmp_path):
    prefix = f"tr{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    kw = kafka_settings.client_kwargs()
    await topics.create_topics(kw)
    await publish(kw, initial_revision(testing.FAMILY, tmp_path, seed=0))
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=2.0)
    trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log")
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 8)  # 32 records: two batches of 16 for r0
            await _wait_revision(kw, 2)
            expected |= await seed_groups(kw, 12, start=100, revision=2)
            await asyncio.sleep(1.5)  # the next batch is (being) trained: kill the trainer in the middle
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(30)
            before = max(r.revision for r in await _revisions(kw))
            trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log")
            expected |= await seed_groups(kw, 8, start=200, revision=before)

            def settled(_) -> bool:
                return len(batches_raw) > 0 and len(revs) - 1 == len(batches_raw)

            for _ in range(120):
                batches_raw = await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=10)
                revs = await _revisions(kw)
                got = sum(len(codec.decode(r.value, TrainerBatch).records) for r in batches_raw)
                if got >= len(expected) and settled(None):
                    break
                await asyncio.sleep(1.0)
    finally:
        trainer.send_signal(signal.SIGTERM)
        try:
            trainer.wait(30)
        except subprocess.TimeoutExpired:
            trainer.kill()
    batches = [codec.decode(r.value, TrainerBatch) for r in batches_raw]
    letters = [codec.decode(r.value, DeadLetter) for r in
               await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)]
    log = (tmp_path / "trainer.log").read_text()
    assert "service started" in log and log.count("service started") == 2, log[-3000:]
    assert not letters, [(d.service, d.error_type, d.error_message) for d in letters]
    # one revision per batch, chained 0..N, each naming a distinct batch: none trained twice, none skipped
    assert [r.revision for r in revs] == list(range(len(revs)))
    assert all(r.parent_revision == r.revision - 1 for r in revs[1:])
    named = Counter(r.batch_id for r in revs[1:])
    assert max(named.values()) == 1 and set(named) == {b.batch_id for b in batches}
    assert all(r.batch_digest == next(b.batch_digest for b in batches if b.batch_id == r.batch_id) for r in revs[1:])
    assert Counter(x.record_id for b in batches for x in b.records) == Counter(expected)
    assert before >= 2 and len(revs) - 1 > before  # it went on training after the restart
    # and it trained exactly as if it had never stopped: the same batches, in revision order, through one trainer
    # that never restarted, give the last revision's weights (the resumed trainer took the weights and the
    # optimizer's moments of its revision from its training state, not a fresh optimizer)
    from consumers.trainer import ReferenceTrainer, TinyPolicy, to_tensors
    from policy.checkpoint import load_checkpoint

    straight = ReferenceTrainer(load_checkpoint(revs[0].checkpoint), testing.FAMILY, 0, tmp_path / "straight",
                                lr=1e-3)
    by_id = {b.batch_id: b for b in batches}
    for r in revs[1:]:
        straight.step(to_tensors(by_id[r.batch_id]), by_id[r.batch_id])
    resumed = load_checkpoint(revs[-1].checkpoint).state_dict()
    for k, v in straight.model.state_dict().items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert straight.kind is TinyPolicy
    # the replayed run: the audit walks the chain from the latest revision back to r0
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, kafka_settings).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] == len(revs) - 1
