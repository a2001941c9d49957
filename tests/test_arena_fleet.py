"""Several arena processes, one admission bound: three `rollout arena` processes (each with its own local policy
server) feed the services of one run on a real broker. Every batch trained stays within the plan's off-policy
bound, almost nothing is refused as stale, and an arena killed mid-run leaves nothing that blocks the others."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from consumers import settings as service_settings
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.trainer.step import initial_revision
from replay.audit import run_audit
from replay.ingest import Replayer
from schemas import codec
from schemas.admission import AdmissionBook
from schemas.events import DeadLetter, TrainerBatch, TrainingRecord
from schemas.plan_compiler import compile_plan
from streams import topics
from streams.admissions import KafkaLedger
from streams.revisions import publish
from tests.test_eos_pipeline import prefix, read_all  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RUN = "fleet"  # one training run, three arenas
PLAN = """
[model]
name = "tiny-byte-lm"

[orchestrator]
batch_size = 16
group_size = 4
max_off_policy_steps = 1

[orchestrator.train.sampling]
temperature = 1.0
max_tokens = 8

[[orchestrator.train.env]]
id = "arithmetic"
name = "arithmetic"

[orchestrator.advantage]
type = "grpo"
"""


async def _arena(plan: Path, ckpt: str, bootstrap: str, prefix: str, groups: int,
                 name: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.cli", "arena", str(plan), "--groups", str(groups), "--follow-revisions",
        "--no-progress", "--policy", "local", "--policy-port", "0", "--checkpoint", ckpt,
        "--concurrency", "4", "--run-id", RUN, "--arena-id", name, cwd=str(ROOT), env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def _ledger(kw) -> AdmissionBook:
    book = AdmissionBook()
    for r in await read_all(kw, topics.ADMISSIONS.name, idle_s=0.3, timeout_s=5):
        book.apply(codec.decode(r.value), r.timestamp / 1000)
    return book


def _mid_group(book: AdmissionBook, arena_id: str, after: int) -> bool:
    """``arena_id`` has closed ``after`` groups and holds an open claim."""
    mine = [s for s in book.claims.values() if s.claim.arena_id == arena_id]
    return sum(s.done for s in mine) >= after and any(s.open for s in mine)


async def run_fleet(kafka_settings, prefix: str, tmp_path: Path, *, arenas: int, groups: int,
                    kill_after: int | None = None) -> dict:
    """Run ``arenas`` arena processes of ``groups`` groups each under the services; with ``kill_after``,
    SIGKILL arena 0 once that many of its groups are done and it holds an open claim, and start it again (same
    id). Return what the topics hold."""
    kw = kafka_settings.client_kwargs()
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(PLAN)
    plan = compile_plan(str(plan_path))
    rev0 = initial_revision(plan.family, tmp_path / "ckpt", seed=0, run_id=RUN)
    await topics.create_topics(kw)
    await publish(kw, rev0)
    cfg = service_settings.build(plan=plan, credit=True, checkpoint_dir=str(tmp_path / "ckpt"), lr=1e-3,
                                 flush_after_s=3.0, group_timeout_s=5.0)
    ckpt = rev0.checkpoint.uri.removeprefix("file://")
    t0 = time.monotonic()
    async with System(SERVICES, cfg, kw):
        start = [_arena(plan_path, ckpt, kafka_settings.bootstrap, prefix, groups, f"arena{i}")
                 for i in range(arenas)]
        procs = list(await asyncio.gather(*start))
        if kill_after is not None:
            ledger = KafkaLedger(kw)  # watched as the arenas fold it: a claim is open for a moment only
            await ledger.start()
            try:
                while True:  # frozen mid-group, then killed: a group it closes in the meantime does not count
                    while not _mid_group(ledger.book, "arena0", kill_after):
                        assert procs[0].returncode is None, (await procs[0].communicate())[0].decode()[-3000:]
                        await ledger.wait(0.01)
                    procs[0].send_signal(signal.SIGSTOP)
                    settled = time.monotonic() + 1.0  # what it had sent before the stop lands in the ledger
                    while time.monotonic() < settled:
                        await ledger.wait(0.2)
                    if _mid_group(ledger.book, "arena0", kill_after):
                        break
                    procs[0].send_signal(signal.SIGCONT)
            finally:
                await ledger.stop()
            procs[0].send_signal(signal.SIGKILL)
            await procs[0].wait()
            procs.append(await _arena(plan_path, ckpt, kafka_settings.bootstrap, prefix, groups, "arena0"))
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 150)
        for p, (out, _) in zip(procs, outs):
            assert p.returncode in (0, -signal.SIGKILL), out.decode()[-3000:]
        arena_s = time.monotonic() - t0

        async def topic(t: topics.Topic, cls):
            return [codec.decode(r.value, cls) for r in await read_all(kw, t.name, idle_s=0.5, timeout_s=10)]

        for _ in range(60):  # until every record is in a batch or refused
            records = await topic(topics.TRAINING_RECORDS, TrainingRecord)
            batches = await topic(topics.TRAINER_BATCHES, TrainerBatch)
            letters = await topic(topics.DEAD_LETTERS, DeadLetter)
            stale = [d for d in letters if d.error_type == "StaleRecordError"]
            if sum(len(b.records) for b in batches) + sum(d.service == "batcher" for d in stale) >= len(records):
                break
            await asyncio.sleep(1)
    lags = [int(m.group(1)) for d in stale if (m := re.search(r"is (\d+) revisions behind", d.error_message))]
    batched_lags = [b.target.revision - s.policy.revision for b in batches for s in b.source_revisions]
    return {"records": records, "batches": batches, "letters": letters, "stale": stale, 
            "arena_s": arena_s, "figures": {
                "arenas": arenas, "records": len(records), "batches": len(batches), "refused": len(stale),
                "refused_by": dict(Counter(d.service for d in stale)),
                "refusal_rate": round(len(stale) / max(1, len(records)), 4),
                "max_staleness_batched": max(batched_lags, default=0),
                "max_staleness_refused": max(lags, default=0), "arena_s": round(arena_s, 1)}}


async def test_three_arenas_share_one_bound_and_a_killed_one_blocks_nobody(kafka_settings, prefix, tmp_path):  # noqa: F811
    got = await run_fleet(kafka_settings, prefix, tmp_path, arenas=3, groups=8, kill_after=1)
    print("FIGURES", got["figures"], [(b.target.revision, len(b.records)) for b in got["batches"]])
    records, batches, stale = got["records"], got["batches"], got["stale"]
    bound = compile_plan(str(tmp_path / "plan.toml")).max_off_policy_steps
    assert all(b.target.revision - s.policy.revision <= bound for b in batches for s in b.source_revisions)
    # Every batch is built around its admitted groups (the batcher waits for those at their bound), so no record
    # of an admitted group is refused as stale. What may be refused is a group the killed arena had emitted part
    # of: its claim was given back when the arena restarted, credit flushes the part after group_timeout_s, and by
    # then it is past its bound. Every refused record says why, and no trained batch breaks the bound (above).
    assert all("revisions behind target" in d.error_message for d in stale), [d.error_message for d in stale]
    kw = kafka_settings.client_kwargs()
    book = await _ledger(kw)
    stale_groups = {codec.decode(d.raw, TrainingRecord).group_id for d in stale}
    assert all(book.claims[book.by_group[g]].released for g in stale_groups), \
        f"records of admitted groups refused: {[(g, book.claims[book.by_group[g]]) for g in stale_groups]}"
    in_batches = Counter(r.record_id for b in batches for r in b.records)
    # the batcher refuses a record instead of batching it; the trainer refuses one of a batch it trains when its
    # own revision has moved past the record's bound since the batch was built (two batches for one target)
    refused = Counter(codec.decode(d.raw, TrainingRecord).record_id for d in stale if d.service == "batcher")
    untrained = {codec.decode(d.raw, TrainingRecord).record_id for d in stale if d.service == "trainer"}
    assert max(in_batches.values()) == 1 and set(in_batches).isdisjoint(refused) and untrained <= set(in_batches)
    assert set(in_batches) | set(refused) == {r.record_id for r in records}, "a record neither batched nor refused"
    # the ledger: the killed arena's open claims were given back, every other claim closed
    granted = [s for s in book.claims.values() if s.granted]
    released = [s for s in granted if s.released]
    assert released and all(s.claim.arena_id == "arena0" and s.released.startswith("restarted") for s in released)
    assert all(s.done or s.released for s in granted)
    assert sum(s.claim.rollouts for s in granted if s.done) >= 3 * 8 * 4  # the restarted arena0 admits 8 anew
    assert {r.group_id for r in records} <= {s.claim.group_id for s in granted}, "a group generated unclaimed"
    # the replayed run: every revision trained on one named batch, the chain unbroken back to r0
    db = str(tmp_path / "fleet.duckdb")
    await Replayer(db, kafka_settings, run_id=RUN).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] >= len(batches) - 1 > 0
