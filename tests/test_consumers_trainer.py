"""Trainer bridge (tensors) and the reference trainer (clipped policy gradient on the tiny policy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers import testing
from consumers.trainer.task import TrainerTask
from consumers.trainer.state import TRAINING_STATE_SUFFIX, wait_for_training_states
from consumers.trainer.step import ReferenceTrainer, initial_revision
from consumers.trainer.tensors import to_tensors
from policy.checkpoint import file_sha256, load_checkpoint
from policy.model import PolicyModel, token_logprobs
from schemas.batch import assemble_batch
from schemas.events import TrainingRecord
from schemas.policy import PolicyRef


def batch_of(records, rev=None):
    return assemble_batch(records, rev or testing.revision(0), 1, run_id="run", producer="t")


def test_padded_tensors_align_tokens_mask_and_logprobs():
    recs = [testing.training_record(0, n=3), testing.training_record(1, n=6)]
    b = batch_of(recs)
    t = to_tensors(b, pad_id=7)
    assert t.input_ids.shape == (2, 4 + 6)
    r0 = b.records[0]
    assert t.input_ids[0, :7].tolist() == [*r0.prompt_token_ids.tolist(), *r0.completion_token_ids.tolist()]
    assert t.input_ids[0, 7:].tolist() == [7, 7, 7]
    assert t.loss_mask[0].tolist() == [0] * 4 + [1] * 3 + [0] * 3
    assert t.old_logprobs[1, 4:].tolist() == [-1.0] * 6
    assert torch.all(t.advantages[0, 4:7] == r0.advantage) and torch.all(t.advantages[0, :4] == 0)
    assert t.num_tokens == 9


def test_packed_tensors():
    b = batch_of([testing.training_record(0, n=3), testing.training_record(1, n=6)])
    t = to_tensors(b, packed=True)
    assert t.input_ids.shape == (1, 17) and t.cu_seqlens.tolist() == [0, 7, 17]
    assert t.loss_mask.sum() == 9


def _record(i, model, prompt, completion, adv, rev=0):
    with torch.no_grad():
        lp = token_logprobs(model, prompt, completion).numpy().astype(np.float32)
    n = len(completion)
    return TrainingRecord(run_id="run", producer="t", record_id=f"r{i:04d}", rollout_id=f"ro{i}", step_ids=["s"],
                          member_id="solver", group_id="g", environment="arith@1",
                          policy=PolicyRef(family="tiny", revision=rev), prompt_token_ids=np.array(prompt, np.int32),
                          completion_token_ids=np.array(completion, np.int32), completion_logprobs=lp,
                          loss_mask=np.ones(n, np.uint8), reward=float(adv > 0), advantage=adv, credit="grpo")


def test_reference_trainer_raises_logprob_of_advantaged_completion(tmp_path):
    model = PolicyModel.from_seed(0)
    prompt = list(b"1+1=")
    good, bad = list(b"2"), list(b"7")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=3e-3)
    with torch.no_grad():
        before = (float(token_logprobs(model, prompt, good).sum()), float(token_logprobs(model, prompt, bad).sum()))
    for step in range(15):
        recs = [_record(4 * step + k, model, prompt, c, a) for k, (c, a) in enumerate([(good, 1.0), (bad, -1.0)] * 2)]
        target = testing.revision(tr.revision)
        target = target.model_copy(update={"checkpoint": rev0.checkpoint})
        b = batch_of(recs, target)
        stats = tr.step(to_tensors(b), b)
        assert np.isfinite(stats["loss"])
    with torch.no_grad():
        after = (float(token_logprobs(model, prompt, good).sum()), float(token_logprobs(model, prompt, bad).sum()))
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
    rev = tr.publish(run_id="run")
    assert rev.revision == 1 and rev.parent_revision == 0
    from policy.checkpoint import checkpoint_path

    assert file_sha256(checkpoint_path(rev.checkpoint)) == rev.checkpoint.digest
    reloaded = load_checkpoint(rev.checkpoint)
    assert torch.allclose(token_logprobs(reloaded, prompt, good), token_logprobs(model, prompt, good))


def test_a_records_reference_logprobs_train_it_with_ref_kl_toward_the_reference_beside_grpo_rows(tmp_path):
    """prime-rl's opd: a record with the reference's logprobs (advantage 0: none is assigned) trains with ref_kl, its
    completion's logprob moving toward the reference's; a grpo record in the same batch trains with the plan's
    objective; to_tensors puts each reference logprob under its completion token."""
    model = PolicyModel.from_seed(0)
    prompt, opd, grpo = list(b"3+4="), list(b"7"), list(b"9")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=3e-3)

    def lp(c):
        with torch.no_grad():
            return float(token_logprobs(model, prompt, c).sum())

    before = (lp(opd), lp(grpo))
    ref = np.array([-0.05], np.float32)  # the teacher is sure of "7"
    for step in range(10):
        distilled = [_record(3 * step + k, model, prompt, opd, 0.0).model_copy(update={"ref_logprobs": ref,
                                                                                       "credit": "ref_kl"})
                     for k in range(2)]
        b = batch_of([*distilled, _record(3 * step + 2, model, prompt, grpo, -1.0)],
                     testing.revision(tr.revision).model_copy(update={"checkpoint": rev0.checkpoint}))
        t = to_tensors(b)
        assert t.ref_rows.tolist() == [True, True, False]
        assert t.ref_logprobs[0, len(prompt)].item() == pytest.approx(-0.05) and t.ref_logprobs[2].abs().sum() == 0
        stats = tr.step(t, b)
        assert {"ref_kl", "ref_kl/is_masked", "is_masked"} <= stats.keys() and np.isfinite(stats["loss"])
        first = first if step else stats["ref_kl"]  # log p_ref - log p_trainer, token mean
    assert lp(opd) > before[0] + 0.5 and lp(grpo) < before[1] - 0.5
    assert abs(stats["ref_kl"]) < first - 0.5  # the trainer's logprob came (near) to the reference's


async def test_trainer_task_resumes_from_snapshot_state(tmp_path):
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    model = load_checkpoint(rev0.checkpoint)
    recs = [_record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
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
    b = batch_of([_record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)], rev0)

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


def test_mismatch_is_measured_under_the_revision_that_generated_each_token(tmp_path):
    """A pipelined batch holds tokens of earlier revisions: each is recomputed under its own weights (read from its
    checkpoint file), so exact logprobs give ~0 and logprobs off by 0.5 give 0.5, whatever the current weights."""
    model = PolicyModel.from_seed(0)
    prompt, completion = list(b"2+2="), list(b"4!")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=5e-2, epochs=3, ref=rev0.checkpoint)
    exact0 = [_record(i, model, prompt, completion, (-1.0) ** i) for i in range(4)]  # generated by r0
    target = testing.revision(0).model_copy(update={"checkpoint": rev0.checkpoint})
    b = batch_of(exact0, target)
    first = tr.step(to_tensors(b), b)
    assert first["mismatch_tokens"] == 8 and first["mismatch_max"] < 1e-4  # r0 tokens under r0 weights
    tr.publish(run_id="run")  # now at r1; the weights moved
    with torch.no_grad():
        moved = float((token_logprobs(model, prompt, completion) - torch.tensor(exact0[0].completion_logprobs)).abs().max())
    assert moved > 1e-3
    off = [r.model_copy(update={"record_id": f"x{i}", "completion_logprobs": r.completion_logprobs - 0.5})
           for i, r in enumerate(exact0)]
    b = batch_of(off, testing.revision(1).model_copy(update={"checkpoint": rev0.checkpoint}))
    second = tr.step(to_tensors(b), b)  # r0 tokens, trainer at r1: measured with r0's checkpoint
    assert second["mismatch_tokens"] == 8 and abs(second["mismatch_mean"] - 0.5) < 1e-4
    tr.mismatch_rows = 1  # a sample: one row of an earlier revision
    assert tr.mismatch(to_tensors(b), b, torch.zeros(4, 5))["mismatch_tokens"] == 2
    tr.refs.pop(0)
    assert tr.mismatch(to_tensors(b), b, torch.zeros(4, 5)) == {"mismatch_tokens": 0.0}  # too old: not measured


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
    batches = [batch_of([_record(4 * k + i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0)
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
    mixed = batch_of([_record(20 + i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0, rev=i // 2)
                      for i in range(4)], testing.revision(1).model_copy(update={"checkpoint": rev0.checkpoint}))
    outs = await task.process(Rec(3, codec.encode(mixed)))
    assert [o.event.revision for o in outs if isinstance(o.event, PolicyRevision)] == [3]
    partial = [o.event for o in outs if isinstance(o.event, DeadLetter)]
    assert len(partial) == 2 and all(d.partial and d.origin_offset == 3 for d in partial)
    dropped = DroppedBatches({})
    for d in letters[2] + partial:
        dropped._see(d.model_copy(update={"origin_topic": topics.TRAINER_BATCHES.name}))
    assert dropped.count == 1  # the third batch, refused whole; not the fourth, trained


def test_nothing_a_take_over_may_need_is_removed_before_the_commit_that_supersedes_it(tmp_path):
    """Four batches trained in one transaction (a backlog), training states every 2 revisions: until that
    transaction commits, the revision committed before it (r0, not written here) and every file written since stay;
    after the commit (``prune``) only the newest checkpoints (keep_checkpoints) and the committed training state
    (r4's) are left."""
    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    model = load_checkpoint(rev0.checkpoint)
    recs = [_record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
    trainer = ReferenceTrainer(model, "tiny", 0, tmp_path / "ck", keep_checkpoints=2, state_every=2)
    b = batch_of(recs, rev0)
    revs = []
    for _ in range(4):
        trainer.step(to_tensors(b), b)
        revs.append(trainer.publish(run_id="run", batch=b))

    def listed(suffix: str = ".pt") -> list[str]:
        return sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(suffix))

    def names(rs, suffix=".pt") -> list[str]:
        return [Path(r.checkpoint.uri).name.replace(".pt", suffix) for r in rs]

    wait_for_training_states()  # r4's is written in the background
    assert listed() == names(revs) and listed(TRAINING_STATE_SUFFIX) == names(revs[1::2], TRAINING_STATE_SUFFIX)
    assert trainer.last_state() == (4, revs[-1].checkpoint)
    trainer.prune(4, 4)
    assert listed() == names(revs[-2:]) and listed(TRAINING_STATE_SUFFIX) == names(revs[-1:], TRAINING_STATE_SUFFIX)
    assert not list((tmp_path / "ck").glob("*.tmp*"))  # every temporary folder moved in whole
    assert (tmp_path / "r0").exists() and any((tmp_path / "r0").iterdir())  # never one it did not write


def test_an_earlier_lifes_states_checkpoints_and_unfinished_writes_are_pruned_by_the_commit(tmp_path):
    """A take-over (here a second ``ReferenceTrainer`` on the same folder) finds its predecessor's files: that life's
    training states, a state it wrote that no commit named, its kept checkpoints, and writes it was killed in
    (a checkpoint's ``.tmp<pid>``, a state's, in the old and the new naming). Once a commit names revision 6 and the
    state at 6, only what a take-over from it may need is left: before, ``prune`` removed only what the pruning
    trainer itself wrote, and all of these stayed for ever."""
    rev0 = initial_revision("tiny", tmp_path / "ck", seed=0)
    model = load_checkpoint(rev0.checkpoint)
    recs = [_record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
    b = batch_of(recs, rev0)
    first = ReferenceTrainer(model, "tiny", 0, tmp_path / "ck", keep_checkpoints=2, state_every=2)
    for _ in range(4):  # the first life: r1..r4, states at r2 and r4; killed before any commit pruned
        first.step(to_tensors(b), b)
        first.publish(run_id="run", batch=b)
    wait_for_training_states()
    ck = tmp_path / "ck"
    (ck / "tiny-r000005.tmp4242").write_bytes(b"half a checkpoint")  # killed mid-write
    (ck / ".train-r3.tmp4242").mkdir()  # a state's write, as named before
    (ck / ".tiny-r000004.train.tmp4242").mkdir()
    second = ReferenceTrainer(load_checkpoint(first.written[4]), "tiny", 4, ck, keep_checkpoints=2, state_every=2)
    assert second.load_training_state(first.written[4])
    revs = []
    for _ in range(2):  # the second life: r5, r6 (state at r6), and the commit naming r6 and its state
        second.step(to_tensors(b), b)
        revs.append(second.publish(run_id="run", batch=b))
    wait_for_training_states()
    second.prune(6, 6)
    left = sorted(p.name for p in ck.iterdir())
    want = sorted([Path(rev0.checkpoint.uri).name, *(Path(r.checkpoint.uri).name for r in revs),
                   Path(revs[-1].checkpoint.uri).name.replace(".pt", TRAINING_STATE_SUFFIX)])
    assert left == want, left


def test_no_training_state_is_written_at_the_runs_last_revision(tmp_path):
    """Nothing trains after the run's last revision (its max_steps), so its state is not written there: states every
    2 revisions over a 4-revision run leave r2's only."""
    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    model = load_checkpoint(rev0.checkpoint)
    b = batch_of([_record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)], rev0)
    trainer = ReferenceTrainer(model, "tiny", 0, tmp_path / "ck", state_every=2, last_revision=4)
    revs = []
    for _ in range(4):
        trainer.step(to_tensors(b), b)
        revs.append(trainer.publish(run_id="run", batch=b))
    wait_for_training_states()
    states = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(TRAINING_STATE_SUFFIX))
    assert states == [Path(revs[1].checkpoint.uri).name.replace(".pt", TRAINING_STATE_SUFFIX)]
    assert trainer.last_state() == (2, revs[1].checkpoint)


