"""Replay without a broker: Arrow columns, views, the audit's findings, SQL output, the report.

Events are loaded with replay.ingest.load_events (the same Arrow path the Kafka replay flushes
through), each with a made-up place on the log. The Kafka path is in tests/test_replay.py.
"""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from datetime import UTC, datetime

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from replay import columns as C
from replay import tables as T
from replay.audit import audit
from replay.ingest import ReplayError, Until, load_events
from replay.runs import discover_prefixes, split_topic, topics_for
from replay.query import export, interactive, run_query
from replay.report import build_report, figures
from replay.synthetic import generate_run
from schemas import codec
from schemas.batch import assemble_batch
from schemas.events import DeadLetter, TrainerBatch, TrainingRecord
from schemas.policy import PolicyRef

TOPIC_TABLE = {"policy-revisions": "policy_revisions", "steps": "steps", "rollouts": "rollouts", "scores": "scores",
               "scores-referenced": "reference_scores", "training-records": "training_records", "trainer-batches": "trainer_batches",
               "dead-letters": "dead_letters", "admissions": "admissions"}


def placed(events_by_topic):
    """[(topic key, event)] -> [(Meta, event)] with per-topic offsets and increasing timestamps."""
    offsets = defaultdict(int)
    out = []
    for i, (key, event) in enumerate(events_by_topic):
        out.append((C.Meta(f"t.{key}", 0, offsets[key], 1_700_000_000_000 + i), event))
        offsets[key] += 1
    return out


def flat(run):
    return [(k, e) for tx in run.transactions for k, e in tx]


@pytest.fixture(scope="module")
def run():
    return generate_run("unit-run-0001", rounds=3, groups=3, group_size=3)


def load(items, run_id="unit-run-0001"):
    con = duckdb.connect()
    load_events(con, run_id, placed(items))
    return con


def kinds(con):
    return {f.kind for f in audit(con).violations}


def test_counts_match_and_clean_run_audits_ok(run):
    con = load(flat(run))
    for key, n in run.counts().items():
        assert con.execute(f"SELECT count(*) FROM {TOPIC_TABLE[key]}").fetchone()[0] == n
    batches = run.events("trainer-batches")
    assert con.execute("SELECT count(*) FROM batch_records").fetchone()[0] == sum(len(b.records) for b in batches)
    report = audit(con)
    assert report.ok, report.findings
    assert report.checked["record_digests"] == run.counts()["training-records"]
    assert report.checked["batch_digests"] == len(batches)
    assert "audit OK" in report.summary()


def test_token_arrays_are_list_columns_bit_exact(run):
    con = load(flat(run))
    steps = {s.step_id: s for s in run.events("steps")}
    table = con.sql("SELECT step_id, prompt_token_ids, completion_token_ids, completion_logprobs FROM steps").to_arrow_table()
    assert pa.types.is_list(table.schema.field("completion_token_ids").type)
    for sid, p, c, lp in zip(*(table.column(i).to_pylist() for i in range(4))):
        s = steps[sid]
        assert np.array_equal(np.array(p, dtype=np.int32), s.prompt_token_ids)
        assert np.array_equal(np.array(c, dtype=np.int32), s.completion_token_ids)
        assert np.array_equal(np.array(lp, dtype=np.float32).view(np.uint32), s.completion_logprobs.view(np.uint32))


def test_list_array_offsets_and_empty():
    arrs = [np.arange(3, dtype=np.int32), np.empty(0, dtype=np.int32), np.arange(5, dtype=np.int32)]
    la = C.list_array(arrs, np.int32)
    assert la.to_pylist() == [[0, 1, 2], [], [0, 1, 2, 3, 4]]
    assert C.list_array([], np.float32).to_pylist() == []


