"""The trainer task: resumed from its snapshot, handed a warm trainer once, revision 0 bootstrapped once, one step
per batch named by its revision; a Hugging Face-style org/name family end to end."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from consumers import testing
from consumers.trainer.task import TrainerTask
from consumers.trainer.state import TRAINING_STATE_SUFFIX, wait_for_training_states
from consumers.trainer.step import ReferenceTrainer, initial_revision
from consumers.trainer.tensors import to_tensors
from policy.checkpoint import file_sha256, load_checkpoint

from _trainer_batches import HF_FAMILY, BatchRec, batch_of, record


async def test_trainer_task_resumes_from_snapshot_state(tmp_path):
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    model = load_checkpoint(rev0.checkpoint)
    recs = [record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
    b = batch_of(recs, rev0)

    class Rec:
        topic, partition, offset, key, headers = "tb", 0, 0, b"tiny", []

        def __init__(self, value):
            self.value = value

    from schemas import codec

    task = TrainerTask(0, "tiny", tmp_path)
    outs = await task.process(Rec(codec.encode(b)))
    assert [o.event.revision for o in outs] == [1]
    task2 = TrainerTask(0, "tiny", tmp_path)
    task2.load_state(task.state())
    outs2 = await task2.process(Rec(codec.encode(b)))
    assert [o.event.revision for o in outs2] == [2] and outs2[0].event.parent_revision == 1


async def test_a_warm_trainer_is_handed_once_to_the_first_batch_that_starts_from_its_revision(tmp_path):
    """``WarmStart``: the trainer opened ahead of the first batch is the one that batch trains (same object, the
    revision it names next), only once; a take-over drops it and opens the committed revision."""
    from consumers.trainer.task import WarmStart
    from schemas import codec

    rev0 = initial_revision("tiny", tmp_path, seed=0)
    model = load_checkpoint(rev0.checkpoint)
    b = batch_of([record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)], rev0)

    class Rec:
        topic, partition, offset, key, headers = "tb", 0, 0, b"tiny", []
        value = codec.encode(b)

    opened = []

    def open_first():
        opened.append(TrainerTask(0, "tiny", tmp_path)._open(rev0.checkpoint, 0))
        return opened[-1]

    warm = WarmStart(open_first)
    task = TrainerTask(0, "tiny", tmp_path, target_checkpoint=lambda t: rev0.checkpoint, warm=warm)
    outs = await task.process(Rec())
    assert len(opened) == 1 and task.trainer is opened[0] and [o.event.revision for o in outs] == [1]
    assert warm.take() is None  # handed once

    other = TrainerTask(0, "tiny", tmp_path, target_checkpoint=lambda t: rev0.checkpoint, warm=WarmStart(open_first))
    other.load_state(task.state())  # a take-over of revision 1: the warm trainer (revision 0) is not it
    outs = await other.process(Rec())
    assert len(opened) == 2 and other.trainer is not opened[1] and [o.event.revision for o in outs] == [2]


@pytest.mark.integration
async def test_trainer_bootstraps_revision_zero_once(kafka_settings, monkeypatch, tmp_path):
    """A fresh log gets revision 0 (seeded, on disk, digest verified); a log that has one gets nothing new."""
    import uuid

    from consumers.registry import SERVICES
    from consumers.runner import ensure_topics
    from consumers.trainer.task import bootstrap_revision
    from streams.revisions import latest_revision

    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"boot{uuid.uuid4().hex[:8]}.")
    kw = kafka_settings.client_kwargs()
    await ensure_topics(SERVICES["trainer"], kw)
    assert await latest_revision(kw, "tiny") is None
    rev0 = await bootstrap_revision(kw, "tiny", tmp_path)
    assert rev0 is not None and rev0.revision == 0
    assert file_sha256(rev0.checkpoint.uri.removeprefix("file://")) == rev0.checkpoint.digest
    assert await bootstrap_revision(kw, "tiny", tmp_path) is None
    assert (await latest_revision(kw, "tiny")).checkpoint.digest == rev0.checkpoint.digest
    assert await latest_revision(kw, "other-family") is None


async def test_each_batch_is_one_step_named_by_its_revision_and_rechecked_against_the_held_revision(tmp_path):
    """Pipelined: the batcher built both batches for r0, but the trainer holds r1 when the second arrives and
    r2 for a third. With a bound of 1 a record from r0 may still train r1 (1 behind), not r2 (2 behind): those
    are refused with their reason, one dead letter each, the record itself as the raw bytes."""
    from schemas import codec
    from schemas.events import DeadLetter, TrainingRecord
    from schemas.policy import PolicyRevision
    from streams import topics
    from streams.revisions import DroppedBatches

    rev0 = initial_revision("tiny", tmp_path, seed=0)
    model = load_checkpoint(rev0.checkpoint)
    batches = [batch_of([record(4 * k + i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0)
                         for i in range(4)], rev0) for k in range(3)]

    class Rec:
        topic, partition, key, headers = "tb", 0, b"tiny", []

        def __init__(self, offset, value):
            self.offset, self.value = offset, value

    task = TrainerTask(0, "tiny", tmp_path)
    got = [await task.process(Rec(i, codec.encode(b))) for i, b in enumerate(batches)]
    revs = [[o.event for o in outs if isinstance(o.event, PolicyRevision)] for outs in got]
    letters = [[o.event for o in outs if isinstance(o.event, DeadLetter)] for outs in got]
    assert [[r.revision for r in rs] for rs in revs] == [[1], [2], []]
    for b, (r,) in zip(batches, revs[:2]):
        assert (r.batch_id, r.batch_digest, r.parent_revision) == (b.batch_id, b.batch_digest, r.revision - 1)
        assert r.metrics["records"] == 4 and r.metrics["refused_records"] == 0
    assert letters[:2] == [[], []] and len(letters[2]) == 4 and task.refused == 4
    assert {codec.decode(d.raw, TrainingRecord).record_id for d in letters[2]} == \
           {x.record_id for x in batches[2].records}
    assert all(d.error_type == "StaleRecordError" and "2 revisions behind target r2" in d.error_message
               and d.origin_offset == 2 and not d.partial for d in letters[2])
    # part of a batch stale: it trains without those records, whose letters say so (``DeadLetter.partial``), so the
    # batcher's ``DroppedBatches`` does not count the batch as dropped beside its revision
    mixed = batch_of([record(20 + i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0, rev=i // 2)
                      for i in range(4)], testing.revision(1).model_copy(update={"checkpoint": rev0.checkpoint}))
    outs = await task.process(Rec(3, codec.encode(mixed)))
    assert [o.event.revision for o in outs if isinstance(o.event, PolicyRevision)] == [3]
    partial = [o.event for o in outs if isinstance(o.event, DeadLetter)]
    assert len(partial) == 2 and all(d.partial and d.origin_offset == 3 for d in partial)
    dropped = DroppedBatches({})
    for d in letters[2] + partial:
        dropped._see(d.model_copy(update={"origin_topic": topics.TRAINER_BATCHES.name}))
    assert dropped.count == 1  # the third batch, refused whole; not the fourth, trained





async def test_an_org_slash_name_family_trains_with_flat_checkpoints_found_verified_and_pruned(tmp_path):
    """The trainer service's path with family ``org/tiny-byte-lm``: revision 0 and every trained revision are one
    file each in the checkpoint directory (``org--tiny-byte-lm-r<N>-<digest[:12]>.pt``, no ``org/`` folder, the directory created
    as in the demo), the first batch's target is found there by name and digest-checked, older ones are pruned
    (keep_checkpoints), a restarted trainer resumes from the newest file, and a file whose bytes changed is
    refused. The family stays ``org/tiny-byte-lm`` in every event and inside every file."""
    from schemas import codec
    from schemas.policy import PolicyRevision
    from policy.checkpoint import CheckpointDigestError, checkpoint_path, load_checkpoint_info

    ck = tmp_path / "run" / "checkpoints"  # not there yet
    rev0 = initial_revision(HF_FAMILY, ck, seed=0)
    p0 = checkpoint_path(rev0.checkpoint)
    assert rev0.family == HF_FAMILY and p0 == ck.resolve() / f"org--tiny-byte-lm-r000000-{rev0.checkpoint.digest[:12]}.pt"
    assert file_sha256(p0) == rev0.checkpoint.digest
    assert load_checkpoint_info(rev0.checkpoint)[1]["family"] == HF_FAMILY

    task = TrainerTask(0, HF_FAMILY, ck, keep_checkpoints=2, state_every=2)  # no target_checkpoint: r0 by its name
    target: PolicyRevision = rev0
    revs: list[PolicyRevision] = []
    for k in range(4):
        recs = [testing.training_record(10 * k + i, family=HF_FAMILY, revision_=k, reward=float(i % 2))
                for i in range(4)]
        outs = await task.process(BatchRec(k, codec.encode(batch_of(recs, target))))
        task.committed()  # each batch its own transaction
        (target,) = [o.event for o in outs if isinstance(o.event, PolicyRevision)]
        revs.append(target)
    assert [r.revision for r in revs] == [1, 2, 3, 4] and {r.family for r in revs} == {HF_FAMILY}
    assert all(r.batch_id.startswith(f"{HF_FAMILY}-r{r.revision - 1}-") for r in revs)
    # flat: no folder per org; r0 (not written by this trainer) kept, r1 and r2 pruned, r3 and r4 kept
    names = [f"org--tiny-byte-lm-r{r.revision:06d}-{r.checkpoint.digest[:12]}" for r in (rev0, *revs)]
    # training states every 2, written in the background: r2's, on the disk when r3 committed, is the one the last
    # commit names; r4's, written after the last commit, is named by none yet
    assert task.base["revision"] == 2 and [o for _, o in task.since] == [2, 3]
    wait_for_training_states()
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))
            if TRAINING_STATE_SUFFIX + "/" not in p.as_posix()] == [
        "run", "run/checkpoints", f"run/checkpoints/{names[0]}.pt", f"run/checkpoints/{names[2]}{TRAINING_STATE_SUFFIX}",
        f"run/checkpoints/{names[3]}.pt", f"run/checkpoints/{names[4]}.pt",
        f"run/checkpoints/{names[4]}{TRAINING_STATE_SUFFIX}"]
    for r in revs[-2:]:
        path = checkpoint_path(r.checkpoint)
        assert path.parent == ck.resolve() and file_sha256(path) == r.checkpoint.digest
        assert load_checkpoint_info(r.checkpoint)[1] == {"family": HF_FAMILY, "revision": r.revision,
                                                         "digest": r.checkpoint.digest}

    # restarted from its snapshot state: resumes from r4's file (digest checked on load), trains r5
    task2 = TrainerTask(0, HF_FAMILY, ck, keep_checkpoints=2, state_every=2)
    task2.load_state(task.state())
    recs = [testing.training_record(100 + i, family=HF_FAMILY, revision_=4, reward=float(i % 2)) for i in range(4)]
    (r5,) = [o.event for o in await task2.process(BatchRec(4, codec.encode(batch_of(recs, revs[-1]))))
             if isinstance(o.event, PolicyRevision)]
    assert (r5.revision, r5.parent_revision, r5.family) == (5, 4, HF_FAMILY)
    assert checkpoint_path(r5.checkpoint).name == f"org--tiny-byte-lm-r000005-{r5.checkpoint.digest[:12]}.pt"

    # r3's file replaced by other bytes (r4's): a trainer resuming from r3 refuses it
    checkpoint_path(revs[2].checkpoint).write_bytes(checkpoint_path(revs[3].checkpoint).read_bytes())
    task3 = TrainerTask(0, HF_FAMILY, ck)
    task3.load_state({"current": {"revision": 3, "checkpoint": revs[2].checkpoint.model_dump(mode="json")}})
    with pytest.raises(CheckpointDigestError):
        await task3.process(BatchRec(5, codec.encode(batch_of(recs, revs[-1]))))


def test_an_org_slash_name_family_of_a_transformers_model_writes_one_folder_per_revision(tmp_path):
    """The HF kind (what vLLM reloads): ``<dir>/org--tiny-llama-r<N>/model.safetensors`` with the family itself in
    its metadata, the folder vLLM is pointed at is that one, and pruning removes whole revision folders only."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig

    from consumers.trainer.models import HFPolicy, policy_kind
    from policy import hf
    from policy.checkpoint import CheckpointDigestError, checkpoint_path
    from schemas.policy import CheckpointRef

    fam = "org/tiny-llama"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    ck = tmp_path / "checkpoints"
    ref0 = hf.save_checkpoint(model, ck, fam, 0)
    assert hf.checkpoint_folder(ref0) == ck.resolve() / f"org--tiny-llama-r000000-{ref0.digest[:12]}"
    assert policy_kind(ref0) is HFPolicy
    rev0 = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=1e-2, kind=HFPolicy, keep_checkpoints=1)
    refs = []
    for k in range(2):
        recs = [testing.training_record(10 * k + i, family=fam, revision_=k, reward=float(i % 2)) for i in range(4)]
        b = batch_of(recs, rev0 if k == 0 else rev)
        stats = trainer.step(to_tensors(b), b)
        assert np.isfinite(stats["loss"])
        rev = trainer.publish(run_id="run", batch=b)
        refs.append(rev.checkpoint)
        assert rev.family == fam
    # after the commit of r2, keep_checkpoints=1 keeps two: r1 is what a pipelined batch's tokens came from (its
    # mismatch is measured on it); r2's training state is the committed one
    wait_for_training_states()
    trainer.prune(2, 2)
    names = [f"org--tiny-llama-r{n:06d}-{ref.digest[:12]}" for n, ref in enumerate((ref0, *refs))]
    assert sorted(p.name for p in ck.iterdir()) == [names[0], names[1], names[2],
                                                    f"{names[2]}{TRAINING_STATE_SUFFIX}"]
    folder = hf.checkpoint_folder(refs[-1])
    assert folder == ck.resolve() / names[2]
    assert json.loads((folder / "revision.json").read_text()) == {"family": fam, "revision": 2}
    with safe_open(str(folder / hf.WEIGHTS), "pt") as f:
        assert f.metadata()["family"] == fam
    assert file_sha256(checkpoint_path(refs[-1])) == refs[-1].digest
    reloaded = HFPolicy.load(refs[-1])  # digest checked
    assert torch.equal(reloaded.state_dict()["model.norm.weight"],
                       trainer.model.state_dict()["model.norm.weight"].to(hf.served_dtype("cpu")).float())
    with pytest.raises(CheckpointDigestError):
        HFPolicy.load(CheckpointRef(uri=refs[-1].uri, digest="0" * 64))


