"""Audit a replayed run: recompute every digest from the replayed rows and check the lineage.

Violations (the audit fails):

* ``record_digest``       a training record's digest recomputed from its stored row differs from the
                          digest of the event as it was read (the database was altered);
* ``record_conflict``     one record_id appears on the log with different contents;
* ``batch_digest``        a batch's digest does not match its own embedded records (altered after assembly);
* ``lineage_digest``      a batch's lineage digest does not match its embedded records' revisions;
* ``batch_sources``       a batch's declared source revisions differ from its records' revisions;
* ``record_mismatch``     a record in a batch differs from that record as replayed from the log, so the
                          batch digest recomputed from the replayed records does not match;
* ``replayed_lineage``    the lineage digest recomputed from the replayed records does not match;
* ``batch_record_missing`` a batch names a record that is not on the log;
* ``batch_conflict``      one batch_id appears twice with different digests;
* ``record_unbatched``    a record in no batch (and not dead-lettered) while a later record of its partition is;
* ``record_multi_batch``  a record in two or more batches;
* ``off_policy``          a batch with a record outside its off-policy bound (too stale, ahead, other family);
* ``unknown_revision``    a step, record or batch target whose policy revision was never published (every
                          trainable step must name one: that is how its tokens are tied to weights);
* ``checkpoint_mismatch`` a revision referenced with a checkpoint digest other than the published one;
* ``revision_conflict``   a revision published twice with different checkpoints;
* ``undecodable``         a message of the run that could not be decoded (see replay_errors);
* ``evaluation_trained``  a training record (or batched record) of an evaluation rollout, which is held out;
* ``served_unverified``   trainable steps not stamped exact (``policy_exact`` false) for a revision that carries a
                          logprob probe: the arena could check the served weights against it after the load, and
                          they were not shown equal (a server serving other weights than the revision it names);
* ``revision_chain``      a broken link walking from each family's latest revision back to revision 0:
                          revision N -> its parent N-1 -> the batch it names (on the log, same digest, trained
                          by no other revision, targeting a revision before N) -> the batch's records -> their
                          rollouts and steps -> the revisions that generated them (published, before N).

Warnings (reported, not failing): missing steps of a rollout (steps may have a shorter retention),
dead letters, harmless re-emissions (same content, new event id), and steps whose revision is the
arena's belief only (``policy_exact`` false: ``inexact_policy``, one finding per revision with the count),
revisions that name no batch in a log written before revisions named them (``unnamed_batches``), and records after
the last batched one of their partition (``pending_records``: a run stopped or still running before their batch).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from replay.tables import open_read_only
from schemas.batch import why_stale
from schemas.digests import batch_digest, lineage_digest, record_digest
from schemas.envelope import SourceEvent
from schemas.events import CeSpan, TrainingRecord
from schemas.history import HistoryRule
from schemas.policy import PolicyRef

VIOLATIONS = ("record_digest", "record_conflict", "batch_digest", "lineage_digest", "batch_sources", "record_mismatch",
              "replayed_lineage", "batch_record_missing", "batch_conflict", "record_unbatched", "record_multi_batch",
              "off_policy", "unknown_revision", "checkpoint_mismatch", "revision_conflict", "undecodable",
              "evaluation_trained", "revision_chain", "served_unverified")
WARNINGS = ("missing_step", "dead_letter", "re_emitted", "inexact_policy", "unnamed_batches", "pending_records")


@dataclass
class Finding:
    kind: str
    subject: str
    message: str

    @property
    def violation(self) -> bool:
        return self.kind in VIOLATIONS


@dataclass
class AuditReport:
    run_id: str | None
    counts: dict[str, int]
    checked: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.violation]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if not f.violation]

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.findings))

    def add(self, kind: str, subject: str, message: str) -> None:
        self.findings.append(Finding(kind, subject, message))

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "run_id": self.run_id, "counts": self.counts, "checked": self.checked,
                           "violations": len(self.violations), "warnings": len(self.warnings),
                           "by_kind": self.by_kind(), "findings": [asdict(f) for f in self.findings]})

    def summary(self) -> str:
        c, k = self.counts, self.checked
        counts = (f"{c.get('policy_revisions', 0)} policy revisions, {c.get('steps', 0)} steps, "
                  f"{c.get('rollouts', 0)} rollouts, {c.get('scores', 0)} scores, "
                  f"{c.get('training_records', 0)} training records, {c.get('trainer_batches', 0)} trainer batches "
                  f"({c.get('batch_records', 0)} batched records), {c.get('dead_letters', 0)} dead letters")
        checks = (f"{k.get('record_digests', 0)} record digests, {k.get('batch_digests', 0)} batch digests and "
                  f"{k.get('lineage_digests', 0)} lineage digests recomputed; {k.get('bound_checks', 0)} batched records "
                  f"checked against the off-policy bound; {k.get('revision_refs', 0)} revision references resolved "
                  f"({k.get('trainable_steps', 0)} trainable steps, {k.get('inexact_steps', 0)} of all steps not "
                  "exact about their revision)")
        if self.ok:
            return (f"audit OK (run {self.run_id}): {counts}. {checks}. Every record is in exactly one batch "
                    f"(or dead-lettered), no batch breaks its off-policy bound, every revision is known."
                    + (f" {len(self.warnings)} warnings." if self.warnings else ""))
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.by_kind().items()) if kind in VIOLATIONS)
        return f"audit FAILED (run {self.run_id}): {len(self.violations)} violations ({kinds}). {counts}. {checks}."


def _ref(family: str | None, revision: int | None, ckpt: str | None) -> PolicyRef | None:
    if family is None:
        return None
    return PolicyRef.model_construct(family=family, revision=int(revision), checkpoint_digest=ckpt)


def _lists(col: pa.ChunkedArray | pa.Array) -> Iterator[np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy()
    values = arr.flatten().to_numpy(zero_copy_only=False)
    base = offsets[0]
    for i in range(len(arr)):
        yield values[offsets[i] - base:offsets[i + 1] - base]


_RECORD_COLS = ("record_id, run_id, schema_version, rollout_id, step_ids, member_id, group_id, environment, "
                "policy_family, policy_revision, policy_checkpoint_digest, prompt_token_ids, completion_token_ids, "
                "completion_logprobs, loss_mask, reward, advantage, credit, record_digest, _partition, _offset, "
                "source_run_id, source_topic, source_partition, source_offset, source_digest, ref_logprobs, ce_spans")


def replayed_records(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[TrainingRecord, str, int, int]]:
    """(record rebuilt from its stored row, digest stored at replay, partition, offset), in log order."""
    reader = con.sql(f"SELECT {_RECORD_COLS} FROM training_records ORDER BY _partition, _offset").to_arrow_reader(8192)
    for batch in reader:
        cols = {name: batch.column(name) for name in batch.schema.names}
        arrays = {name: list(_lists(cols[name])) for name in
                  ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask")}
        py = {name: cols[name].to_pylist() for name in batch.schema.names if name not in arrays}
        for i in range(batch.num_rows):
            rec = TrainingRecord.model_construct(
                event_type="training_record", schema_version=py["schema_version"][i], run_id=py["run_id"][i],
                producer="replay", record_id=py["record_id"][i], rollout_id=py["rollout_id"][i],
                step_ids=py["step_ids"][i], member_id=py["member_id"][i], group_id=py["group_id"][i],
                environment=py["environment"][i],
                policy=_ref(py["policy_family"][i], py["policy_revision"][i], py["policy_checkpoint_digest"][i]),
                prompt_token_ids=arrays["prompt_token_ids"][i].astype("<i4", copy=False),
                completion_token_ids=arrays["completion_token_ids"][i].astype("<i4", copy=False),
                completion_logprobs=arrays["completion_logprobs"][i].astype("<f4", copy=False),
                loss_mask=arrays["loss_mask"][i].astype("u1", copy=False),
                reward=py["reward"][i], advantage=py["advantage"][i], credit=py["credit"][i],
                source=SourceEvent.model_construct(
                    run_id=py["source_run_id"][i], topic=py["source_topic"][i], partition=py["source_partition"][i],
                    offset=py["source_offset"][i], digest=py["source_digest"][i]) if py["source_run_id"][i] else None,
                ref_logprobs=None if py["ref_logprobs"][i] is None else np.asarray(py["ref_logprobs"][i], "<f4"),
                ce_spans=None if py["ce_spans"][i] is None else [
                    CeSpan.model_construct(start=a, end=b, weight=w) for a, b, w in json.loads(py["ce_spans"][i])])
            yield rec, py["record_digest"][i], py["_partition"][i], py["_offset"][i]


def audit(con: duckdb.DuckDBPyConnection) -> AuditReport:
    row = con.execute("SELECT value FROM _replay_meta WHERE key = 'run_id'").fetchone()
    counts = {t: n for t, n in con.execute("SELECT * FROM v_counts").fetchall()}
    report = AuditReport(run_id=row[0] if row else None, counts=counts)

    # -- training records: recompute each digest from the stored row
    records: dict[str, list[tuple[str, str, int, str | None, int, int]]] = defaultdict(list)
    n_digests = 0
    for rec, stored, part, off in replayed_records(con):
        d = record_digest(rec)
        n_digests += 1
        if d != stored:
            report.add("record_digest", rec.record_id,
                       f"record {rec.record_id} (partition {part} offset {off}): digest recomputed from the database "
                       f"{d[:12]} != digest of the event as read {stored[:12]}")
        p = rec.policy
        records[rec.record_id].append((d, p.family, p.revision, p.checkpoint_digest, part, off))
    report.checked["record_digests"] = n_digests
    for rid, versions in records.items():
        digests = {v[0] for v in versions}
        if len(digests) > 1:
            where = ", ".join(f"partition {v[4]} offset {v[5]}: {v[0][:12]}" for v in versions)
            report.add("record_conflict", rid, f"record {rid} appears {len(versions)} times with different contents ({where})")
        elif len(versions) > 1:
            report.add("re_emitted", rid, f"record {rid} re-emitted {len(versions)} times with the same content")

    # -- batches: digests from embedded records and from replayed records, lineage, off-policy bound
    batches = con.execute(
        "SELECT batch_id, _offset, family, target_revision, target_checkpoint_digest, max_off_policy_steps, "
        "batch_digest, lineage_digest, history_source_run_id, history_fork_family, history_fork_revision "
        "FROM trainer_batches ORDER BY _partition, _offset").fetchall()
    embedded: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    for r in con.execute("SELECT batch_id, batch_offset, record_id, record_digest, policy_family, policy_revision, "
                         "policy_checkpoint_digest FROM batch_records ORDER BY batch_offset, position").fetchall():
        embedded[(r[0], r[1])].append(r[2:])
    declared: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for r in con.execute("SELECT batch_id, batch_offset, policy_family, policy_revision, policy_checkpoint_digest, "
                         "records FROM batch_sources").fetchall():
        declared[(r[0], r[1])][(r[2], r[3], r[4])] += r[5]
    seen_batches: dict[str, str] = {}
    n_bound = 0
    for batch_id, offset, family, target_rev, target_ckpt, bound, b_digest, l_digest, *hist in batches:
        target = PolicyRef.model_construct(family=family, revision=int(target_rev), checkpoint_digest=target_ckpt)
        history = HistoryRule(source_run_id=hist[0], fork=PolicyRef(family=hist[1], revision=hist[2])) \
            if hist[0] is not None else None
        if batch_id in seen_batches and seen_batches[batch_id] != b_digest:
            report.add("batch_conflict", batch_id, f"batch {batch_id} appears again (offset {offset}) with another digest")
        seen_batches.setdefault(batch_id, b_digest)
        recs = embedded.get((batch_id, offset), [])
        got = batch_digest(family, target, (r[1] for r in recs))
        if got != b_digest:
            report.add("batch_digest", batch_id, f"batch {batch_id} (offset {offset}): batch digest {b_digest[:12]} != "
                       f"{got[:12]} recomputed from its {len(recs)} embedded records")
        sources = Counter((r[2], r[3], r[4]) for r in recs)
        got_l = lineage_digest(family, target, ((_ref(*k), n) for k, n in sources.items()))
        if got_l != l_digest:
            report.add("lineage_digest", batch_id, f"batch {batch_id} (offset {offset}): lineage digest {l_digest[:12]} "
                       f"!= {got_l[:12]} recomputed from its records' revisions")
        if declared.get((batch_id, offset), Counter()) != sources:
            report.add("batch_sources", batch_id, f"batch {batch_id} declares sources "
                       f"{_fmt_sources(declared.get((batch_id, offset), Counter()))} but its records come from "
                       f"{_fmt_sources(sources)}")
        # the same digests, recomputed from the records as replayed from the training-records topic
        replayed_digests, replayed_sources, missing = [], Counter(), 0
        for record_id, emb_digest, fam, rev, ckpt in recs:
            versions = records.get(record_id)
            if not versions:
                missing += 1
                report.add("batch_record_missing", record_id,
                           f"batch {batch_id} contains record {record_id}, which is not on the log")
                replayed_digests.append(emb_digest)
                replayed_sources[(fam, rev, ckpt)] += 1
                continue
            match = next((v for v in versions if v[0] == emb_digest), None)
            if match is None:
                match = versions[0]
                report.add("record_mismatch", record_id,
                           f"record {record_id} in batch {batch_id}: digest in the batch {emb_digest[:12]} != replayed "
                           f"record {match[0][:12]} (partition {match[4]} offset {match[5]})")
            replayed_digests.append(match[0])
            replayed_sources[(match[1], match[2], match[3])] += 1
        if not missing:
            got_r = batch_digest(family, target, replayed_digests)
            if got_r != b_digest:
                report.add("record_mismatch", batch_id, f"batch {batch_id} (offset {offset}): batch digest "
                           f"{b_digest[:12]} != {got_r[:12]} recomputed from the replayed records")
            got_rl = lineage_digest(family, target, ((_ref(*k), n) for k, n in replayed_sources.items()))
            if got_rl != l_digest:
                report.add("replayed_lineage", batch_id, f"batch {batch_id} (offset {offset}): lineage digest "
                           f"{l_digest[:12]} != {got_rl[:12]} recomputed from the replayed records")
        # off-policy bound, for the revision in the batch and (if it differs) the replayed record's
        for record_id, _, fam, rev, _ in recs:
            n_bound += 1
            revs = {(fam, rev)} | {(v[1], v[2]) for v in records.get(record_id, ())}
            for f, r in sorted(revs):
                why = why_stale(PolicyRef(family=f, revision=r), target, bound, history)
                if why:
                    report.add("off_policy", batch_id, f"batch {batch_id} (target r{target_rev}): record {record_id} {why}")
    report.checked["batch_digests"] = len(batches)
    report.checked["lineage_digests"] = len(batches)
    report.checked["bound_checks"] = n_bound

    # -- every record in exactly one batch (or dead-lettered)
    for rid, batch_ids in con.execute(
            "SELECT record_id, list(DISTINCT batch_id ORDER BY batch_id) FROM batch_records GROUP BY record_id "
            "HAVING count(DISTINCT batch_id) > 1 ORDER BY record_id").fetchall():
        report.add("record_multi_batch", rid, f"record {rid} is in {len(batch_ids)} batches: {', '.join(batch_ids)}")
    # a record after the last batched one of its partition is pending (the run stopped before its batch was full:
    # SIGTERM, a run cut short), not lost; one before it that no batch took is
    pending = Counter()
    for rid, part, off, tail in con.execute("""
            WITH batched AS (SELECT tr._partition AS part, max(tr._offset) AS last FROM training_records tr
                             WHERE tr.record_id IN (SELECT record_id FROM batch_records) GROUP BY ALL)
            SELECT DISTINCT ON (tr.record_id) tr.record_id, tr._partition, tr._offset,
                   tr._offset > coalesce((SELECT last FROM batched b WHERE b.part = tr._partition), -1)
              FROM training_records tr
            WHERE tr.record_id NOT IN (SELECT record_id FROM batch_records)
              AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.raw_subject_id = tr.record_id
                              OR (d.origin_topic = tr._topic AND d.origin_partition = tr._partition
                                  AND d.origin_offset = tr._offset))
            ORDER BY tr.record_id""").fetchall():
        if tail:
            pending[part] += 1
        else:
            report.add("record_unbatched", rid, f"record {rid} (partition {part} offset {off}) is in no batch, and "
                                                "a later record of its partition is")
    for part, n in sorted(pending.items()):
        report.add("pending_records", f"partition {part}", f"{n} records after the last batched one of partition "
                   f"{part} are in no batch yet (the run stopped, or is running, before their batch was full)")

    # -- policy revisions: every reference resolves, with the published checkpoint
    for fam, rev, ckpts in con.execute(
            "SELECT family, revision, list(DISTINCT checkpoint_digest) FROM policy_revisions GROUP BY ALL "
            "HAVING count(DISTINCT coalesce(checkpoint_digest, '')) > 1").fetchall():
        report.add("revision_conflict", f"{fam}@r{rev}", f"revision {fam}@r{rev} published with different checkpoints {ckpts}")
    refs = """
        SELECT CASE WHEN trainable THEN 'trainable step' ELSE 'step' END AS kind, step_id AS id,
               policy_family AS fam, policy_revision AS rev, policy_checkpoint_digest AS ckpt
          FROM steps WHERE policy_family IS NOT NULL OR trainable
        UNION ALL SELECT 'training record', record_id, policy_family, policy_revision, policy_checkpoint_digest
          FROM training_records
        UNION ALL SELECT 'batch target', batch_id, family, target_revision, target_checkpoint_digest FROM trainer_batches
        UNION ALL SELECT 'rollout', rollout_id, policy_family, policy_revision, policy_checkpoint_digest
          FROM rollouts WHERE policy_family IS NOT NULL"""
    report.checked["revision_refs"] = con.execute(f"SELECT count(*) FROM ({refs})").fetchone()[0]
    report.checked["trainable_steps"] = con.execute("SELECT count(*) FROM steps WHERE trainable").fetchone()[0]
    for kind, ident, fam, rev in con.execute(f"""
            SELECT kind, id, fam, rev FROM ({refs}) r
            WHERE NOT EXISTS (SELECT 1 FROM policy_revisions p WHERE p.family = r.fam AND p.revision = r.rev)
            ORDER BY kind, id""").fetchall():
        report.add("unknown_revision", ident, f"{kind} {ident} names revision {fam}@r{rev}, which was never published")
    for kind, ident, fam, rev, ckpt, published in con.execute(f"""
            SELECT kind, id, fam, rev, ckpt, p.checkpoint_digest FROM ({refs}) r
            JOIN policy_revisions p ON p.family = r.fam AND p.revision = r.rev
            WHERE r.ckpt IS NOT NULL AND p.checkpoint_digest IS DISTINCT FROM r.ckpt ORDER BY kind, id""").fetchall():
        report.add("checkpoint_mismatch", ident, f"{kind} {ident} names {fam}@r{rev} with checkpoint {ckpt[:12]}, "
                   f"published as {(published or 'none')[:12]}")
    n_inexact = 0
    for fam, rev, n, trainable in con.execute(
            "SELECT policy_family, policy_revision, count(*), count(*) FILTER (WHERE trainable) FROM steps "
            "WHERE NOT policy_exact GROUP BY ALL ORDER BY ALL").fetchall():
        n_inexact += n
        report.add("inexact_policy", f"{fam}@r{rev}", f"{n} steps ({trainable} trainable) attributed to {fam}@r{rev} "
                   "are not known to come from it exactly (policy_exact = false)")
    report.checked["inexact_steps"] = n_inexact
    for fam, rev, n in con.execute(
            "SELECT s.policy_family, s.policy_revision, count(*) FROM steps s WHERE s.trainable AND NOT s.policy_exact "
            "AND EXISTS (SELECT 1 FROM policy_revisions p WHERE p.family = s.policy_family "
            "AND p.revision = s.policy_revision AND p.probed) GROUP BY ALL ORDER BY ALL").fetchall():
        report.add("served_unverified", f"{fam}@r{rev}", f"{n} trainable steps name {fam}@r{rev}, but what the server "
                   "served was not shown equal to its checkpoint (its logprob probe disagreed or went unanswered)")

    _revision_chain(con, report)

    # -- evaluation rollouts are held out: nothing of theirs is trained on
    for kind, ident, rid in con.execute("""
            SELECT * FROM (SELECT 'training record' AS kind, record_id, rollout_id FROM training_records
                           UNION SELECT 'record in batch ' || batch_id, record_id, rollout_id FROM batch_records)
            WHERE rollout_id IN (SELECT rollout_id FROM v_eval_rollouts) ORDER BY ALL""").fetchall():
        report.add("evaluation_trained", ident, f"{kind} {ident} comes from evaluation rollout {rid}")

    # -- undecodable messages, dead letters, missing steps
    for topic, part, off, err in con.execute(
            "SELECT _topic, _partition, _offset, error FROM replay_errors ORDER BY ALL").fetchall():
        report.add("undecodable", f"{topic}:{part}:{off}", f"{topic}:{part}:{off} could not be decoded: {err}")
    for topic, part, off, svc, etype, msg in con.execute(
            "SELECT origin_topic, origin_partition, origin_offset, service, error_type, error_message FROM dead_letters "
            "ORDER BY ALL").fetchall():
        report.add("dead_letter", f"{topic}:{part}:{off}", f"{svc} dead-lettered {topic}:{part}:{off}: {etype}: {msg}")
    for rid, n in con.execute("""
            SELECT r.rollout_id, count(*) FROM (SELECT rollout_id, unnest(step_ids) AS step_id FROM rollouts) r
            WHERE r.step_id NOT IN (SELECT step_id FROM steps) GROUP BY ALL ORDER BY ALL""").fetchall():
        report.add("missing_step", rid, f"rollout {rid}: {n} of its steps are not on the log (retention?)")
    return report


def _revision_chain(con: duckdb.DuckDBPyConnection, report: AuditReport) -> None:
    """Walk each family's chain from its latest revision back to revision 0 (see ``revision_chain``)."""
    chains: dict[str, dict[int, tuple]] = defaultdict(dict)
    for row in con.execute("SELECT * FROM v_revision_chain").fetchall():
        chains[row[0]][row[1]] = row
    for fam, rev, batches in con.execute(
            "SELECT family, revision, list(DISTINCT batch_id) FROM policy_revisions WHERE batch_id IS NOT NULL "
            "GROUP BY ALL HAVING count(DISTINCT batch_id) > 1").fetchall():
        report.add("revision_chain", f"{fam}@r{rev}", f"revision {fam}@r{rev} published naming different batches {batches}")
    # a derived run's chain starts at its fork: the source revision whose checkpoint it holds (rollout derive)
    forks = {fam: (rev, ffam, frev, fdigest, digest) for fam, rev, ffam, frev, fdigest, digest in con.execute(
        "SELECT family, revision, fork_family, fork_revision, fork_checkpoint_digest, checkpoint_digest "
        "FROM policy_revisions WHERE fork_family IS NOT NULL").fetchall()}
    links = 0
    for fam, revs in sorted(chains.items()):
        latest = max(revs)
        start, fork_family = (forks[fam][0], forks[fam][1]) if fam in forks else (0, None)
        if latest > start and all(revs[n][3] is None for n in revs if n > start):
            report.add("unnamed_batches", fam, f"{fam}: revisions r1..r{latest} name no batch (published before "
                       "revisions named their batches): the chain stops at the batches")
            continue
        trained_by: dict[str, list[int]] = defaultdict(list)
        generating = chains.get(fork_family, {}) if fork_family else revs
        for n in range(latest, start, -1):
            subject = f"{fam}@r{n}"
            if n not in revs:
                report.add("revision_chain", subject, f"revision {subject} is not on the log: the chain from r{latest} "
                           "breaks there")
                continue
            links += 1
            _, _, parent, batch_id, digest, logged, target, records, rollouts, steps, generated = revs[n]
            if parent != n - 1:
                report.add("revision_chain", subject, f"revision {subject} names parent {parent}, not r{n - 1}")
            if batch_id is None:
                report.add("revision_chain", subject, f"revision {subject} names no batch")
                continue
            trained_by[batch_id].append(n)
            if logged is None:
                report.add("revision_chain", subject, f"revision {subject} names batch {batch_id}, not on the log")
                continue
            if digest != logged:
                report.add("revision_chain", subject, f"revision {subject} names batch {batch_id} with digest "
                           f"{(digest or 'none')[:12]}, the batch on the log has {logged[:12]}")
            if target >= n:
                report.add("revision_chain", subject, f"revision {subject} was trained on batch {batch_id}, which "
                           f"targets r{target}, not a revision before it")
            if not records or not rollouts:
                report.add("revision_chain", subject, f"batch {batch_id} of revision {subject} leads to {records} "
                           f"records and {rollouts} rollouts on the log")
            unknown = [g for g in generated if g not in generating]
            late = [g for g in generated if g >= n and fork_family is None]  # history: other weights, any age
            if unknown or late:
                report.add("revision_chain", subject, f"batch {batch_id} of revision {subject} holds tokens generated "
                           f"by revisions {sorted(set(unknown) | set(late))}, "
                           + ("never published" if unknown else f"not before r{n}"))
        for batch_id, ns in trained_by.items():
            if len(ns) > 1:
                report.add("revision_chain", batch_id, f"batch {batch_id} is named by revisions {sorted(ns)}: one "
                           "batch, one optimizer step")
        if start not in revs:
            report.add("revision_chain", f"{fam}@r{start}", f"revision {fam}@r{start}, where the chain starts, is "
                       "not on the log")
        elif fork_family is not None:  # and on, into the source run's chain
            _, ffam, frev, fdigest, digest = forks[fam]
            published = con.execute("SELECT checkpoint_digest FROM policy_revisions WHERE family = ? AND revision = ? "
                                    "LIMIT 1", [ffam, frev]).fetchone()
            if published is None:
                report.add("revision_chain", f"{fam}@r{start}", f"revision {fam}@r{start} forks from {ffam}@r{frev}, "
                           "which is not on the log (replay the derived run: its source run comes with it)")
            elif fdigest != published[0] or (published[0] is not None and digest != published[0]):
                report.add("revision_chain", f"{fam}@r{start}", f"revision {fam}@r{start} holds checkpoint "
                           f"{(digest or 'none')[:12]}, its fork {ffam}@r{frev} was published with "
                           f"{(published[0] or 'none')[:12]}")
    report.checked["chain_links"] = links


def _fmt_sources(c: Counter) -> str:
    return "{" + ", ".join(f"{k[0]}@r{k[1]}: {n}" for k, n in sorted(c.items(), key=lambda kv: (kv[0][0], kv[0][1]))) + "}"


def run_audit(db: str) -> AuditReport:
    con = open_read_only(db)
    try:
        return audit(con)
    finally:
        con.close()


def to_rows(report: AuditReport, limit: int | None = None) -> list[dict[str, Any]]:
    per_kind: Counter = Counter()
    rows = []
    for f in report.findings:
        per_kind[f.kind] += 1
        if limit is None or per_kind[f.kind] <= limit:
            rows.append({"severity": "violation" if f.violation else "warning", **asdict(f)})
    return rows