def test_views_match_the_events(run):
    con = load(flat(run))
    # reward by (step revision, role), computed from the events
    rewards = {s.rollout_id: s.rewards for s in run.events("scores")}
    want = defaultdict(list)
    for s in run.events("steps"):
        if s.policy is not None:
            want[(s.policy.revision, s.member_id)].append(rewards[s.rollout_id][s.member_id])
    got = {(rev, role): (steps, mean) for rev, role, steps, mean in con.execute(
        "SELECT policy_revision, role, steps, mean_reward FROM v_reward_by_revision WHERE policy_revision IS NOT NULL")
        .fetchall()}
    assert set(got) == set(want)
    for k, vals in want.items():
        assert got[k][0] == len(vals) and got[k][1] == pytest.approx(np.mean(vals))
    # staleness per batch
    for b in run.events("trainer-batches"):
        hist = dict(con.execute("SELECT staleness, records FROM v_staleness_distribution WHERE batch_id = ?",
                                [b.batch_id]).fetchall())
        want_h = defaultdict(int)
        for r in b.records:
            want_h[b.target.revision - r.policy.revision] += 1
        assert hist == dict(want_h)
    # one batch's full lineage: every record reaches its steps and their (known) revisions
    b = run.events("trainer-batches")[1]
    rows = con.execute("SELECT record_id, step_id, step_revision, revision_known, replayed_digest = record_digest "
                       "FROM batch_lineage(?)", [b.batch_id]).fetchall()
    assert {r[0] for r in rows} == {r.record_id for r in b.records}
    assert all(r[3] and r[4] for r in rows)
    assert {r[1] for r in rows} == {sid for r in b.records for sid in r.step_ids}
    envs = {e for (e,) in con.execute("SELECT environment FROM v_env_pass_rates").fetchall()}
    assert envs == {r.environment for r in run.events("rollouts")}
    links = con.execute("SELECT count(*) FROM v_rollout_links").fetchone()[0]
    assert links == sum(len(r.child_rollout_ids) for r in run.events("rollouts"))
    assert con.execute("SELECT sum(completion_tokens) FROM v_token_counts").fetchone()[0] == \
        sum(len(s.completion_token_ids) for s in run.events("steps"))


def _tamper_reward(r: TrainingRecord) -> TrainingRecord:
    return r.model_copy(update={"reward": r.reward + 1.0, "event_id": "tampered"})


def test_audit_catches_a_conflicting_record(run):
    rec = run.events("training-records")[0]
    con = load(flat(run) + [("training-records", _tamper_reward(rec))])
    assert kinds(con) == {"record_conflict"}
    # the same record only in its tampered form: the batch digest recomputed from the log breaks
    items = [(k, _tamper_reward(e) if k == "training-records" and e.record_id == rec.record_id else e)
             for k, e in flat(run)]
    report = audit(load(items))
    assert {f.kind for f in report.violations} == {"record_mismatch"}
    assert {f.subject for f in report.violations} == {rec.record_id, run.events("trainer-batches")[0].batch_id}


def test_audit_catches_a_batch_altered_after_assembly(run):
    items = flat(run)
    i, b = next((i, e) for i, (k, e) in enumerate(items) if k == "trainer-batches")
    altered = b.model_copy(update={"records": [_tamper_reward(b.records[0])] + b.records[1:]})
    items[i] = ("trainer-batches", altered)
    found = kinds(load(items))
    assert "batch_digest" in found and "record_mismatch" in found


def test_audit_walks_the_revision_chain_back_to_revision_zero(run):
    revs = run.events("policy-revisions")
    con = load(flat(run))
    report = audit(con)
    assert report.ok and report.checked["chain_links"] == max(r.revision for r in revs) >= 3
    chain = con.execute("SELECT revision, parent_revision, batch_id, records, rollouts, steps, generated_by "
                        "FROM v_revision_chain ORDER BY revision").fetchall()
    batches = {b.batch_id: b for b in run.events("trainer-batches")}
    for rev, parent, batch_id, records, rollouts, steps, generated_by in chain[1:]:
        b = batches[batch_id]
        assert parent == rev - 1 and b.target.revision == rev - 1 and records == len(b.records) > 0
        assert rollouts > 0 and steps >= records and generated_by and max(generated_by) < rev


@pytest.mark.parametrize("tamper, says", [("another_batch", "is named by revisions"),
                                           ("digest", "the batch on the log has"),
                                           ("no_such_batch", "not on the log"),
                                           ("skipped_parent", "names parent 1, not r2")])