# -- a family named as Hugging Face names models (org/name) -------------------------------------------------
HF_FAMILY = "org/tiny-byte-lm"


class _Rec:
    topic, partition, headers = "tb", 0, []

    def __init__(self, offset, value, key=HF_FAMILY.encode()):
        self.offset, self.value, self.key = offset, value, key


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
        outs = await task.process(_Rec(k, codec.encode(batch_of(recs, target))))
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
    (r5,) = [o.event for o in await task2.process(_Rec(4, codec.encode(batch_of(recs, revs[-1]))))
             if isinstance(o.event, PolicyRevision)]
    assert (r5.revision, r5.parent_revision, r5.family) == (5, 4, HF_FAMILY)
    assert checkpoint_path(r5.checkpoint).name == f"org--tiny-byte-lm-r000005-{r5.checkpoint.digest[:12]}.pt"

    # r3's file replaced by other bytes (r4's): a trainer resuming from r3 refuses it
    checkpoint_path(revs[2].checkpoint).write_bytes(checkpoint_path(revs[3].checkpoint).read_bytes())
    task3 = TrainerTask(0, HF_FAMILY, ck)
    task3.load_state({"current": {"revision": 3, "checkpoint": revs[2].checkpoint.model_dump(mode="json")}})
    with pytest.raises(CheckpointDigestError):
        await task3.process(_Rec(5, codec.encode(batch_of(recs, revs[-1]))))


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


