"""The trainer as its own process, SIGKILLed mid-run and restarted: it resumes from the last revision it
published (its changelog state), trains every batch exactly once, one optimizer step per batch, and the
replayed run's revision chain is unbroken from the latest revision back to revision 0 (real broker)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from consumers.trainer.step import initial_revision
from replay.audit import run_audit
from replay.ingest import Replayer
from schemas import codec
from schemas.events import DeadLetter, TrainerBatch
from schemas.policy import PolicyRevision
from streams import topics
from streams.revisions import publish
from tests._processes import stop
from tests.test_eos_pipeline import read_all, seed_groups

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def _trainer(bootstrap: str, prefix: str, ckdir: Path, log: Path, *args: str,
             main: tuple[str, ...] = ("-m", "consumers")) -> subprocess.Popen:
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix,
           "ROLLOUT_SESSION_TIMEOUT_MS": "6000", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, *main, "serve", "trainer", "--family", testing.FAMILY,
                             "--checkpoint-dir", str(ckdir), "--lr", "1e-3", *args], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


async def _fresh_run(kw, monkeypatch, tmp_path: Path, tag: str) -> str:
    """Topics of their own (prefix ``<tag>...``) and revision 0 published; the prefix."""
    prefix = f"{tag}{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    await topics.create_topics(kw)
    await publish(kw, initial_revision(testing.FAMILY, tmp_path, seed=0))
    return prefix


async def _revisions(kw) -> list[PolicyRevision]:
    return [codec.decode(r.value, PolicyRevision) for r in
            await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=0.5, timeout_s=10)]


async def _wait_revision(kw, at_least: int, timeout_s: float = 90) -> None:
    for _ in range(int(timeout_s / 0.5)):
        if max(r.revision for r in await _revisions(kw)) >= at_least:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"no revision {at_least}")


def _rank(torchrun: subprocess.Popen, rank: int) -> psutil.Process:
    """The process torchrun started for ``rank``."""
    for _ in range(600):
        for p in psutil.Process(torchrun.pid).children(recursive=True):
            try:
                if p.environ().get("RANK") == str(rank):
                    return p
            except psutil.Error:
                pass
        time.sleep(0.1)
    raise AssertionError(f"torchrun started no rank {rank}")


@pytest.mark.parametrize("ranks, killed", [(1, 0), (2, 1), (2, 0)],
                         ids=["one-process", "torchrun-2-ranks-rank1-killed", "torchrun-2-ranks-rank0-killed"])
async def test_trainer_sigkilled_and_restarted_trains_every_batch_once(kafka_settings, kafka_bootstrap, monkeypatch,
                                                                         tmp_path, ranks, killed):
    """One process: SIGKILLed and started again. A torchrun group of 2 (``consumers.trainer.distributed``, FSDP2 on gloo):
    rank 1 (no Kafka client) or rank 0 (the service) is SIGKILLed; torchrun restarts the whole group, and the new
    rank 0 takes over.
    Either way every batch is trained once, the chain is unbroken, and the weights are those of one trainer that
    never stopped (to float rounding: the group sums its ranks' gradients in another order)."""
    kw = kafka_settings.client_kwargs()
    prefix = await _fresh_run(kw, monkeypatch, tmp_path, "tr")
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=2.0)
    main = ("-m", "consumers") if ranks == 1 else (
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=2",
        "--monitor-interval=0.5", "-m", "consumers")
    trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", main=main)
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 8)  # 32 records: two batches of 16 for r0
            await _wait_revision(kw, 2)
            expected |= await seed_groups(kw, 12, start=100, revision=2)
            await asyncio.sleep(1.5)  # the next batch is (being) trained: kill the trainer in the middle
            if ranks == 1:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait(30)
                trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log")
            else:  # torchrun stops the other rank and starts both again
                _rank(trainer, killed).send_signal(signal.SIGKILL)
            before = max(r.revision for r in await _revisions(kw))
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
        stop(trainer)
    batches = [codec.decode(r.value, TrainerBatch) for r in batches_raw]
    letters = [codec.decode(r.value, DeadLetter) for r in
               await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)]
    log = (tmp_path / "trainer.log").read_text()
    assert "service started" in log and log.count("service started") == 2, log[-3000:]
    assert not letters, [(d.service, d.error_type, d.error_message) for d in letters]
    # the successor took over between training states (every 8 revisions by default): it trained the batches
    # committed since the run's first weights again, read back from the log
    took_over = [json.loads(x[x.index("{"):]) for x in log.splitlines() if '"took over"' in x]
    assert len(took_over) == 1 and took_over[0]["training_state"] == 0 and took_over[0]["retrained"] >= 2, took_over
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
    from consumers.trainer.models import TinyPolicy
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import to_tensors
    from policy.checkpoint import load_checkpoint

    straight = ReferenceTrainer(load_checkpoint(revs[0].checkpoint), testing.FAMILY, 0, tmp_path / "straight",
                                lr=1e-3)
    by_id = {b.batch_id: b for b in batches}
    for r in revs[1:]:
        straight.step(to_tensors(by_id[r.batch_id]), by_id[r.batch_id])
    resumed = load_checkpoint(revs[-1].checkpoint).state_dict()
    for k, v in straight.model.state_dict().items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-6 if ranks == 1 else 1e-5,
                                   msg=lambda m: f"{k}: {m}")
    assert straight.kind is TinyPolicy
    # the replayed run: the audit walks the chain from the latest revision back to r0
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, kafka_settings).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] == len(revs) - 1


