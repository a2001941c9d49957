"""What the trainer keeps and takes over: checkpoints and training states pruned by the log's commit, a take-over
between training states trained again to the same state, a state the disk refuses, the run's max_steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from consumers import testing
from consumers.trainer.task import TrainerTask
from consumers.trainer.state import TRAINING_STATE_SUFFIX, wait_for_training_states
from consumers.trainer.step import ReferenceTrainer, initial_revision
from consumers.trainer.tensors import to_tensors
from policy.checkpoint import load_checkpoint

from _trainer_batches import BatchRec, batch_of, json_roundtrip, record


def test_nothing_a_take_over_may_need_is_removed_before_the_commit_that_supersedes_it(tmp_path):
    """Four batches trained in one transaction (a backlog), training states every 2 revisions: until that
    transaction commits, the revision committed before it (r0, not written here) and every file written since stay;
    after the commit (``prune``) only the newest checkpoints (keep_checkpoints) and the committed training state
    (r4's) are left."""
    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    model = load_checkpoint(rev0.checkpoint)
    recs = [record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
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
    recs = [record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)]
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
    b = batch_of([record(i, model, list(b"2+2="), list(b"4"), 1.0 if i % 2 else -1.0) for i in range(4)], rev0)
    trainer = ReferenceTrainer(model, "tiny", 0, tmp_path / "ck", state_every=2, last_revision=4)
    revs = []
    for _ in range(4):
        trainer.step(to_tensors(b), b)
        revs.append(trainer.publish(run_id="run", batch=b))
    wait_for_training_states()
    states = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.endswith(TRAINING_STATE_SUFFIX))
    assert states == [Path(revs[1].checkpoint.uri).name.replace(".pt", TRAINING_STATE_SUFFIX)]
    assert trainer.last_state() == (2, revs[1].checkpoint)


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
        return [BatchRec(o, log[o]) for o in offsets if o in log]

    def batch(k):
        return batch_of([record(10 * k + i, model, list(b"2+2="), list(b"45"[: 1 + k % 2]), (-1.0) ** (i + k),
                                 rev=k) for i in range(4)], testing.revision(k).model_copy(
            update={"checkpoint": rev0.checkpoint}))

    async def feed(task, k):
        log[k] = codec.encode(batch(k))
        outs = await task.process(BatchRec(k, log[k]))
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
        outs = await task.process(BatchRec(k, codec.encode(batch_of(recs, target)), key=b"tiny"))
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
        outs = await task.process(BatchRec(k, codec.encode(batch_of(recs, target)), key=b"tiny"))
        task.committed()
        kinds.append([type(o.event).__name__ for o in outs])
        target = next((o.event for o in outs if isinstance(o.event, PolicyRevision)), target)
    assert target.revision == 2 and kinds[:2] == [["PolicyRevision"], ["PolicyRevision"]]
    assert kinds[2] == ["DeadLetter"] * 4
    assert all(o.event.error_type == "RunComplete" and "max_steps 2" in o.event.error_message for o in outs)


def test_a_state_written_and_read_in_one_process_prints_no_warning(tmp_path):
    """torch.distributed.checkpoint warned "torch.distributed is disabled" on every demo's stderr (its first save,
    its first load), though one process is what is meant."""
    import warnings

    from consumers.trainer.distributed import load_sharded, local_state, save_sharded

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:  # the process's filters, its registries cleared
        save_sharded(local_state(model, opt), tmp_path / "state", tmp_path / "tmp", writer=True)
        torch.nn.init.zeros_(model.weight)
        load_sharded(model, opt, tmp_path / "state")
    assert torch.equal(model.weight, want["weight"])
    assert [str(w.message) for w in caught] == []