# -- bounded memory: logprobs at the trained positions, micro-batches by a token budget ---------------------------
def _tiny_llama(vocab: int = 512):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True), dtype=torch.float32)


def test_the_same_weights_written_twice_have_one_digest(tmp_path):
    """A checkpoint's digest names its content: safetensors' own header order changes from write to write, the
    sorted header does not; the file still loads as written (transformers reads it back)."""
    from transformers import AutoModelForCausalLM

    from policy import hf

    model = _tiny_llama()
    refs = [hf.save_checkpoint(model, tmp_path / str(k), "tiny-llama", 3) for k in range(6)]
    assert len({r.digest for r in refs}) == 1, [r.digest[:12] for r in refs]
    back = AutoModelForCausalLM.from_pretrained(hf.checkpoint_folder(refs[0]))
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(hf.served_dtype("cpu")).to(back.state_dict()[k].dtype)), k


def test_trained_position_logprobs_equal_the_whole_vocabulary_softmax_and_its_gradient(monkeypatch):
    """``policy.hf.token_logprobs`` runs the head on the wanted positions only, in recomputed chunks: the values and
    the gradient are those of ``log_softmax`` over the model's whole logits."""
    from policy import hf

    monkeypatch.setattr(hf, "LOGIT_CHUNK", 5)  # several chunks, one of them partial
    model = _tiny_llama()
    ids = torch.randint(3, 512, (3, 12))
    att = torch.ones_like(ids)
    wanted = torch.zeros(3, 11, dtype=torch.bool)
    wanted[:, 6:] = True
    wanted[1, 2:4] = True  # a second turn of one row
    got = hf.token_logprobs(model, ids, att, wanted=wanted, autocast=False)
    got.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole = torch.log_softmax(model(input_ids=ids[:, :-1], attention_mask=att[:, :-1]).logits.float(), -1)
    ref = whole.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    (ref * wanted).sum().backward()
    torch.testing.assert_close(got[wanted], ref[wanted], rtol=1e-5, atol=1e-5)
    assert torch.all(got[~wanted] == 0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _saved_bytes_per_micro_batch(trainer, batch) -> list[int]:
    """The bytes autograd keeps for the backward pass, at their peak within each forward (activation memory)."""
    peaks: list[int] = []
    live = [0]

    def pack(t):
        live[0] += t.numel() * t.element_size()
        peaks[-1] = max(peaks[-1], live[0])
        return t

    loss = trainer.loss

    def counted(*a, **kw):
        peaks.append(0)
        live[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return loss(*a, **kw)

    trainer.loss = counted
    trainer.step(to_tensors(batch), batch)
    return peaks


def _activation_peaks(tmp_path, rows: int, shared: bool = False, half: int = 64) -> list[int]:
    """Rows of ``half`` prompt and ``half`` completion tokens, each with its own prompt (a game's seats, turns) or,
    ``shared``, all one prompt (a group's)."""
    from consumers.trainer.models import HFPolicy
    from policy import hf

    fam = "tiny-llama"
    model = _tiny_llama(4096)
    ref0 = hf.save_checkpoint(model, tmp_path, fam, 0)
    trainer = ReferenceTrainer(model, fam, 0, tmp_path, kind=HFPolicy, micro_batch_tokens=256, ref=ref0)
    recs = [testing.training_record(i, family=fam, reward=float(i % 2)).model_copy(update={
        "prompt_token_ids": np.arange(3, 3 + half, dtype=np.int32) + (0 if shared else half * i),
        "completion_token_ids": np.arange(3 + half, 3 + 2 * half, dtype=np.int32),
        "completion_logprobs": np.full(half, -6.0, np.float32), "loss_mask": np.ones(half, np.uint8)})
        for i in range(rows)]
    b = batch_of(recs, testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0}))
    return _saved_bytes_per_micro_batch(trainer, b)