_CHECKPOINT = re.compile(r"-r(\d{6})-[0-9a-f]{12}\.pt$")


# The trainer with one fault point: right after a checkpoint is written, and before the revision naming it is
# committed, it stops itself (SIGSTOP) if the flag file exists, removing the flag. A freeze from outside lands in
# that window only by luck (it is milliseconds wide on a fast machine).
_FREEZE_AFTER_CHECKPOINT = """
import os, runpy, signal, sys
from pathlib import Path
import policy.checkpoint as checkpoint
save = checkpoint.save_checkpoint
def save_then_freeze(*args, **kwargs):
    ref = save(*args, **kwargs)
    flag = Path(os.environ["FREEZE_FLAG"])
    try:
        flag.unlink()
    except FileNotFoundError:
        return ref
    os.kill(os.getpid(), signal.SIGSTOP)
    return ref
checkpoint.save_checkpoint = save_then_freeze
sys.argv[0] = "consumers"
runpy.run_module("consumers", run_name="__main__")
"""


def _stopped(proc: subprocess.Popen) -> bool:
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


async def test_a_frozen_trainer_woken_after_a_take_over_leaves_every_committed_checkpoint_intact(
        kafka_settings, kafka_bootstrap, monkeypatch, tmp_path):
    """Issue 24, hole 2: two trainer processes share one checkpoint directory. The active one freezes (SIGSTOP)
    right after writing a checkpoint whose revision it has not committed, the other takes over and trains on,
    then the frozen one is woken (SIGCONT): its commit is fenced. Every committed revision's checkpoint must still
    match its digest (with one reused path per revision, the zombie's late write replaced a committed file), and
    the chain is unbroken."""
    from policy.checkpoint import file_sha256

    kw = kafka_settings.client_kwargs()
    prefix = await _fresh_run(kw, monkeypatch, tmp_path, "tz")
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0)
    flag = tmp_path / "freeze"
    monkeypatch.setenv("FREEZE_FLAG", str(flag))
    procs = {i: _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / f"trainer-{i}.log", "--instance", i,
                         main=("-c", _FREEZE_AFTER_CHECKPOINT)) for i in "ab"}
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 4)  # one batch: r1
            await _wait_revision(kw, 1)
            before = max(r.revision for r in await _revisions(kw))
            flag.touch()
            expected |= await seed_groups(kw, 4, start=100, revision=before)
            for _ in range(600):
                frozen = next((i for i, p in procs.items() if _stopped(p)), None)
                if frozen is not None:
                    break
                await asyncio.sleep(0.1)
            assert frozen is not None, "no trainer froze after its checkpoint"
            frozen_at = asyncio.get_running_loop().time()
            await asyncio.sleep(0.5)
            assert max(r.revision for r in await _revisions(kw)) == before  # its revision is not committed
            assert any(int(m[1]) == before + 1 for p in tmp_path.glob("*.pt") if (m := _CHECKPOINT.search(p.name)))
            await _wait_revision(kw, before + 1, timeout_s=120)  # the other took over and trained that batch
            taken_over_s = asyncio.get_running_loop().time() - frozen_at
            procs[frozen].send_signal(signal.SIGCONT)  # the zombie wakes: its commit must be fenced
            expected |= await seed_groups(kw, 4, start=9000, revision=before + 1)
            await _wait_revision(kw, before + 2, timeout_s=120)  # and training goes on
            await asyncio.sleep(3)  # time for the woken one to finish, or try to, what it was doing
    finally:
        stop(*procs.values())
    revs = await _revisions(kw)
    assert [r.revision for r in revs] == list(range(len(revs)))
    assert all(r.parent_revision == r.revision - 1 for r in revs[1:])
    for r in revs:
        path = Path(r.checkpoint.uri.removeprefix("file://"))
        assert file_sha256(path) == r.checkpoint.digest, f"r{r.revision}'s checkpoint {path.name} changed"
    batches = [codec.decode(x.value, TrainerBatch) for x in
               await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=10)]
    got = Counter(x.record_id for b in batches for x in b.records)
    print(f"froze trainer {frozen}: records={len(expected)} lost={len(set(expected) - set(got))} "
          f"doubled={sum(n > 1 for n in got.values())} revisions={len(revs)} next_revision_after_s={taken_over_s:.1f}")
    assert got == Counter(expected)