def test_audit_catches_a_revision_naming_the_wrong_batch(run, tamper, says):
    """The latest revision rewritten on the topic (a tampered or buggy trainer) breaks the chain, and says where."""
    items = flat(run)
    revs = [(i, e) for i, (k, e) in enumerate(items) if k == "policy-revisions"]
    (i, last), (_, prev) = revs[-1], revs[-2]
    assert last.revision == 3
    items[i] = ("policy-revisions", last.model_copy(update={
        "another_batch": {"batch_id": prev.batch_id, "batch_digest": prev.batch_digest},
        "digest": {"batch_digest": "0" * 64},
        "no_such_batch": {"batch_id": "batch-that-never-was"},
        "skipped_parent": {"parent_revision": 1}}[tamper]))
    report = audit(load(items))
    chain = [f.message for f in report.violations if f.kind == "revision_chain"]
    assert not report.ok and len(chain) == 1 and says in chain[0], report.findings
    assert {f.kind for f in report.violations} == {"revision_chain"}


def test_audit_catches_off_policy_unknown_revision_and_checkpoint(run):
    items = flat(run)
    last = [(i, e) for i, (k, e) in enumerate(items) if k == "trainer-batches"][-1]
    assert any(last[1].target.revision - r.policy.revision == 1 for r in last[1].records)
    items[last[0]] = ("trainer-batches", last[1].model_copy(update={"max_off_policy_steps": 0}))
    step = run.events("steps")[0]
    ghost = step.model_copy(update={"step_id": "ghost", "policy": PolicyRef(family="toy", revision=99)})
    bad_ckpt = step.model_copy(update={"step_id": "bad-ckpt", "policy": step.policy.model_copy(
        update={"checkpoint_digest": "0" * 64})})
    con = load(items + [("steps", ghost), ("steps", bad_ckpt)])
    report = audit(con)
    assert {"off_policy", "unknown_revision", "checkpoint_mismatch"} <= {f.kind for f in report.violations}
    assert any(f.subject == "ghost" for f in report.violations if f.kind == "unknown_revision")
    assert all(f.subject == last[1].batch_id for f in report.violations if f.kind == "off_policy")


def test_audit_catches_unbatched_and_twice_batched_records_but_not_dead_lettered_or_pending(run):
    records = run.events("training-records")
    revisions = run.events("policy-revisions")
    orphan = records[0].model_copy(update={"record_id": "orphan"})
    dead = records[1].model_copy(update={"record_id": "dead"})
    twice = assemble_batch([records[0]], revisions[0], 1, run_id=run.run_id, producer="batcher")
    letter = DeadLetter(run_id=run.run_id, producer="batcher", origin_topic="t.training-records", origin_partition=0,
                        origin_offset=999, raw=codec.encode(dead), error_type="StaleRecordError", error_message="stale",
                        service="batcher")
    late = records[2].model_copy(update={"record_id": "late"})
    # the orphan before records that were batched: lost; ``late`` after the last batched one: pending (the run
    # stopped before its batch was full), a warning
    con = load([("training-records", orphan)] + flat(run) + [("training-records", dead), ("trainer-batches", twice),
                                                            ("dead-letters", letter), ("training-records", late)])
    report = audit(con)
    by = defaultdict(set)
    for f in report.findings:
        by[f.kind].add(f.subject)
    assert by["record_unbatched"] == {"orphan"}
    assert by["record_multi_batch"] == {records[0].record_id}
    assert by["pending_records"] == {"partition 0"} and "1 records" in next(
        f.message for f in report.findings if f.kind == "pending_records")
    assert not any(f.kind in ("dead_letter", "pending_records") for f in report.violations)


def test_audit_catches_a_database_row_edited_after_replay(run):
    con = load(flat(run))
    rid = run.events("training-records")[2].record_id
    con.execute("UPDATE training_records SET completion_logprobs = list_transform(completion_logprobs, lambda x: x + 1) "
                "WHERE record_id = ?", [rid])
    found = {(f.kind, f.subject) for f in audit(con).violations}
    assert ("record_digest", rid) in found and ("record_mismatch", rid) in found


