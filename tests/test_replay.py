"""Replay against a real broker (testcontainers): runs produced through transactional producers with
streams.serde.to_message, as the pipeline's stages commit them; then replayed, audited, re-replayed.

Each test uses its own topic prefix (ROLLOUT_TOPIC_PREFIX), so streams.topics names are used as-is.
"""

from __future__ import annotations

import asyncio
import uuid

import duckdb
import numpy as np
import pytest

from replay import ingest
from replay.audit import audit, run_audit
from replay.ingest import Replayer, ReplayError, Until
from replay.runs import default_topics, list_runs, topics_for
from replay.synthetic import generate_run, produce
from rollout.cli import main
from schemas import codec
from schemas.events import TrainingRecord
from streams import topics
from streams.serde import to_message
from streams.settings import FETCH_OPTIONS
from tests.test_eos_pipeline import read_to_end

pytestmark = pytest.mark.integration

TABLE = {"policy-revisions": "policy_revisions", "steps": "steps", "rollouts": "rollouts", "scores": "scores",
         "training-records": "training_records", "trainer-batches": "trainer_batches", "dead-letters": "dead_letters"}


@pytest.fixture
async def log(kafka_settings, monkeypatch):
    """Kafka settings with this test's own set of pipeline topics (and the env the CLI reads)."""
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"test.replay.{uuid.uuid4().hex[:8]}.")
    monkeypatch.setenv("ROLLOUT_BOOTSTRAP_SERVERS", kafka_settings.bootstrap)
    await topics.create_topics(kafka_settings.admin_kwargs())
    return kafka_settings


async def produce_run(settings, run, transactions=None):
    return await produce(run.transactions if transactions is None else transactions, settings.client_kwargs(),
                         default_topics(), transactional_id=f"test-{uuid.uuid4().hex[:8]}")


def table_digest(db: str) -> dict[str, list]:
    """Every table's rows, sorted: what 'the same database' means."""
    con = duckdb.connect(db, read_only=True)
    try:
        out = {}
        for (name,) in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall():
            out[name] = sorted(r[0] for r in con.execute(f"SELECT t::VARCHAR FROM {name} t").fetchall())
        return out
    finally:
        con.close()


def counts(db: str) -> dict[str, int]:
    con = duckdb.connect(db, read_only=True)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLE.values()}
    finally:
        con.close()


async def test_replay_counts_match_and_audit_is_clean(log, tmp_path):
    run = generate_run(uuid.uuid4().hex, rounds=3, groups=3, group_size=4)
    other = generate_run(uuid.uuid4().hex, rounds=1, seed=7)  # another run interleaved on the same topics
    await produce_run(log, other, other.transactions[:3])
    await produce_run(log, run)
    await produce_run(log, other, other.transactions[3:])
    db = str(tmp_path / "run.duckdb")
    result = await Replayer(db, log, run_id=run.run_id).run()
    assert result.other_runs == sum(other.counts().values())
    want = {TABLE[k]: n for k, n in run.counts().items()}
    assert {t: n for t, n in counts(db).items() if n} == want
    con = duckdb.connect(db, read_only=True)
    assert con.execute("SELECT count(DISTINCT run_id), any_value(run_id) FROM steps").fetchone() == (1, run.run_id)
    # the token arrays made it through Kafka bit for bit
    step = run.events("steps")[5]
    ids, lps = con.execute("SELECT completion_token_ids, completion_logprobs FROM steps WHERE step_id = ?",
                           [step.step_id]).fetchone()
    assert np.array_equal(np.array(ids, dtype=np.int32), step.completion_token_ids)
    assert np.array_equal(np.array(lps, dtype=np.float32), step.completion_logprobs)
    report = audit(con)
    con.close()
    assert report.ok, report.findings
    assert report.checked["batch_digests"] == len(run.events("trainer-batches"))
    # the CLI says so and exits 0
    from rollout.cli import main

    assert await asyncio.to_thread(main, ["audit", "--db", db]) == 0