# The trainer with one fault point: SIGKILLed by itself when a transaction carrying KILL_AT_REVISIONS revisions or
# more is about to commit (everything sent, the commit not made); the count goes to KILL_REPORT first.
_KILL_AT_COMMIT = """
import os, runpy, signal, sys
from pathlib import Path
from schemas.policy import PolicyRevision
from streams.transactions import TransactionalProcessor
send_and_commit = TransactionalProcessor._send_and_commit
async def send_then_die(self, prod, txn):
    n = sum(isinstance(o.event, PolicyRevision) for out in txn.outputs.values() for o in out)
    if n >= int(os.environ["KILL_AT_REVISIONS"]):
        Path(os.environ["KILL_REPORT"]).write_text(str(n))
        os.kill(os.getpid(), signal.SIGKILL)
    return await send_and_commit(self, prod, txn)
TransactionalProcessor._send_and_commit = send_then_die
sys.argv[0] = "consumers"
runpy.run_module("consumers", run_name="__main__")
"""


async def test_a_trainer_killed_committing_a_backlog_of_three_leaves_what_its_successor_needs(
        kafka_settings, kafka_bootstrap, monkeypatch, tmp_path):
    """Three batches wait when a trainer starts: it trains all three in one transaction (r3, r4, r5; its training
    state every 2 revisions, so r4's is written; keep_checkpoints=1) and is SIGKILLed at that commit. Nothing the
    committed r2 needs may be gone: its checkpoint and its training state. The successor resumes from them, every
    batch is trained once, and the weights are those of one trainer that never stopped."""
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import to_tensors
    from policy.checkpoint import file_sha256, load_checkpoint

    kw = kafka_settings.client_kwargs()
    prefix = await _fresh_run(kw, monkeypatch, tmp_path, "tk")
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=60.0, max_off_policy_steps=8)
    opts = ("--state-every", "2", "--keep-checkpoints", "1")
    monkeypatch.setenv("KILL_AT_REVISIONS", "3")
    monkeypatch.setenv("KILL_REPORT", str(tmp_path / "killed"))
    first = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", *opts)
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 8)  # two batches: r1, r2
            await _wait_revision(kw, 2)
            stop(first)
            expected |= await seed_groups(kw, 12, start=100, revision=2)  # three more, waiting
            for _ in range(120):
                if len(await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.3, timeout_s=10)) == 5:
                    break
                await asyncio.sleep(0.5)
            killed = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", *opts,
                              main=("-c", _KILL_AT_COMMIT))
            assert killed.wait(120) == -signal.SIGKILL
            assert (tmp_path / "killed").read_text() == "3"
            revs = await _revisions(kw)
            assert max(r.revision for r in revs) == 2  # nothing of the killed transaction is committed
            r2 = revs[-1]
            assert file_sha256(Path(r2.checkpoint.uri.removeprefix("file://"))) == r2.checkpoint.digest
            assert Path(r2.checkpoint.uri.removeprefix("file://")).with_suffix(".train").is_dir()
            monkeypatch.setenv("KILL_AT_REVISIONS", "1000")
            last = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", *opts)
            await _wait_revision(kw, 5, timeout_s=120)
    finally:
        stop(first)
        stop(last) if "last" in locals() else None
    revs = await _revisions(kw)
    batches = {b.batch_id: b for b in (codec.decode(r.value, TrainerBatch) for r in
                                       await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=10))}
    letters = await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)
    assert not letters
    assert [r.revision for r in revs] == [0, 1, 2, 3, 4, 5]
    assert sorted(r.batch_id for r in revs[1:]) == sorted(batches)
    assert Counter(x.record_id for b in batches.values() for x in b.records) == Counter(expected)
    straight = ReferenceTrainer(load_checkpoint(revs[0].checkpoint), testing.FAMILY, 0, tmp_path / "straight",
                                lr=1e-3)
    for r in revs[1:]:
        straight.step(to_tensors(batches[r.batch_id]), batches[r.batch_id])
    for k, v in load_checkpoint(revs[-1].checkpoint).state_dict().items():
        torch.testing.assert_close(v, straight.model.state_dict()[k], rtol=1e-4, atol=1e-6)