def test_a_records_reference_logprobs_are_replayed_into_its_digest_and_an_edit_of_them_is_caught(run):
    """An opd source's record carries the reference's logprobs: replayed as a column, they are part of the digest
    the audit recomputes (a record without them keeps its pinned digest)."""
    from replay.audit import replayed_records
    from schemas.digests import record_digest

    rec = run.events("training-records")[0]
    ref = np.linspace(-2.0, -0.1, len(rec.completion_token_ids)).astype(np.float32)
    with_ref = rec.model_copy(update={"ref_logprobs": ref, "credit": "ref_kl"})
    con = load([("training-records", with_ref)])
    [(back, stored, _, _)] = list(replayed_records(con))
    assert record_digest(back) == stored == record_digest(with_ref) != record_digest(rec)
    assert back.ref_logprobs.tolist() == ref.tolist()
    con.execute("UPDATE training_records SET ref_logprobs = list_transform(ref_logprobs, lambda x: x + 1)")
    [(back, stored, _, _)] = list(replayed_records(con))
    assert record_digest(back) != stored


def test_audit_catches_a_batch_naming_a_record_not_on_the_log(run):
    rid = run.events("training-records")[3].record_id
    items = [(k, e) for k, e in flat(run) if not (k == "training-records" and e.record_id == rid)]
    assert ("batch_record_missing", rid) in {(f.kind, f.subject) for f in audit(load(items)).violations}


def test_until_parse():
    assert Until.parse(None) is None
    assert Until.parse("@1795385142636").timestamp_ms == 1795385142636
    t = Until.parse("2026-11-22T10:00:00Z").timestamp_ms
    assert t == int(datetime(2026, 11, 22, 10, tzinfo=UTC).timestamp() * 1000)
    u = Until.parse("rollout.steps:3:100,rollout.trainer-batches:0:7")
    assert u.offsets == {("rollout.steps", 3): 100, ("rollout.trainer-batches", 0): 7}
    with pytest.raises(ReplayError):
        Until.parse("yesterday")


def test_sql_formats_prompt_export_and_report(run, tmp_path):
    con = load(flat(run))
    out = io.StringIO()
    assert run_query(con, "SELECT * FROM v_reward_by_revision", stream=out) > 0
    assert "mean_reward" in out.getvalue()
    out = io.StringIO()
    n = run_query(con, "SELECT step_id, completion_token_ids FROM steps ORDER BY step_id", fmt="json", stream=out)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(lines) == n == run.counts()["steps"] and isinstance(lines[0]["completion_token_ids"], list)
    out = io.StringIO()
    run_query(con, "SELECT batch_id, n_records FROM trainer_batches", fmt="csv", stream=out)
    assert out.getvalue().splitlines()[0] == "batch_id,n_records"
    pq = tmp_path / "steps.parquet"
    assert run_query(con, "SELECT * FROM steps", fmt="parquet", out=str(pq)) == run.counts()["steps"]
    assert duckdb.sql(f"SELECT count(*) FROM '{pq}'").fetchall()[0][0] == run.counts()["steps"]
    out = io.StringIO()
    interactive(con, lines=[".tables", "SELECT count(*) AS n", "FROM steps;", ".format json",
                            "SELECT 1 AS one;", "SELEC oops;", ".quit"], stream=out)
    text = out.getvalue()
    assert "v_reward_by_revision" in text and '{"one": 1}' in text and "error:" in text
    files = export(con, str(tmp_path / "export"))
    assert any(f.endswith("steps.parquet") for f in files)
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path / 'export' / 'training_records.parquet'}'").fetchall()[0][0] == \
        run.counts()["training-records"]
    page = build_report(con, audit_summary="audit OK", audit_ok=True)
    assert page.count("vegaEmbed('#'") == 1 and sum(f'id="{f.name}"' in page for f in figures(con)) >= 7
    assert not re.search(r"""(src|href)=["']?https?:""", page)  # offline: the Vega JavaScript is inlined