def test_activation_memory_follows_the_token_budget_not_the_batch(tmp_path):
    """The memory bound: a micro-batch holds at most ``micro_batch_tokens`` tokens (256: 2 rows of 128), so what
    autograd keeps per micro-batch is the same for a batch of 4 rows and of 16, and no whole-vocabulary tensor per
    token is kept (one micro-batch's [tokens, vocab] float32 logits alone would be 256 x 4096 x 4 bytes = 4 MiB)."""
    small, large = _activation_peaks(tmp_path / "a", 4), _activation_peaks(tmp_path / "b", 16)
    assert (len(small), len(large)) == (2, 8)
    assert max(large) == max(small) < 256 * 4096 * 4, (small, large)
    # one prompt for all (policy.shared_prefix): packs of 3 rows, 64 + 3 x 63 = 253 tokens, as many micro-batches of
    # one pack whatever the batch; a pack keeps its attention mask besides (the boolean W x W, and the float32 copy
    # SDPA's kernel keeps in each layer: for SmolLM2 at W = 1,024, 120 MB beside the row's ~1.2 GB of activations)
    shared, more = _activation_peaks(tmp_path / "c", 16, shared=True), _activation_peaks(tmp_path / "d", 32, shared=True)
    assert (len(shared), len(more)) == (6, 11)
    assert max(shared) == max(more) < 256 * 4096 * 4, (shared, more)