# A torchrun trainer with one batch only a follower cannot train: rank 1 raises on any batch holding a group whose
# id starts with POISON_GROUPS (as a batch that breaks one rank's kernels would); rank 0 and other batches are fine.
_RANK_FAILS = """
import os, runpy, sys
from pathlib import Path
if os.environ.get("RANK") == os.environ["FAILING_RANK"]:
    import streams.transactions
    from consumers.trainer.step import ReferenceTrainer
    streams.transactions.ENVIRONMENT_RETRY_S = 1.0
    step = ReferenceTrainer.step
    def failing_step(self, t, batch):
        if any(r.group_id.startswith(os.environ["POISON_GROUPS"]) for r in batch.records):
            faults = Path(os.environ.get("MEMORY_FAULTS", "/nonexistent"))
            if not faults.exists():
                raise RuntimeError("this batch breaks rank " + os.environ["RANK"])
            left = int(faults.read_text())
            if left > 0:  # the machine's fault, this many times: then the batch trains
                faults.write_text(str(left - 1))
                raise MemoryError("out of memory on rank " + os.environ["RANK"])
        return step(self, t, batch)
    ReferenceTrainer.step = failing_step
sys.argv[0] = "consumers"
runpy.run_module("consumers", run_name="__main__")
"""


@pytest.mark.parametrize("failing_rank", ["1", "0"], ids=["a-follower", "rank-0-mid-step"])
async def test_a_batch_that_crashes_one_rank_is_dead_lettered(kafka_settings, kafka_bootstrap, monkeypatch, tmp_path,
                                                              failing_rank):
    """One rank of a torchrun group of 2 raises on one batch: torchrun restarts the whole group, rank 0 (the one
    counting failures) included, each time. Counted in a file that outlives rank 0 (``streams.poison``), the batch
    is dead-lettered on the group's ``POISON_ATTEMPTS + 1``-th start, and the trainer goes on with the next one,
    instead of failing until ``--max-restarts`` runs out. Rank 1 failing: rank 0 waits in the step's collectives;
    rank 0 failing, before its step's collectives: rank 1 waits in them, and rank 0 must not try the batch again
    in the same life (the group no longer agrees on where it is)."""
    from streams.transactions import POISON_ATTEMPTS

    kw = kafka_settings.client_kwargs()
    prefix = await _fresh_run(kw, monkeypatch, tmp_path, "tf")
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=2.0)
    script = tmp_path / "rank_fails.py"
    script.write_text(_RANK_FAILS)
    monkeypatch.setenv("POISON_GROUPS", "g0001")
    monkeypatch.setenv("FAILING_RANK", failing_rank)
    main = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"--max-restarts={POISON_ATTEMPTS}",
            "--monitor-interval=0.5", str(script))
    trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", main=main)
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 4)  # one batch of 16: r1
            await _wait_revision(kw, 1)
            poisoned = await seed_groups(kw, 4, start=100, revision=1)  # the batch rank 1 raises on
            for _ in range(300):
                letters = await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)
                if letters or trainer.poll() is not None:
                    break
                await asyncio.sleep(1.0)
            expected |= await seed_groups(kw, 4, start=200, revision=1)
            await _wait_revision(kw, 2, timeout_s=120)
            assert trainer.poll() is None  # the group still runs
    finally:
        stop(trainer)
    log = (tmp_path / "trainer.log").read_text()
    letters = [codec.decode(r.value, DeadLetter) for r in
               await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)]
    assert [(d.service, d.error_type, d.origin_topic) for d in letters] == [
        ("trainer", "PoisonRecordError", topics.TRAINER_BATCHES.name)], log[-3000:]
    assert f"failed {POISON_ATTEMPTS} times" in letters[0].error_message
    dead = codec.decode(letters[0].raw, TrainerBatch)
    assert {x.record_id for x in dead.records} == poisoned
    assert log.count("service started") == POISON_ATTEMPTS + 1, log[-3000:]
    revs = await _revisions(kw)
    batches = {b.batch_id: b for b in (codec.decode(r.value, TrainerBatch) for r in
                                       await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=10))}
    assert [r.revision for r in revs] == [0, 1, 2]
    assert Counter(x.record_id for r in revs[1:] for x in batches[r.batch_id].records) == Counter(expected)


