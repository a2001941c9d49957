"""Derived runs (``rollout derive``, issue 25) on a real broker: a run whose reward function had a bug,
re-scored with the fix and re-trained into a chain of its own; a derived run SIGKILLed and resumed; the
refusals a user meets first. The pure parts (the rule, the range, the re-scoring) are in test_history.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import duckdb
import pytest

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from consumers.trainer.step import initial_revision
from replay.audit import run_audit
from replay.ingest import Replayer
from rollout.cli import build_parser
from rollout.derive_cmd import DeriveError, run_derived
from rollout.rl_cmd import DEFAULT_LR
from schemas import codec
from schemas.events import DeadLetter, Rollout, RolloutScored, Step, TrainerBatch
from schemas.policy import PolicyRevision
from schemas.scoring import ScoringSpec, WeightedFunc
from streams import serde, topics
from streams.revisions import publish
from tests import _rewards
from tests._processes import stop
from tests.test_eos_pipeline import read_all, seed_groups

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def _spec(fn: str) -> dict:
    return ScoringSpec(kind="rubric", funcs=[WeightedFunc(fn=fn)]).model_dump(mode="json")


async def _source_run(kw, monkeypatch, tmp_path: Path, groups: int, *, spec: dict | None = None) -> tuple[str, str]:
    """A run of its own (prefix and run id), revision 0 published, ``groups`` groups of 4 rollouts seeded."""
    run_id = f"src-{uuid.uuid4().hex[:8]}"
    prefix = f"{run_id}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    await topics.create_topics(kw)
    await publish(kw, initial_revision(testing.FAMILY, tmp_path / "a", seed=0, run_id=run_id))
    await seed_groups(kw, groups, spec=spec, run_id=run_id)
    return run_id, prefix


def _args(*argv: str):
    return build_parser().parse_args(["derive", *argv])


async def _events(kw, topic: str, cls):
    return [codec.decode(r.value, cls) for r in await read_all(kw, topic, idle_s=0.5, timeout_s=20)]


async def _ends(kw, prefix: str) -> dict[str, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    cons = AIOKafkaConsumer(**kw)
    await cons.start()
    try:
        tps = [TopicPartition(prefix + t.key, p) for t in topics.TOPICS.values() for p in range(t.partitions)]
        return {f"{tp.topic}:{tp.partition}": n for tp, n in (await cons.end_offsets(tps)).items()}
    finally:
        await cons.stop()


async def test_a_run_with_a_buggy_reward_re_scored_with_the_fix_and_re_trained(kafka_settings, monkeypatch, tmp_path):
    kw = kafka_settings.client_kwargs()
    source, prefix_a = await _source_run(kw, monkeypatch, tmp_path, 8, spec=_spec("tests._rewards:buggy_sum"))
    settings = ServiceSettings(family=testing.FAMILY, batch_records=8, flush_after_s=1.0,
                               checkpoint_dir=str(tmp_path / "a"))
    async with System(("verifier", "credit", "batcher", "trainer"), settings, kw):  # run A, live, with the bug
        for _ in range(120):
            revs_a = await _events(kw, prefix_a + "policy-revisions", PolicyRevision)
            if max(r.revision for r in revs_a) >= 4:
                break
            await asyncio.sleep(0.5)
    assert max(r.revision for r in revs_a) == 4  # 32 records, 8 a batch
    rollouts = {r.rollout_id: r for r in await _events(kw, prefix_a + "rollouts", Rollout)}
    steps = {s.rollout_id: s for s in await _events(kw, prefix_a + "steps", Step)}
    before = await _ends(kw, prefix_a)

    out = await run_derived(_args(source, "--rubric", "tests._rewards:fixed_sum", "--credit", "reinforce_baseline",
                                  "--batch-records", "8",
                                  "--flush-after-s", "1", "--checkpoint-dir", str(tmp_path / "b"), "--no-progress"),
                            kafka_settings)
    derived, prefix_b = out["run_id"], out["prefix"]
    assert await _ends(kw, prefix_a) == before, "the derived run wrote into the source run's topics"

    scores = await _events(kw, prefix_b + "scores", RolloutScored)
    assert Counter(s.rollout_id for s in scores) == Counter(list(rollouts))  # every source rollout scored once
    for s in scores:  # the fixed function's reward, and the source event it came from
        st = steps[s.rollout_id]
        fixed = _rewards.fixed_sum([m.model_dump() for m in st.prompt], [m.model_dump() for m in st.completion])
        assert s.rewards == {"solver": fixed}
        assert s.run_id == derived and s.source.run_id == source and s.source.topic == prefix_a + "rollouts"
    batches = await _events(kw, prefix_b + "trainer-batches", TrainerBatch)
    used = Counter(r.rollout_id for b in batches for r in b.records)
    assert used == Counter(list(rollouts))  # each source rollout in exactly one batch of B
    assert all(b.history is not None and b.history.source_run_id == source for b in batches)
    assert {r.credit for b in batches for r in b.records} == {"reinforce_baseline"}  # re-credited, too
    revs_b = await _events(kw, prefix_b + "policy-revisions", PolicyRevision)
    assert revs_b[0].fork == revs_a[0].ref() and revs_b[0].family == out["family"]
    assert max(r.revision for r in revs_b) >= 3
    print(f"run A rewards mean {sum(sum(s.rewards.values()) for s in await _events(kw, prefix_a + 'scores', RolloutScored)) / 32:.3f}, "
          f"run B {sum(sum(s.rewards.values()) for s in scores) / 32:.3f}; B: {len(batches)} batches, "
          f"{len(revs_b) - 1} revisions, {out['seconds']:.1f}s for 32 source rollouts")

    db = str(tmp_path / "both.duckdb")  # the derived run replays with its source: one database, both runs
    await Replayer(db, kafka_settings, run_id=derived, prefix=prefix_b).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] == 4 + len(revs_b) - 1  # A's chain and B's, from B's tip back to r0
    with duckdb.connect(db, read_only=True) as con:
        pairs = con.execute("""
            SELECT a.rollout_id, a.rewards['solver'], b.rewards['solver'], b.source_offset
            FROM scores a JOIN scores b ON b.rollout_id = a.rollout_id AND b.source_run_id = a.run_id
            WHERE a.run_id = ? AND b.run_id = ?""", [source, derived]).fetchall()
    assert len(pairs) == 32
    assert all(old != new for _, old, new, _ in pairs if new == 1.0)  # the bug never rewarded a right answer


async def test_a_derived_run_sigkilled_and_resumed_uses_every_source_rollout_once(kafka_settings, kafka_bootstrap,
                                                                                 monkeypatch, tmp_path):
    kw = kafka_settings.client_kwargs()
    source, _ = await _source_run(kw, monkeypatch, tmp_path, 60)  # 240 rollouts
    derived = f"derive-{uuid.uuid4().hex[:8]}"
    prefix_b = f"{derived}."
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap, "PYTHONPATH": str(ROOT)}
    env.pop("ROLLOUT_TOPIC_PREFIX")
    # every source record is of r0 and 30 batches follow: a bound above 30 keeps them all (test_history: the rule)
    cmd = [sys.executable, "-m", "rollout.cli", "derive", source, "--run-id", derived, "--batch-records", "8",
           "--max-off-policy-steps", "64",
           "--flush-after-s", "1", "--checkpoint-dir", str(tmp_path / "b"), "--no-progress"]
    log = open(tmp_path / "derive.log", "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            try:
                revs = await _events(kw, prefix_b + "policy-revisions", PolicyRevision)
            except Exception:  # noqa: BLE001 - its topics are not there yet
                revs = []
            if len(revs) >= 4:
                break
            await asyncio.sleep(0.25)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        at_kill = len(revs) - 1
        assert 3 <= at_kill < 30, f"killed at {at_kill} revisions: not mid-way"
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert proc.wait(300) == 0, (tmp_path / "derive.log").read_text()[-3000:]
    finally:
        stop(proc)
    batches = await _events(kw, prefix_b + "trainer-batches", TrainerBatch)
    scores = await _events(kw, prefix_b + "scores", RolloutScored)
    revs = await _events(kw, prefix_b + "policy-revisions", PolicyRevision)
    used = Counter(r.rollout_id for b in batches for r in b.records)
    print(f"killed after {at_kill} revisions; resumed: {len(revs) - 1} revisions, {sum(used.values())} records, "
          f"{len(scores)} scores")
    assert Counter(s.rollout_id for s in scores) == Counter({f"g{g:06d}-r{i}": 1 for g in range(60) for i in range(4)})
    assert used == Counter(s.rollout_id for s in scores)  # every source rollout trained once: none lost, none twice
    assert [r.revision for r in revs] == list(range(len(revs)))  # the chain from the fork (r0), unbroken
    assert len(revs) - 1 == len(batches)


async def test_a_group_the_source_run_left_incomplete_is_dead_lettered_before_derive_finishes(
        kafka_settings, monkeypatch, tmp_path):
    """A source group with 3 of its 4 rollouts (an arena stopped mid-group, or a range that cuts it): derive does not
    say it is done while credit holds the group; after ``--group-timeout-s`` credit flushes it (credited within the 3
    that arrived), it is trained with the whole groups, and the run then ends."""
    kw = kafka_settings.client_kwargs()
    source, _ = await _source_run(kw, monkeypatch, tmp_path, 2)
    cut = []
    for steps, ro in testing.arithmetic_group("gcut", 4, run_id=source)[:3]:
        for ev, topic in [*((st, topics.STEPS.name) for st in steps), (ro, topics.ROLLOUTS.name)]:
            key, value, _ = serde.to_message(ev)
            cut.append((topic, key, value))
    await seed_groups(kw, 1, start=100, extra=cut, run_id=source)
    out = await run_derived(_args(source, "--batch-records", "4", "--flush-after-s", "1", "--group-timeout-s", "12",
                                  "--checkpoint-dir", str(tmp_path / "b"), "--no-progress"), kafka_settings)
    prefix_b = out["prefix"]
    assert not await _events(kw, prefix_b + "dead-letters", DeadLetter)
    batches = await _events(kw, prefix_b + "trainer-batches", TrainerBatch)
    records = [r for b in batches for r in b.records]
    assert Counter(r.rollout_id.rsplit("-r", 1)[0] for r in records) == \
        Counter({"g000000": 4, "g000001": 4, "g000100": 4, "gcut": 3})
    assert {r.credit for r in records if r.rollout_id.startswith("gcut")} == {"grpo:flushed(3/4,timeout)"}


async def test_a_derived_run_refuses_what_it_cannot_use_in_one_line(kafka_settings, monkeypatch, tmp_path):
    kw = kafka_settings.client_kwargs()
    source, prefix = await _source_run(kw, monkeypatch, tmp_path, 1)
    with pytest.raises(DeriveError, match=r"run 'no-such-run' is not on the log \(`rollout runs`"):
        await run_derived(_args("no-such-run"), kafka_settings)
    with pytest.raises(DeriveError, match=r"--rubric nosuch.module:fn: cannot load the reward function"):
        await run_derived(_args(source, "--rubric", "nosuch.module:fn"), kafka_settings)
    with pytest.raises(DeriveError, match=r"has no revision 7 \(it has r0\): choose --fork"):
        await run_derived(_args(source, "--fork", "7"), kafka_settings)
    derived = f"derive-{uuid.uuid4().hex[:8]}"  # a derived run resumed with other settings would mix two runs
    await run_derived(_args(source, "--run-id", derived, "--flush-after-s", "0.5", "--no-progress",
                            "--checkpoint-dir", str(tmp_path / "b")), kafka_settings)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)  # run_derived moved this process to the derived run's topics
    with pytest.raises(DeriveError, match=rf"derived run {derived} was started with other settings \(rescore "
                                          r"differ\): resume it with its first flags"):
        await run_derived(_args(source, "--run-id", derived, "--flush-after-s", "0.5", "--rubric",
                                "tests._rewards:fixed_sum"), kafka_settings)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    with pytest.raises(DeriveError, match=rf"derived run {derived} was started with other settings \(flush_after_s, "
                                          r"lr differ\)"):  # the flags that shape its training, too
        await run_derived(_args(source, "--run-id", derived, "--lr", "0.5"), kafka_settings)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    ckpt = next((tmp_path / "a").glob("*.pt"))
    ckpt.write_bytes(ckpt.read_bytes() + b"\0")
    with pytest.raises(DeriveError, match=r"does not match its digest .* refusing to train from different weights"):
        await run_derived(_args(source), kafka_settings)
    ckpt.unlink()
    with pytest.raises(DeriveError, match=r"its checkpoint .* is missing"):
        await run_derived(_args(source), kafka_settings)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    # the CLI: the same refusal, one line on stderr, exit code 2, no traceback
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "derive", source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is missing" in done.stderr, done.stderr


async def test_a_derived_run_with_an_admission_gate_trains_only_the_groups_with_signal(kafka_settings, monkeypatch,
                                                                                       tmp_path):
    """``--gate 0:0`` (prime-rl's ``advantage_range`` gate): a group whose rollouts were all rewarded alike is not
    trained on and gets its refund on the derived run's ledger; every other group is trained, each record once."""
    from schemas.admission import AdmissionRefund

    kw = kafka_settings.client_kwargs()
    source, prefix_a = await _source_run(kw, monkeypatch, tmp_path, 16)  # about half of each group's answers right
    for bad, why in ((["--gate", "0"], r"--gate '0': give MIN:MAX"), (["--gate", "1:0"], r"reject_min \(1.0\) is above"),
                     (["--gate", "0:0", "--credit", "reinforce_baseline"], r"credits each rollout alone")):
        with pytest.raises(DeriveError, match=why):
            await run_derived(_args(source, *bad), kafka_settings)
    out = await run_derived(_args(source, "--gate", "0:0", "--batch-records", "8", "--flush-after-s", "1",
                                  "--checkpoint-dir", str(tmp_path / "b"), "--no-progress"), kafka_settings)
    prefix_b = out["prefix"]
    group_of = {r.rollout_id: r.group_id for r in await _events(kw, prefix_a + "rollouts", Rollout)}
    rewards: dict[str, set[float]] = {}
    for s in await _events(kw, prefix_b + "scores", RolloutScored):
        rewards.setdefault(group_of[s.rollout_id], set()).add(s.rewards["solver"])
    flat = {g for g, rs in rewards.items() if len(rs) == 1}
    assert len(rewards) == 16 and flat and flat != set(rewards)  # the seeded groups hold both kinds
    batches = await _events(kw, prefix_b + "trainer-batches", TrainerBatch)
    trained = Counter(r.rollout_id for b in batches for r in b.records)
    assert set(trained.values()) == {1}
    assert {group_of[r] for r in trained} == set(rewards) - flat
    refunds = [codec.decode(r.value, AdmissionRefund) for r in
               await read_all(kw, prefix_b + "admissions", idle_s=0.5, timeout_s=20)]
    assert sorted(r.group_id for r in refunds) == sorted(flat)
    assert not await read_all(kw, prefix_b + "dead-letters", idle_s=0.5, timeout_s=5)


async def test_a_prime_rl_trace_stream_imported_then_derived_from(kafka_settings, monkeypatch, tmp_path):
    """History from outside: a prime-rl run's trace stream (tests/fixtures/prime-rl-trace-stream) imported as a run
    (its rewards as recorded, no weights), then re-trained from weights given for its revision 0."""
    from policy.checkpoint import save_checkpoint
    from policy.model import PolicyModel
    from replay.trace_import import import_file, produce_imported

    kw = kafka_settings.client_kwargs()
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"prs-{uuid.uuid4().hex[:8]}.")
    await topics.create_topics(kafka_settings.admin_kwargs())
    imp = import_file(ROOT / "tests/fixtures/prime-rl-trace-stream", f"prs-{uuid.uuid4().hex[:8]}")
    await produce_imported(imp, kafka_settings)
    source_scores = {s.rollout_id: s for ep in imp.episodes for kind, s in ep if kind == "scores"}
    trainable = Counter({s.rollout_id: sum(len(t.completion_token_ids) > 0 for t in s.trainable_steps)
                         for s in source_scores.values() if s.trainable_steps and not s.evaluation})
    with pytest.raises(DeriveError, match="names no checkpoint .* --fork-checkpoint PATH"):
        await run_derived(_args(imp.run_id), kafka_settings)
    weights = save_checkpoint(PolicyModel.from_seed(0), tmp_path / "w", "imported", 0)  # token ids are < 256 here
    out = await run_derived(_args(imp.run_id, "--fork-checkpoint", weights.uri.removeprefix("file://"),
                                  "--batch-records", "2", "--flush-after-s", "1", "--no-progress",
                                  "--checkpoint-dir", str(tmp_path / "b")), kafka_settings)
    prefix_b = out["prefix"]
    scores = await _events(kw, prefix_b + "scores", RolloutScored)
    # as recorded; its held-out answers are the source run's, not re-scored
    assert any(s.evaluation for s in source_scores.values())
    assert {s.rollout_id: s.rewards for s in scores} == {r: s.rewards for r, s in source_scores.items()
                                                         if not s.evaluation}
    batches = await _events(kw, prefix_b + "trainer-batches", TrainerBatch)
    assert Counter(r.rollout_id for b in batches for r in b.records) == trainable  # one record per trainable step
    revs = await _events(kw, prefix_b + "policy-revisions", PolicyRevision)
    assert revs[0].fork.family == "Qwen/Qwen3-0.6B" and revs[0].checkpoint.digest == weights.digest
    assert len(revs) - 1 == len(batches) >= 2
    db = str(tmp_path / "both.duckdb")
    await Replayer(db, kafka_settings, run_id=out["run_id"], prefix=prefix_b).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    with duckdb.connect(db, read_only=True) as con:
        assert con.execute("SELECT count(DISTINCT run_id) FROM rollouts").fetchone()[0] == 1  # the source's
        assert con.execute("SELECT count(*) FROM training_records WHERE source_run_id = ?",
                           [imp.run_id]).fetchone()[0] == sum(len(b.records) for b in batches)