def test_cli_audit_exit_codes_and_sql(run, tmp_path, capsys):
    from rollout.cli import main

    clean, bad = str(tmp_path / "clean.duckdb"), str(tmp_path / "bad.duckdb")
    for path, extra in ((clean, []), (bad, [("training-records", _tamper_reward(run.events("training-records")[0]))])):
        con = duckdb.connect(path)
        load_events(con, run.run_id, placed(flat(run) + extra))
        con.close()
    assert main(["audit", "--db", clean]) == 0
    assert "audit OK" in capsys.readouterr().out
    assert main(["audit", "--db", bad]) == 1
    assert "audit FAILED" in capsys.readouterr().out
    assert main(["audit", "--db", bad, "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["by_kind"]["record_conflict"] == 1
    assert main(["sql", "--db", clean, "SELECT count(*) AS n FROM steps", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["n", str(run.counts()["steps"])]
    assert main(["sql", "--db", clean, "SELECT nope FROM steps"]) == 1
    assert main(["report", "--db", clean, "--out", str(tmp_path / "r.html")]) == 0
    assert '"$schema": "https://vega.github.io/schema/vega-lite/' in (tmp_path / "r.html").read_text()
    assert main(["export", "--db", clean, "--out", str(tmp_path / "pq")]) == 0
    assert (tmp_path / "pq" / "trainer_batches.parquet").exists()


def test_trainer_batch_is_assembled_like_the_pipeline(run):
    for b in run.events("trainer-batches"):
        assert isinstance(b, TrainerBatch)
        from schemas.batch import verify_batch

        assert verify_batch(b) == []


def test_report_png_holds_the_html_pages_charts(run, tmp_path):
    from rollout.cli import main

    db = str(tmp_path / "run.duckdb")
    load_events(con := duckdb.connect(db), run.run_id, placed(flat(run)))
    con.close()
    assert main(["report", "--db", db, "--out", str(tmp_path / "r.png")]) == 0
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and png.count(b"IDAT") >= 1
    assert int.from_bytes(png[16:20]) > 1000 and int.from_bytes(png[20:24]) > 1000  # two columns, four rows


# -- topic prefixes ------------------------------------------------------------------------------------

def test_topic_prefixes_are_whatever_precedes_a_topic_key():
    names = ["__consumer_offsets", "rollout.steps", "rollout.policy-revisions", "demo-1a2b3c4d.policy-revisions",
             "demo-1a2b3c4d.trainer-batches", "demo-1a2b3c4d.rollout.steps", "rollout.demo", "unrelated", "steps"]
    assert discover_prefixes(names) == ["", "demo-1a2b3c4d.", "demo-1a2b3c4d.rollout.", "rollout."]
    assert split_topic("demo-1a2b3c4d.dead-letters") == ("demo-1a2b3c4d.", "dead-letters")
    assert split_topic("rollout.demo") is None and split_topic("__transaction_state") is None
    assert topics_for("demo-1a2b3c4d.")["training-records"] == "demo-1a2b3c4d.training-records"
    assert set(topics_for("x.")) == set(TOPIC_TABLE)


def test_the_topic_prefix_is_kept_in_the_database(run):
    con = duckdb.connect()
    load_events(con, run.run_id, placed(flat(run)[:5]), prefix="demo-1a2b3c4d.")
    assert dict(con.execute("SELECT * FROM _replay_meta").fetchall()) == {
        "run_id": run.run_id, "topic_prefix": "demo-1a2b3c4d.", "schema": T.SCHEMA_DIGEST}


# -- evaluation rollouts, policy_exact, revision metrics ---------------------------------------------------

@pytest.fixture(scope="module")
def eval_run():
    return generate_run("unit-eval-0001", rounds=3, groups=3, group_size=3, eval_questions=5, inexact=True)


def test_new_columns_match_the_events(eval_run):
    con = load(flat(eval_run), eval_run.run_id)
    exact = dict(con.execute("SELECT step_id, policy_exact FROM steps").fetchall())
    assert exact == {s.step_id: s.policy_exact for s in eval_run.events("steps")}
    assert 0 < sum(not v for v in exact.values()) < len(exact)
    for table, key in (("rollouts", "rollouts"), ("scores", "scores")):
        got = dict(con.execute(f"SELECT rollout_id, evaluation FROM {table}").fetchall())
        assert got == {e.rollout_id: e.evaluation for e in eval_run.events(key)}
        assert sum(got.values()) == 3 * 5
    revs = {r.revision: r for r in eval_run.events("policy-revisions")}
    for rev, metrics, mean, mx, kl, n, kind, objective in con.execute(
            "SELECT revision, metrics, mismatch_mean, mismatch_max, mismatch_kl, mismatch_tokens, objective_type, "
            "objective FROM policy_revisions").fetchall():
        assert dict(metrics) == pytest.approx(revs[rev].metrics)
        assert (mean, mx, kl, n) == tuple(revs[rev].metrics.get(k) for k in ("mismatch_mean", "mismatch_max",
                                                                             "mismatch_kl", "mismatch_tokens"))
        assert (kind, json.loads(objective) if objective else None) == (
            revs[rev].objective and revs[rev].objective["type"], revs[rev].objective)
    assert {kind for (kind,) in con.execute("SELECT objective_type FROM policy_revisions").fetchall()} == {None, "default"}
    long = con.execute("SELECT family, revision, name, value FROM v_revision_metrics").fetchall()
    assert sorted(long) == sorted((r.family, r.revision, k, v) for r in revs.values() for k, v in r.metrics.items())
    mismatch = con.execute("SELECT revision, measured_revision, mismatch_mean, mismatch_max, mismatch_kl, "
                           "mismatch_tokens, objective_type FROM v_logprob_mismatch ORDER BY revision").fetchall()
    assert mismatch == [(r.revision, r.parent_revision, r.metrics["mismatch_mean"], r.metrics["mismatch_max"],
                         r.metrics["mismatch_kl"], r.metrics["mismatch_tokens"], "default") for r in sorted(revs.values(), key=lambda r: r.revision) if r.metrics]


def test_eval_accuracy_by_revision_and_training_views_without_evaluation(eval_run):
    con = load(flat(eval_run), eval_run.run_id)
    evals = {r.rollout_id for r in eval_run.events("rollouts") if r.evaluation}
    steps = eval_run.events("steps")
    rewards = {s.rollout_id: s.rewards for s in eval_run.events("scores")}
    want = defaultdict(list)
    for s in steps:
        if s.rollout_id in evals and s.trainable:
            want[s.policy.revision].append(rewards[s.rollout_id][s.member_id])
    got = {rev: (n, mean, acc) for rev, n, mean, acc in con.execute(
        "SELECT policy_revision, rollouts, mean_reward, accuracy FROM v_eval_accuracy_by_revision").fetchall()}
    assert set(got) == set(want) == {0, 1, 2}
    for rev, rs in want.items():
        assert got[rev] == (len(rs), pytest.approx(np.mean(rs)), pytest.approx(np.mean([r >= 1 for r in rs])))
    # training views: evaluation rollouts are left out; v_token_counts lists them with evaluation = true
    train_steps = [s for s in steps if s.rollout_id not in evals]
    assert con.execute("SELECT sum(steps) FROM v_reward_by_revision").fetchone()[0] == len(train_steps)
    assert con.execute("SELECT sum(inexact_steps) FROM v_reward_by_revision").fetchone()[0] == \
        sum(not s.policy_exact for s in train_steps)
    assert con.execute("SELECT sum(rollouts) FROM v_env_pass_rates").fetchone()[0] == \
        len(eval_run.events("scores")) - len(evals)
    assert con.execute("SELECT sum(rollouts) FROM v_reward_by_admission_revision").fetchone()[0] == \
        sum(len(s.rewards) for s in eval_run.events("scores") if s.rollout_id not in evals)
    assert dict(con.execute("SELECT evaluation, sum(steps) FROM v_token_counts GROUP BY 1").fetchall()) == {
        True: len(steps) - len(train_steps), False: len(train_steps)}
    assert con.execute("SELECT count(*) FROM v_step_rewards WHERE evaluation").fetchone()[0] == len(steps) - len(train_steps)


def test_eval_accuracy_prefers_the_exact_match_metric(eval_run):
    """A shaped reward below 1 counts as correct when the verifier's exact_match metric says so (and vice versa)."""
    items = []
    for k, e in flat(eval_run):
        if k == "scores" and e.evaluation:
            hit = e.rewards["solver"] >= 1
            e = e.model_copy(update={"rewards": {"solver": 0.5 if hit else 1.0},
                                     "metrics": {"solver/metric/exact_match": 1.0 if hit else 0.0}})
        items.append((k, e))
    con = load(items, eval_run.run_id)
    hits = [e.rewards["solver"] >= 1 for e in eval_run.events("scores") if e.evaluation]
    assert con.execute("SELECT sum(correct) FROM v_eval_accuracy_by_revision").fetchone()[0] == sum(hits)


def test_audit_warns_about_inexact_steps_and_catches_trained_evaluation(eval_run):
    report = audit(load(flat(eval_run), eval_run.run_id))
    assert report.ok, report.violations
    inexact = [s for s in eval_run.events("steps") if not s.policy_exact]
    warned = [f for f in report.warnings if f.kind == "inexact_policy"]
    assert {f.subject for f in warned} == {f"toy@r{s.policy.revision}" for s in inexact}
    assert report.checked["inexact_steps"] == len(inexact)
    assert sum(int(f.message.split()[0]) for f in warned) == len(inexact)
    assert report.checked["trainable_steps"] == sum(s.trainable for s in eval_run.events("steps"))
    # a training record made from an evaluation rollout, and a trainable step of an unpublished revision
    ev = next(r for r in eval_run.events("rollouts") if r.evaluation)
    rec = eval_run.events("training-records")[0].model_copy(update={"record_id": "from-eval", "rollout_id": ev.rollout_id})
    step = next(s for s in eval_run.events("steps") if s.trainable)
    ghost = step.model_copy(update={"step_id": "ghost", "policy": PolicyRef(family="toy", revision=42)})
    report = audit(load(flat(eval_run) + [("training-records", rec), ("steps", ghost)], eval_run.run_id))
    found = {(f.kind, f.subject) for f in report.violations}
    assert ("evaluation_trained", "from-eval") in found and ("unknown_revision", "ghost") in found
    assert "trainable step ghost" in next(f.message for f in report.violations if f.subject == "ghost")


def test_audit_fails_when_a_probed_revisions_trainable_steps_were_not_shown_exact(eval_run):
    """A revision that carries a logprob probe was checked against what the server served after the load: its
    trainable steps not stamped exact mean the served weights were not shown equal. A violation, per revision; the
    same steps under revisions without a probe (imported traces, other engines) stay a warning."""
    from schemas.policy import LogprobProbe

    probe = LogprobProbe(token_ids=[1, 2, 3], logprobs=[-0.5, -0.25])
    items = [(k, e.model_copy(update={"probe": probe}) if k == "policy-revisions" and e.revision else e)
             for k, e in flat(eval_run)]
    report = audit(load(items, eval_run.run_id))
    unverified = {f.subject: int(f.message.split()[0]) for f in report.violations if f.kind == "served_unverified"}
    inexact = [s for s in eval_run.events("steps") if not s.policy_exact and s.trainable and s.policy.revision]
    assert inexact and unverified == {f"toy@r{r}": sum(s.policy.revision == r for s in inexact)
                                      for r in {s.policy.revision for s in inexact}}
    assert not report.ok


def test_report_shows_evaluation_and_mismatch_or_says_there_is_none(run, eval_run):
    page = build_report(load(flat(eval_run), eval_run.run_id))
    assert '"text": "Held-out evaluation by policy revision"' in page
    assert '"text": "Trainer–inference logprob mismatch"' in page
    assert "no evaluation rollouts in this run" not in page
    bare = [(k, e.model_copy(update={"metrics": {}}) if k == "policy-revisions" else e) for k, e in flat(run)]
    page = build_report(load(bare))
    assert "no evaluation rollouts in this run" in page and "no logprob mismatch reported" in page
    # the revision chain, every revision with the batch it names
    assert "<h2>Revision chain</h2>" in page
    assert all(b.batch_id in page for b in run.events("trainer-batches"))


def test_the_schema_is_stamped_and_a_dropped_view_is_made_again(tmp_path):
    from replay.ingest import open_db

    db = str(tmp_path / "s.duckdb")
    con = open_db(db)
    assert con.execute("SELECT value FROM _replay_meta WHERE key = 'schema'").fetchone() == (T.SCHEMA_DIGEST,)
    con.execute("DROP VIEW v_lineage")
    con.close()
    con = open_db(db)  # stamped, but a view is missing: the schema is made again
    assert con.execute("SELECT count(*) FROM v_lineage").fetchone() == (0,)
    con.close()


def test_an_older_database_gets_the_new_columns_with_their_defaults(run, tmp_path, capsys):
    from replay import tables as T
    from replay.audit import run_audit
    from rollout.cli import main

    db = str(tmp_path / "old.duckdb")
    con = duckdb.connect(db)
    load_events(con, run.run_id, placed(flat(run)))
    for name in T.VIEWS:
        con.execute(f"DROP VIEW {name}")
    con.execute("DELETE FROM _replay_meta WHERE key = 'schema'")  # older versions did not stamp their schema
    for table, col in (("steps", "policy_exact"), ("rollouts", "evaluation"), ("scores", "evaluation"),
                       ("policy_revisions", "metrics"), ("policy_revisions", "mismatch_mean")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    con.close()
    # read-only commands refuse it with the way out; a replay into it (ensure_schema) upgrades it
    with pytest.raises(T.OutdatedSchema, match="rollout replay --db"):
        run_audit(db)
    assert main(["audit", "--db", db]) == 2 and "older version" in capsys.readouterr().err
    assert main(["report", "--db", db, "--out", str(tmp_path / "r.html")]) == 1
    con = duckdb.connect(db)
    T.ensure_schema(con)
    assert con.execute("SELECT bool_and(policy_exact), count(*) FROM steps").fetchone() == (True, run.counts()["steps"])
    assert con.execute("SELECT bool_or(evaluation) FROM rollouts").fetchone()[0] is False
    assert con.execute("SELECT count(*) FROM policy_revisions WHERE mismatch_mean IS NULL").fetchone()[0] == \
        run.counts()["policy-revisions"]
    load_events(con, run.run_id, placed(flat(run)[:3]))  # and takes new rows
    assert audit(con).checked["inexact_steps"] == 0
    con.close()
    assert run_audit(db).checked["trainable_steps"] == sum(s.trainable for s in run.events("steps")) + \
        sum(s.trainable for k, s in flat(run)[:3] if k == "steps")


def test_the_admissions_ledger_is_replayed_in_log_order(run):
    """An arena's claims (with the batch slots a claim of several records a rollout takes), done groups, releases
    credit's refunds of gated groups and the batcher's rebases (the admissions topic) land in one table."""
    from schemas.admission import AdmissionClaim, AdmissionDone, AdmissionRebase, AdmissionRefund, AdmissionRelease

    def claim(i: int, slots: int | None = None) -> AdmissionClaim:
        return AdmissionClaim(run_id=run.run_id, producer="arena-a", claim_id=f"c{i}", arena_id="a", family="toy",
                              group_id=f"g{i}", rollouts=4, slots=slots, seen_revision=0, batch_size=8,
                              max_off_policy_steps=1, lease_s=600.0)

    ledger = [("admissions", claim(0)), ("admissions", claim(1, slots=8)),
              ("admissions", AdmissionDone(run_id=run.run_id, producer="arena-a", claim_id="c0", arena_id="a")),
              ("admissions", AdmissionRelease(run_id=run.run_id, producer="arena-b", claim_id="c1", arena_id="b",
                                              reason="lease of 600s expired")),
              ("admissions", AdmissionRefund(run_id=run.run_id, producer="credit", group_id="g0",
                                             reason="gate 'zero_advantage'")),
              ("admissions", AdmissionRebase(run_id=run.run_id, producer="batcher", family="toy", revision=3,
                                             claims=2, reason="partial"))]
    con = load(flat(run) + ledger)
    rows = con.execute("SELECT event_type, claim_id, arena_id, group_id, rollouts, slots, reason FROM admissions "
                       "ORDER BY _offset").fetchall()
    assert con.execute("SELECT family, revision, claims FROM admissions WHERE event_type = 'admission_rebase'"
                       ).fetchall() == [("toy", 3, 2)]
    assert rows == [("admission_claim", "c0", "a", "g0", 4, None, None),
                    ("admission_claim", "c1", "a", "g1", 4, 8, None),
                    ("admission_done", "c0", "a", None, None, None, None),
                    ("admission_release", "c1", "b", None, None, None, "lease of 600s expired"),
                    ("admission_refund", None, None, "g0", None, None, "gate 'zero_advantage'"),
                    ("admission_rebase", None, None, None, None, None, "partial")]
    assert audit(con).ok