async def test_memory_exhausted_on_rank_0_mid_step_restarts_the_group_and_dead_letters_nothing(
        kafka_settings, kafka_bootstrap, monkeypatch, tmp_path):
    """The environment's fault in a torchrun group (MemoryError on rank 0, mid-step, twice): not the batch's, so not
    counted against it; and not tried again in the same life either, since rank 1 waits in the step's collectives:
    the group starts again each time, then trains the batch once. Nothing is dead-lettered."""
    kw = kafka_settings.client_kwargs()
    prefix = await _fresh_run(kw, monkeypatch, tmp_path, "tm")
    settings = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=2.0)
    script = tmp_path / "rank_fails.py"
    script.write_text(_RANK_FAILS)
    faults = tmp_path / "faults"
    faults.write_text("2")
    monkeypatch.setenv("POISON_GROUPS", "g0001")
    monkeypatch.setenv("FAILING_RANK", "0")
    monkeypatch.setenv("MEMORY_FAULTS", str(faults))
    main = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
            "--monitor-interval=0.5", str(script))
    trainer = _trainer(kafka_bootstrap, prefix, tmp_path, tmp_path / "trainer.log", main=main)
    try:
        async with System(("verifier", "credit", "batcher"), settings, kw):
            expected = await seed_groups(kw, 4)  # r1
            await _wait_revision(kw, 1)
            expected |= await seed_groups(kw, 4, start=100, revision=1)  # the batch rank 0 runs out of memory on
            await _wait_revision(kw, 2, timeout_s=240)
            assert trainer.poll() is None
    finally:
        stop(trainer)
    log = (tmp_path / "trainer.log").read_text()
    assert faults.read_text() == "0"
    assert log.count("service started") == 3, log[-3000:]  # the first start, and one after each fault
    assert not await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=10)
    revs = await _revisions(kw)
    batches = {b.batch_id: b for b in (codec.decode(r.value, TrainerBatch) for r in
                                       await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=10))}
    assert [r.revision for r in revs] == [0, 1, 2]
    assert Counter(x.record_id for r in revs[1:] for x in batches[r.batch_id].records) == Counter(expected)