async def test_a_take_over_between_training_states_trains_the_committed_batches_again_to_the_same_state(tmp_path):
    """Training states every 3 revisions; the trainer stops after r5 (state at r3, r4 and r5 trained after it). Its
    successor loads r3's state, trains r4's and r5's batches again (read back by offset), settles on r5's served
    weights, and trains r6: its weights and its optimizer's moments and step count are those of a trainer that never
    stopped, bit for bit on this CPU (the test for the same on a real broker, killed: test_trainer_restart)."""
    from schemas import codec

    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    model = load_checkpoint(rev0.checkpoint)
    log: dict[int, bytes] = {}

    async def read_records(topic, partition, offsets):
        assert (topic, partition) == ("tb", 0)
        return [_Rec(o, log[o]) for o in offsets if o in log]

    def batch(k):
        return batch_of([_record(10 * k + i, model, list(b"2+2="), list(b"45"[: 1 + k % 2]), (-1.0) ** (i + k),
                                 rev=k) for i in range(4)], testing.revision(k).model_copy(
            update={"checkpoint": rev0.checkpoint}))

    async def feed(task, k):
        log[k] = codec.encode(batch(k))
        outs = await task.process(_Rec(k, log[k]))
        task.committed()
        return outs[-1].event

    straight = TrainerTask(0, "tiny", tmp_path / "ck", state_every=3, target_checkpoint=lambda t: rev0.checkpoint)
    for k in range(5):
        await feed(straight, k)
    assert straight.base["revision"] == 3 and [o for _, o in straight.since] == [3, 4]
    successor = TrainerTask(0, "tiny", tmp_path / "ck", state_every=3, read_records=read_records)
    successor.load_state(json_roundtrip(straight.state()))
    r6 = await feed(successor, 5)
    await feed(straight, 5)
    assert r6.revision == 6 and r6.checkpoint.digest == straight.current["checkpoint"]["digest"]
    a, b = straight.trainer, successor.trainer
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        sa, sb = a.opt.state[pa], b.opt.state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)

    # without the batches (the log no longer has them): the committed weights, r3's moments, and a warning
    lost = TrainerTask(0, "tiny", tmp_path / "ck", state_every=3)
    written = straight.trainer.written
    lost.load_state({"current": {"revision": 5, "checkpoint": written[5].model_dump(mode="json")},
                     "base": {"revision": 3, "checkpoint": written[3].model_dump(mode="json")},
                     "since": [["tb", 3], ["tb", 4]]})
    await asyncio.to_thread(lost._ensure, batch(5), [])
    assert lost.trainer.revision == 5
    served = load_checkpoint(straight.trainer.written[5]).state_dict()
    assert all(torch.equal(lost.trainer.model.state_dict()[k], v) for k, v in served.items())