TINY_EVAL_RECIPE = """
[model]
name = "tiny-byte-lm"

[orchestrator]
batch_size = 16
group_size = 8
max_off_policy_steps = 2
max_steps = 3

[orchestrator.train.sampling]
temperature = 1.0
max_tokens = 16

[[orchestrator.train.env]]
id = "arithmetic"
name = "arithmetic"
args = { reward = "shaped", eval_examples = 16 }

[orchestrator.advantage]
type = "grpo"

[orchestrator.eval]
interval = 2
"""


def test_a_derived_run_is_evaluated_on_its_sources_questions_at_its_cadence(kafka_settings, kafka_bootstrap, tmp_path):
    """Issue 35: a derived run answers the held-out questions its source run answered, at the source's cadence
    (the plan `rollout rl` recorded on revision 0), so both runs compare by held-out accuracy in one query."""
    recipe = tmp_path / "tiny-eval.toml"
    recipe.write_text(TINY_EVAL_RECIPE)
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap, "PYTHONPATH": str(ROOT)}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    rl = subprocess.run([sys.executable, "-m", "rollout.cli", "rl", str(recipe), "--no-progress"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert rl.returncode == 0, rl.stdout[-2000:] + rl.stderr[-2000:]
    source = json.loads(rl.stdout.strip().splitlines()[-1])
    assert source["eval_questions_by_revision"] == {"0": 16, "2": 16, "3": 16}  # r0, every 2, and the last
    derived = f"derive-{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "derive", source["run"], "--run-id", derived,
                          "--batch-records", "16", "--flush-after-s", "1", "--checkpoint-dir", str(tmp_path / "b"),
                          "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "evaluated revisions r0, r2, r3" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"at lr {DEFAULT_LR:g}" in out.stderr  # the source's (rl's default: the recipe sets none), as recorded

    db = str(tmp_path / "both.duckdb")
    asyncio.run(Replayer(db, kafka_settings, run_id=derived, prefix=f"{derived}.").run())
    with duckdb.connect(db, read_only=True) as con:
        rows = con.execute("SELECT policy_family, policy_revision, answers FROM v_eval_accuracy_by_revision").fetchall()
        same = con.execute("""
            SELECT count(*), count(*) FILTER (WHERE a.reward = b.reward) FROM v_eval_answers a JOIN v_eval_answers b
            ON b.example_id = a.example_id AND b.policy_revision = a.policy_revision
            WHERE a.policy_family = 'tiny-byte-lm' AND b.policy_family = ? AND a.policy_revision = 0""",
                           [f"tiny-byte-lm.{derived}"]).fetchone()
    print(rows)
    assert sorted(rows) == sorted((family, r, 16) for family in ("tiny-byte-lm", f"tiny-byte-lm.{derived}")
                                  for r in (0, 2, 3))
    assert same == (16, 16)  # the same 16 questions; at the fork (the same weights, greedy) the same answers


def test_a_resumed_derived_run_that_leaves_off_a_flag_it_started_with_is_refused():
    """``--gate`` given at the start and left off at the resume: a difference, as a flag given only now is (it once
    passed, and the resumed run trained without its gates)."""
    from rollout.derive_cmd import changed_settings

    flags = {"credit": None, "lr": None, "flush_after_s": 0.5}
    started = {"run_id": "d", "rescore": None, "flags": {**flags, "gates": [[0.0, 0.0]]}}
    assert changed_settings(started, {"run_id": "d", "rescore": None, "flags": flags}) == ["gates"]
    assert changed_settings(started, {"run_id": "d", "rescore": None, "flags": {**flags, "gates": [[0.0, 0.0]]}}) == []
    assert changed_settings(started, {"run_id": "d", "rescore": "x", "flags": {**flags, "lr": 0.5, "gates": [[0.0, 0.0]]}}) \
        == ["lr", "rescore"]
    unrecorded = {"run_id": "d", "rescore": None}  # started before flags were recorded: its derivation alone
    assert changed_settings(unrecorded, {"run_id": "d", "rescore": None, "flags": {**flags, "lr": 0.5}}) == []


def test_a_derived_run_forked_from_an_adapter_is_evaluated_on_a_server_that_serves_adapters():
    """A LoRA source that served adapters: its revisions from r1 on are adapters alone. A derived run forked at r1
    starts its evaluation there, so its server is started with LoRA (``VllmServer.for_plan``: ``--enable-lora``);
    before, it was started without, refused the fork's adapter, and ``derive`` failed after training. Forked at r0
    (whole weights) it serves no adapter, as a derived run's own revisions are whole; a plan without LoRA cannot
    serve the adapter fork, and says so instead of failing later."""
    from rollout.derived_evaluation import NoPlan, server_plan
    from schemas.plan_compiler import compile_plan
    from schemas.policy import ADAPTER_WEIGHTS, CheckpointRef

    plan = compile_plan(ROOT / "examples/plans/arithmetic-smollm2-lora.toml")
    assert plan.lora is not None and plan.lora.serving == "adapter"

    def revision(n: int, weights: str) -> PolicyRevision:
        return PolicyRevision(run_id="src", producer="trainer", family=plan.family, revision=n, checkpoint=CheckpointRef(
            uri=f"file:///ck/r{n}/{weights}", digest=f"{n:064x}"))

    source = [revision(0, "model.safetensors"), revision(1, ADAPTER_WEIGHTS), revision(2, ADAPTER_WEIGHTS)]
    assert server_plan(plan, source, 1).lora == plan.lora
    assert server_plan(plan, source, 0).lora is None
    with pytest.raises(NoPlan, match="LoRA adapter"):
        server_plan(plan.model_copy(update={"lora": None}), source, 2)


def test_a_derived_run_trains_with_its_sources_recorded_credit_batch_size_and_lr_unless_told_otherwise(tmp_path):
    """Before, a derived run took grpo, the batcher's batch size and the trainer's optimizer whatever its source ran
    with: re-training a reinforce_baseline run with batches of 24 trained grpo on batches of the default size."""
    from rollout.derive_cmd import training_settings
    from schemas.plan_compiler import compile_plan

    recipe = tmp_path / "source.toml"
    recipe.write_text(TINY_EVAL_RECIPE.replace('type = "grpo"', 'type = "reinforce_baseline"\nalpha = 0.5')
                      .replace("batch_size = 16", "batch_size = 24") + "\n[trainer.optim]\nlr = 3e-4\n")
    plan = compile_plan(str(recipe))
    source = [PolicyRevision(run_id="src", producer="trainer", family=plan.family, revision=0,
                             plan=plan.model_dump(mode="json"))]
    got = training_settings(source)
    assert (got["credit"], got["batch_records"], got["lr"]) == ("reinforce_baseline", 24, 3e-4)
    assert got["credit_params"]["alpha"] == 0.5
    told = training_settings(source, credit="grpo", batch_records=8, lr=1e-3)
    assert (told["credit"], told["batch_records"], told["lr"]) == ("grpo", 8, 1e-3) and "credit_params" not in told
    assert training_settings([]) == {}  # nothing recorded: the services' defaults