@pytest.mark.integration
async def test_the_services_train_an_org_slash_name_family_from_the_log(kafka_settings, monkeypatch, tmp_path):
    """Verifier, credit, batcher and trainer on a real broker with family ``org/tiny-byte-lm`` and a checkpoint
    directory that does not exist yet: the trainer publishes revision 0 itself (``org--tiny-byte-lm-r000000-*.pt``),
    trains from the log, keeps only its newest checkpoints (keep_checkpoints=1 keeps two: a pipelined batch's
    tokens come from the one before the newest), writes no training state before the 8th revision, and the
    replayed run audits clean."""
    import asyncio
    import uuid

    from consumers.runner import System
    from consumers.settings import ServiceSettings
    from policy.checkpoint import checkpoint_path
    from replay.audit import run_audit
    from replay.ingest import Replayer
    from schemas import codec
    from schemas.policy import PolicyRevision
    from streams import topics
    from tests.test_eos_pipeline import read_all, seed_groups

    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"hf{uuid.uuid4().hex[:8]}.")
    kw = kafka_settings.client_kwargs()
    ck = tmp_path / "run" / "checkpoints"
    settings = ServiceSettings(family=HF_FAMILY, batch_records=16, flush_after_s=2.0, checkpoint_dir=str(ck),
                               keep_checkpoints=1)

    async def revisions() -> list[PolicyRevision]:
        return [codec.decode(r.value, PolicyRevision) for r in
                await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=0.5, timeout_s=10)]

    async with System(("verifier", "credit", "batcher", "trainer"), settings, kw):
        expected = await seed_groups(kw, 8, family=HF_FAMILY)  # 32 records: two batches of 16
        for _ in range(120):
            revs = await revisions()
            if max(r.revision for r in revs) >= 2:
                break
            await asyncio.sleep(0.5)
    revs = await revisions()
    assert [r.revision for r in revs] == [0, 1, 2] and {r.family for r in revs} == {HF_FAMILY}
    names = [checkpoint_path(r.checkpoint).name for r in revs]
    assert [p.name for p in sorted(ck.iterdir())] == names
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                  if p.is_dir() and not p.name.endswith(TRAINING_STATE_SUFFIX)) == ["run", "run/checkpoints"]
    for r in revs:
        assert checkpoint_path(r.checkpoint).parent == ck.resolve()
        assert file_sha256(checkpoint_path(r.checkpoint)) == r.checkpoint.digest
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, kafka_settings).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] == 2 and report.checked["record_digests"] == len(expected)