def json_roundtrip(state):
    import json

    return json.loads(json.dumps(state))


async def test_a_training_state_the_disk_refuses_is_named_by_no_commit_and_training_goes_on(tmp_path, monkeypatch,
                                                                                           caplog):
    """The background write of r1's training state fails (a full disk, ENOSPC): the error is logged, no commit
    names that state (the batches since the last one stay listed, for a take-over to train again), the trainer
    trains on, and the next state (r2's) is written and named."""
    import errno

    import consumers.trainer.step as trainer_module
    from schemas import codec

    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    real, calls = trainer_module.save_sharded, []

    def full_once(*args, **kw):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(trainer_module, "save_sharded", full_once)
    task = TrainerTask(0, "tiny", tmp_path / "ck", state_every=1, target_checkpoint=lambda t: rev0.checkpoint)
    target = rev0
    for k in range(3):
        recs = [testing.training_record(10 * k + i, revision_=k, reward=float(i % 2)) for i in range(4)]
        outs = await task.process(_Rec(k, codec.encode(batch_of(recs, target)), key=b"tiny"))
        task.committed()
        target = outs[-1].event
        if k == 1:  # r1's write failed (seen at r2's optimizer step): the base is still r0, both batches listed
            assert task.base.get("fresh") and [o for _, o in task.since] == [0, 1]
    assert target.revision == 3
    assert "the training state of revision 1 was not written (OSError" in caplog.text
    # r2's state was on the disk when r3 committed: named, with r3's batch after it
    assert task.base["revision"] == 2 and [o for _, o in task.since] == [2]
    wait_for_training_states()
    assert len(calls) == 3 and not list((tmp_path / "ck").glob(".train-*"))  # no half-written folder left


async def test_nothing_is_trained_past_the_runs_max_steps(tmp_path):
    """``max_steps`` 2 (prime-rl's optimizer steps): two batches train r1 and r2; a third, made of records generated
    meanwhile, is refused record by record (RunComplete dead letters), and no r3 is published."""
    from schemas import codec
    from schemas.policy import PolicyRevision

    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    task = TrainerTask(0, "tiny", tmp_path / "ck", max_steps=2, target_checkpoint=lambda t: rev0.checkpoint)
    target, kinds = rev0, []
    for k in range(3):
        recs = [testing.training_record(10 * k + i, revision_=min(k, 2), reward=float(i % 2)) for i in range(4)]
        outs = await task.process(_Rec(k, codec.encode(batch_of(recs, target)), key=b"tiny"))
        task.committed()
        kinds.append([type(o.event).__name__ for o in outs])
        target = next((o.event for o in outs if isinstance(o.event, PolicyRevision)), target)
    assert target.revision == 2 and kinds[:2] == [["PolicyRevision"], ["PolicyRevision"]]
    assert kinds[2] == ["DeadLetter"] * 4
    assert all(o.event.error_type == "RunComplete" and "max_steps 2" in o.event.error_message for o in outs)


def _lora_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