async def test_a_run_of_an_org_slash_name_family_replays_audits_and_reports(log, tmp_path):
    """The family as Hugging Face names models (``org/name``) through Kafka (the revisions' and batches' record
    key), replay, audit and report: it stays whole everywhere, and the CLI's audit and report work on it."""
    fam = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    run = generate_run(uuid.uuid4().hex, rounds=3, groups=2, group_size=3, eval_questions=2, family=fam)
    await produce_run(log, run)
    raw = await read_to_end(log.client_kwargs(), topics.POLICY_REVISIONS.name)
    assert {r.key for r in raw} == {fam.encode()}
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, log, run_id=run.run_id).run()
    assert {t: n for t, n in counts(db).items() if n} == {TABLE[k]: n for k, n in run.counts().items()}
    con = duckdb.connect(db, read_only=True)
    assert con.execute("SELECT DISTINCT family FROM policy_revisions").fetchall() == [(fam,)]
    assert con.execute("SELECT DISTINCT family FROM trainer_batches").fetchall() == [(fam,)]
    assert con.execute("SELECT DISTINCT policy_family FROM steps WHERE trainable").fetchall() == [(fam,)]
    assert con.execute("SELECT family, count(*) FROM v_logprob_mismatch GROUP BY ALL").fetchall() == [(fam, 3)]
    con.close()
    report = run_audit(db)
    assert report.ok, report.violations[:5]
    assert await asyncio.to_thread(main, ["audit", "--db", db]) == 0
    html = tmp_path / "report.html"
    assert await asyncio.to_thread(main, ["report", "--db", db, "--out", str(html)]) == 0
    page = html.read_text(encoding="utf-8")
    assert f"accuracy ({fam})" in page and "audit OK" in page


async def test_tampered_record_written_to_the_topic_is_caught(log, tmp_path):
    run = generate_run(uuid.uuid4().hex, rounds=2)
    await produce_run(log, run)
    # Someone writes a record straight to the training-records topic: the frame of a batched record
    # with one logprob's bits flipped (still a valid frame), and a frame that is not an event at all.
    rec = run.events("training-records")[3]
    key, value, headers = to_message(rec)
    frame = bytearray(value)
    lp = rec.completion_logprobs.tobytes()
    at = bytes(frame).rindex(lp)
    frame[at] ^= 0x01
    tampered = codec.decode(bytes(frame))
    assert isinstance(tampered, TrainingRecord) and tampered.record_id == rec.record_id
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(**log.client_kwargs())
    await producer.start()
    try:
        name = topics.TRAINING_RECORDS.name
        await producer.send_and_wait(name, value=bytes(frame), key=key, headers=headers)
        await producer.send_and_wait(name, value=b"RLEV garbage", key=b"x", headers=headers)
    finally:
        await producer.stop()
    db = str(tmp_path / "run.duckdb")
    result = await Replayer(db, log, run_id=run.run_id).run()
    assert result.errors == 1
    report = run_audit(db)
    assert not report.ok
    found = {(f.kind, f.subject) for f in report.violations}
    assert ("record_conflict", rec.record_id) in found
    assert any(k == "undecodable" for k, _ in found)
    from rollout.cli import main

    assert await asyncio.to_thread(main, ["audit", "--db", db]) == 1


@pytest.mark.parametrize("flush_rows, fetch_bytes", [(None, None), (5, None), (None, 1024)],
                         ids=["default-flushes", "flushes-of-5-rows", "fetches-smaller-than-a-message"])
async def test_replay_is_idempotent_and_incremental(log, tmp_path, monkeypatch, flush_rows, fetch_bytes):
    """Also with flushes cut every few rows of one event type (in the middle of a fetched batch, as at a whole
    row group in a big run), and with a fetch size below every message's (the broker still sends a whole first
    record batch): the same database, nothing lost or doubled."""
    if flush_rows:
        monkeypatch.setattr(ingest, "FLUSH_ROWS", flush_rows)
    if fetch_bytes:
        from replay import record_sets

        monkeypatch.setitem(FETCH_OPTIONS, "fetch_max_bytes", fetch_bytes)
        monkeypatch.setattr(record_sets, "FETCH_MAX_BYTES", fetch_bytes)
    run = generate_run(uuid.uuid4().hex, rounds=4, seed=3)
    if fetch_bytes:
        assert max(len(codec.encode(e)) for tx in run.transactions for _, e in tx) > fetch_bytes
    first, rest = run.transactions[:6], run.transactions[6:]
    await produce_run(log, run, first)
    a, fresh = str(tmp_path / "a.duckdb"), str(tmp_path / "fresh.duckdb")
    flushes = []
    r1 = await Replayer(a, log, run_id=run.run_id, progress=lambda r: flushes.append(r)).run()
    if flush_rows:
        steps = sum(k == "steps" for tx in first for k, _ in tx)
        assert len(flushes) >= steps // flush_rows > 1
    snap = table_digest(a)
    r2 = await Replayer(a, log).run()  # the run already in the database; nothing new on the log
    assert r2.messages == 0 and sum(r2.rows.values()) == 0
    assert table_digest(a) == snap
    await produce_run(log, run, rest)
    r3 = await Replayer(a, log).run()
    assert r3.messages == sum(len(tx) for tx in rest)  # appended only what is new
    assert r1.messages + r3.messages == sum(run.counts().values())
    await Replayer(fresh, log, run_id=run.run_id).run()
    assert table_digest(a) == table_digest(fresh)
    con = duckdb.connect(a, read_only=True)
    assert con.execute("SELECT count(*) - count(DISTINCT event_id) FROM steps").fetchone()[0] == 0
    con.close()
    assert run_audit(a).ok