@pytest.mark.parametrize("serving", ["adapter", "merged"])
def test_a_lora_recipe_trains_the_adapters_only_and_serves_each_revision_as_its_spec_says(tmp_path, serving):
    """``[trainer.model.lora]``: adapters on the attention projections, the rest frozen. Two revisions: the adapters
    move and the base weights do not (bit for bit), the optimizer holds moments for the adapters only. Served as an
    adapter (prime-rl's way), each checkpoint is a PEFT folder of the adapter alone naming revision 0 as its base;
    served merged, the merged weights under the model's own names, equal to base + scale B A. Either way the trainer's
    model (base + adapter) and the served weights give the same logprobs, and a take-over from the training state
    resumes the adapters exactly (``settle`` finds the served weights)."""
    from consumers.trainer.models import HFPolicy
    from policy import hf, lora
    from schemas.plan import LoraSpec

    fam = "org/tiny-llama"
    ck = tmp_path / "checkpoints"
    ref0 = hf.save_checkpoint(_lora_llama(), ck, fam, 0)
    rev0 = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "experts"], serving=serving)  # no experts
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, state_every=2,
                               ref=ref0)
    base0 = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    adapters0 = {k: v.clone() for k, v in lora.adapter_state(trainer.model).items()}
    assert adapters0 and all(("q_proj" in k or "v_proj" in k) for k in adapters0)
    assert {id(p) for g in trainer.opt.param_groups for p in g["params"]} == \
        {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    rev = rev0
    for k in range(2):
        recs = [testing.training_record(10 * k + i, family=fam, revision_=k, reward=float(i % 2)) for i in range(4)]
        b = batch_of(recs, rev)
        trainer.step(to_tensors(b), b)
        rev = trainer.publish(run_id="run", batch=b)
    wait_for_training_states()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base0.items())  # the base did not move
    moved = [k for k, v in adapters0.items() if not torch.equal(after[k], v)]
    assert any("lora_A" in k for k in moved) and any("lora_B" in k for k in moved)
    q = "model.layers.0.self_attn.q_proj"
    a, b_ = after[f"{q}.lora_A.default.weight"], after[f"{q}.lora_B.default.weight"]
    served = hf.load_weights(rev.checkpoint)
    if serving == "adapter":
        folder = hf.checkpoint_folder(rev.checkpoint)
        assert rev.checkpoint.adapter and sorted(p.name for p in folder.iterdir()) == \
            ["adapter_config.json", "adapter_model.safetensors", "revision.json"]
        assert lora.base_of(rev.checkpoint) == ref0  # every adapter names revision 0, the unchanged base
        assert set(served) == {f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{x}.weight"
                               for i in (0, 1) for m in "qv" for x in "AB"}  # peft's names, nothing of the base's
        assert torch.equal(served[f"base_model.model.{q}.lora_B.weight"], b_)  # float32, as trained
    else:
        assert not rev.checkpoint.adapter
        assert set(served) == set(hf.load_weights(ref0))  # the model's own names, nothing of peft's
        merged = after[f"{q}.base_layer.weight"] + (spec.alpha / spec.rank) * b_ @ a
        assert torch.equal(served[f"{q}.weight"], merged.to(hf.served_dtype("cpu")))
        assert torch.equal(served["model.layers.0.mlp.up_proj.weight"],
                           hf.load_weights(ref0)["model.layers.0.mlp.up_proj.weight"])
    # what the revision serves (loaded from its checkpoint alone) is what the trainer computes with: the same numbers
    # where it serves float32; where it serves bf16 (a CPU with native bf16: ``hf.served_dtype``) within the weights'
    # rounding, a tenth of what the two steps moved
    t = to_tensors(b)
    with torch.no_grad():
        served_lp, trained_lp, base_lp = (HFPolicy.logprobs(m, t) for m in (
            HFPolicy.load(rev.checkpoint), trainer.model.eval(), HFPolicy.load(ref0)))
    tol = 1e-5 if hf.served_dtype("cpu") == torch.float32 else 2e-3
    assert float((served_lp - trained_lp).abs().max()) <= tol < float((base_lp - trained_lp).abs().max()) / 10

    # a take-over from r2's training state: the adapters and the served weights exactly
    successor = ReferenceTrainer(HFPolicy.load(rev.checkpoint), fam, 2, ck, lr=5e-2, kind=HFPolicy, lora=spec,
                                 ref=rev.checkpoint)
    assert successor.load_training_state(rev.checkpoint, 2)
    assert all(torch.equal(successor.model.state_dict()[k], v) for k, v in lora.adapter_state(trainer.model).items())
    assert successor.settle(rev.checkpoint, 2)
    assert successor.base == (ref0 if serving == "adapter" else None)