async def test_replay_until_reproduces_what_the_trainer_saw(log, tmp_path):
    run = generate_run(uuid.uuid4().hex, rounds=4, seed=5)
    await produce_run(log, run)
    full = str(tmp_path / "full.duckdb")
    await Replayer(full, log, run_id=run.run_id).run()
    con = duckdb.connect(full, read_only=True)
    batches = con.execute("SELECT batch_id, epoch_ms(_ts), _partition, _offset FROM trainer_batches "
                          "ORDER BY _offset").fetchall()
    revs_before = con.execute("SELECT epoch_ms(_ts), revision FROM policy_revisions ORDER BY _offset").fetchall()
    con.close()
    assert len(batches) == 4
    b1_id, b1_ts, part, b2_off = batches[1][0], batches[1][1], batches[2][2], batches[2][3]
    # by time: the state right when batch #1 reached the trainer
    at = str(tmp_path / "at.duckdb")
    await Replayer(at, log, run_id=run.run_id, until=Until(timestamp_ms=b1_ts)).run()
    con = duckdb.connect(at, read_only=True)
    assert [r[0] for r in con.execute("SELECT batch_id FROM trainer_batches ORDER BY _offset").fetchall()] == \
        [b[0] for b in batches[:2]]
    assert con.execute("SELECT max(revision) FROM policy_revisions").fetchone()[0] == \
        max(r for ts, r in revs_before if ts <= b1_ts)
    assert con.execute("SELECT epoch_ms(max(_ts)) FROM trainer_batches").fetchone()[0] <= b1_ts
    assert b1_id in {r[0] for r in con.execute("SELECT batch_id FROM trainer_batches").fetchall()}
    con.close()
    assert run_audit(at).ok  # every record the trainer had was in a batch it had
    # by offsets: trainer-batches before batch #2
    upto = str(tmp_path / "upto.duckdb")
    until = Until.parse(f"{topics.TRAINER_BATCHES.name}:{part}:{b2_off}")
    await Replayer(upto, log, run_id=run.run_id, until=until).run()
    assert counts(upto)["trainer_batches"] == 2
    with pytest.raises(ReplayError, match="not part of the run's topics"):
        await Replayer(str(tmp_path / "bad.duckdb"), log, run_id=run.run_id, until=Until.parse("nope:0:1")).run()
    # an incremental replay past the point reaches the full state
    await Replayer(at, log).run()
    assert table_digest(at) == table_digest(full)


async def test_runs_are_listed_and_the_latest_is_the_default(log, tmp_path):
    older = generate_run("a" + uuid.uuid4().hex[1:], rounds=1)
    newer = generate_run("b" + uuid.uuid4().hex[1:], rounds=1, seed=1)
    await produce_run(log, older)
    await asyncio.sleep(0.05)
    await produce_run(log, newer)
    runs = await list_runs(log)
    assert [r.run_id for r in runs] == [newer.run_id, older.run_id]
    db = str(tmp_path / "latest.duckdb")
    result = await Replayer(db, log).run()
    assert result.run_id == newer.run_id

    assert await asyncio.to_thread(main, ["runs"]) == 0