def test_a_take_over_that_did_not_reproduce_an_adapter_takes_the_served_one(tmp_path):
    """``settle`` at an adapter revision whose re-training differs: the adapters take the served adapter, the base
    is untouched. The mismatch probe of an earlier revision runs that revision's adapter, not the current one."""
    from consumers.trainer.models import HFPolicy
    from policy import hf, lora
    from schemas.plan import LoraSpec

    fam = "org/tiny-llama"
    ck = tmp_path / "checkpoints"
    ref0 = hf.save_checkpoint(_lora_llama(), ck, fam, 0)
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, ref=ref0)
    rev = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    recs = [testing.training_record(i, family=fam, revision_=0, reward=float(i % 2)) for i in range(4)]
    b = batch_of(recs, rev)
    trainer.step(to_tensors(b), b)
    r1 = trainer.publish(run_id="run", batch=b)
    served = {k: v.clone() for k, v in lora.adapter_state(trainer.model).items()}
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    other = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, ref=ref0)  # new A
    assert not other.settle(r1.checkpoint, 1)
    held = other.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in served.items())
    assert all(torch.equal(held[k], v) for k, v in base.items())
    # r0's rows probed under r0 (no adapter: B = 0), not under r1's adapter
    old = to_tensors(b)
    figures = trainer.mismatch(old, b, torch.zeros_like(old.old_logprobs[:, 1:]))
    with torch.no_grad():
        expected = (HFPolicy.logprobs(HFPolicy.load(ref0), old) - old.old_logprobs[:, 1:]).abs()
    expected = expected[old.loss_mask[:, 1:] > 0]
    assert figures["mismatch_mean"] == pytest.approx(float(expected.mean()), abs=1e-6)


async def test_a_lora_trainer_taken_over_between_training_states_resumes_its_adapter_exactly(tmp_path):
    """A LoRA run publishing adapters, training states every 3 revisions: the trainer stops after r5; its successor
    opens the committed r5 (its adapter over the base it names), loads r3's state, trains r4's and r5's batches
    again, settles on r5's adapter and trains r6: the same adapter revision, adapters and moments, bit for bit, as
    a trainer that never stopped, and still an adapter naming revision 0."""
    from policy import hf, lora
    from schemas import codec
    from schemas.plan import LoraSpec
    from schemas.policy import CheckpointRef

    fam = "org/tiny-llama"
    ref0 = hf.save_checkpoint(_lora_llama(), tmp_path / "r0", fam, 0)
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    log: dict[int, bytes] = {}

    async def read_records(topic, partition, offsets):
        return [_Rec(o, log[o]) for o in offsets if o in log]

    def batch(k):
        recs = [testing.training_record(10 * k + i, family=fam, revision_=k, reward=float((i + k) % 2))
                for i in range(4)]
        return batch_of(recs, testing.revision(k, family=fam).model_copy(update={"checkpoint": ref0}))

    async def feed(task, k):
        log[k] = codec.encode(batch(k))
        outs = await task.process(_Rec(k, log[k]))
        task.committed()
        return outs[-1].event

    options = dict(state_every=3, lora=spec, lr=5e-2)
    straight = TrainerTask(0, fam, tmp_path / "ck", target_checkpoint=lambda t: ref0, **options)
    for k in range(5):
        await feed(straight, k)
    assert straight.base["revision"] == 3 and [o for _, o in straight.since] == [3, 4]
    successor = TrainerTask(0, fam, tmp_path / "ck", read_records=read_records, **options)
    successor.load_state(json_roundtrip(straight.state()))
    r6 = await feed(successor, 5)
    await feed(straight, 5)
    assert r6.revision == 6 and r6.checkpoint.adapter and lora.base_of(r6.checkpoint) == ref0
    # the same tensors (not the same digest: safetensors 0.8 writes its metadata in a random order)
    mine, theirs = hf.load_weights(r6.checkpoint), hf.load_weights(CheckpointRef(**straight.current["checkpoint"]))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a, b = straight.trainer, successor.trainer
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        sa, sb = a.opt.state.get(pa, {}), b.opt.state.get(pb, {})
        assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)