async def test_runs_under_every_topic_prefix(kafka_settings, monkeypatch, tmp_path, capsys):
    """Without ROLLOUT_TOPIC_PREFIX, runs are found under any prefix (as `rollout demo` writes them); the
    prefix a database was replayed from is kept; setting the variable restricts to its prefix."""
    monkeypatch.setenv("ROLLOUT_BOOTSTRAP_SERVERS", kafka_settings.bootstrap)
    tag = uuid.uuid4().hex[:8]
    demo, other = f"demo-{tag}.", f"test.replay.{tag}."
    for prefix in (demo, other):
        monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
        await topics.create_topics(kafka_settings.admin_kwargs())
    monkeypatch.delenv("ROLLOUT_TOPIC_PREFIX")
    kw = kafka_settings.client_kwargs()
    older = generate_run(uuid.uuid4().hex, rounds=1, seed=3)
    newer = generate_run(uuid.uuid4().hex, rounds=3, seed=4, eval_questions=3, inexact=True)
    await produce(older.transactions, kw, topics_for(other), transactional_id=f"test-{uuid.uuid4().hex[:8]}")
    await asyncio.sleep(0.05)
    first, rest = newer.transactions[:4], newer.transactions[4:]
    await produce(first, kw, topics_for(demo), transactional_id=f"test-{uuid.uuid4().hex[:8]}")

    runs = await list_runs(kafka_settings)
    where = {r.run_id: r.prefix for r in runs}
    assert where[older.run_id] == other and where[newer.run_id] == demo
    assert runs[0].run_id == newer.run_id  # the most recent run of the whole cluster
    assert await asyncio.to_thread(main, ["runs"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if newer.run_id in x)
    assert demo in line

    # no --run: the most recent run, under its prefix, which the database remembers
    db = str(tmp_path / "latest.duckdb")
    r1 = await Replayer(db, kafka_settings).run()
    assert (r1.run_id, r1.prefix, r1.messages) == (newer.run_id, demo, sum(len(tx) for tx in first))
    await produce(rest, kw, topics_for(demo), transactional_id=f"test-{uuid.uuid4().hex[:8]}")
    r2 = await Replayer(db, kafka_settings).run()
    assert r2.messages == sum(len(tx) for tx in rest)
    assert {t: n for t, n in counts(db).items() if n} == {TABLE[k]: n for k, n in newer.counts().items()}
    # the new fields made it through Kafka
    con = duckdb.connect(db, read_only=True)
    assert dict(con.execute("SELECT step_id, policy_exact FROM steps").fetchall()) == \
        {s.step_id: s.policy_exact for s in newer.events("steps")}
    assert con.execute("SELECT count(*) FILTER (WHERE evaluation) FROM rollouts").fetchone()[0] == 3 * 3 == \
        con.execute("SELECT sum(rollouts) FROM v_eval_accuracy_by_revision").fetchone()[0]
    assert {r: dict(m) for r, m in con.execute("SELECT revision, metrics FROM policy_revisions").fetchall()} == \
        {r.revision: r.metrics for r in newer.events("policy-revisions")}
    assert con.execute("SELECT count(*) FROM v_logprob_mismatch").fetchone()[0] == 3
    con.close()
    report = run_audit(db)
    assert report.ok, report.violations[:5]
    assert report.checked["inexact_steps"] == sum(not s.policy_exact for s in newer.events("steps")) > 0

    # --run finds a run under any prefix
    old_db = str(tmp_path / "older.duckdb")
    r3 = await Replayer(old_db, kafka_settings, run_id=older.run_id).run()
    assert r3.prefix == other and r3.messages == sum(older.counts().values())
    with pytest.raises(ReplayError, match="not on the log"):
        await Replayer(str(tmp_path / "none.duckdb"), kafka_settings, run_id="no-such-run").run()

    # ROLLOUT_TOPIC_PREFIX restricts to its prefix
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", other)
    assert [r.run_id for r in await list_runs(kafka_settings)] == [older.run_id]
    with pytest.raises(ReplayError, match=f"from topics {demo}"):
        await Replayer(db, kafka_settings).run()
    assert (await Replayer(str(tmp_path / "restricted.duckdb"), kafka_settings).run()).run_id == older.run_id


async def test_replay_while_services_are_live_leaves_their_groups_alone(log, tmp_path):
    """A live service's consumer group (committed offsets, members, generation) is untouched by a
    replay, and a transaction still open on the log is neither read nor waited for."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    run = generate_run(uuid.uuid4().hex, rounds=2, seed=9)
    await produce_run(log, run)
    group = f"live-verifier-{uuid.uuid4().hex[:6]}"
    service = AIOKafkaConsumer(topics.ROLLOUTS.name, **log.client_kwargs(
        group_id=group, enable_auto_commit=False, auto_offset_reset="earliest", isolation_level="read_committed"))
    await service.start()
    admin = AIOKafkaAdminClient(**log.admin_kwargs())
    await admin.start()
    # a live producer in the middle of a transaction
    live = AIOKafkaProducer(**log.client_kwargs(), transactional_id=f"live-arena-{uuid.uuid4().hex[:6]}")
    await live.start()
    try:
        got = 0
        while got < 10:
            batch = await service.getmany(timeout_ms=1000, max_records=10 - got)
            got += sum(len(v) for v in batch.values())
        await service.commit()
        assignment = set(service.assignment())
        committed = await admin.list_consumer_group_offsets(group)
        groups_before = {g[0] for g in await admin.list_consumer_groups()}
        extra = generate_run(run.run_id, rounds=1, seed=11, tag="extra")  # same run id: more steps of this run, uncommitted
        await live.begin_transaction()
        for key, event in extra.transactions[1]:
            k, v, h = to_message(event)
            await live.send_and_wait(default_topics()[key], value=v, key=k, headers=h)

        db = str(tmp_path / "live.duckdb")
        result = await asyncio.wait_for(Replayer(db, log, run_id=run.run_id).run(), timeout=60)
        assert result.messages == sum(run.counts().values())  # the open transaction is not read
        assert await admin.list_consumer_group_offsets(group) == committed
        assert {g[0] for g in await admin.list_consumer_groups()} == groups_before
        assert set(service.assignment()) == assignment
        # the service goes on from where it was
        more = await service.getmany(timeout_ms=1000)
        assert sum(len(v) for v in more.values()) > 0
        await live.commit_transaction()
        # EndTxn returns before the coordinator has written the commit markers: until they are on the log the
        # last stable offset has not moved, and a replay started at once (one that opens its database quickly)
        # would rightly read nothing new
        for key in {k for k, _ in extra.transactions[1]}:
            await read_to_end(log.client_kwargs(), default_topics()[key])
        r2 = await Replayer(db, log).run()
        assert r2.messages == len(extra.transactions[1])
        assert run_audit(db).ok
    finally:
        await live.stop()
        await admin.close()
        await service.stop()


async def test_the_compiled_reader_and_aiokafkas_give_the_same_database(log, tmp_path, monkeypatch):
    """replay.record_sets: record sets read by the compiled reader (rollout_native) or, record by record, by
    aiokafka's PartitionRecords give the same rows: with aborted transactions of the run (never read), a
    gzip-compressed producer (its batches are left to aiokafka), another run interleaved, and flushes cut
    every 5 steps (in the middle of a record set)."""
    from replay import record_sets
    from replay.synthetic import produce

    assert record_sets.native_reader() is not None, "rollout_native is not built: run `pip install ./native`"
    monkeypatch.setattr(ingest, "FLUSH_ROWS", 5)
    run = generate_run(uuid.uuid4().hex, rounds=4, seed=11)
    ghost = generate_run(run.run_id, rounds=1, seed=12)  # same run id: aborted, so never part of the run
    other = generate_run(uuid.uuid4().hex, rounds=1, seed=13)
    kw = log.client_kwargs()
    await produce_run(log, run, run.transactions[:4])
    await produce(ghost.transactions, kw, default_topics(), transactional_id=f"t-{uuid.uuid4().hex[:8]}", abort=True)
    await produce_run(log, other)
    await produce(run.transactions[4:], kw, default_topics(), transactional_id=f"t-{uuid.uuid4().hex[:8]}",
                  compression_type="gzip")
    compiled = str(tmp_path / "compiled.duckdb")
    r1 = await Replayer(compiled, log, run_id=run.run_id).run()
    monkeypatch.setattr(record_sets, "rollout_native", None)
    plain = str(tmp_path / "aiokafka.duckdb")
    r2 = await Replayer(plain, log, run_id=run.run_id).run()
    want = run.counts()
    assert r1.messages == r2.messages == sum(want.values())
    assert r1.other_runs == r2.other_runs == sum(other.counts().values())
    assert table_digest(compiled) == table_digest(plain)
    assert counts(compiled)["steps"] == want["steps"]
    ghosts = {e.event_id for tx in ghost.transactions for k, e in tx if k == "steps"}
    assert ghosts and not ghosts & {e.event_id for tx in run.transactions for _, e in tx}
    con = duckdb.connect(compiled, read_only=True)
    assert not ghosts & {r[0] for r in con.execute("SELECT event_id FROM steps").fetchall()}
    con.close()
    assert run_audit(compiled).ok
