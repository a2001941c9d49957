"""The replay database: one Arrow schema per table (the DDL is derived from it) and the views.

Every event table carries the envelope (event_id, run_id, producer, created_at, causation_id,
schema_version) and where the message sat on the log: ``_topic``, ``_partition``, ``_offset``
and ``_ts`` (the Kafka record timestamp). Rows are appended in log order and never updated, so a
message re-emitted on the log (a producer retry, a service restarted mid-transaction) shows up as
two rows with the same id and different ``_offset``; the audit tells a harmless re-emission (same
content digest) from a conflict.

Token ids, logprobs and loss masks are LIST columns (INTEGER[], FLOAT[], UTINYINT[]); nested
values without a fixed shape (chat messages, seeds, artifacts, members) are JSON text.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
KAFKA_TS = pa.timestamp("ms", tz="UTC")
STR = pa.string()
I32 = pa.int32()
I64 = pa.int64()
F64 = pa.float64()
STR_LIST = pa.list_(STR)

ENVELOPE = [
    pa.field("event_id", STR), pa.field("run_id", STR), pa.field("producer", STR),
    pa.field("created_at", TS), pa.field("causation_id", STR), pa.field("schema_version", I32),
]
KAFKA = [pa.field("_topic", STR), pa.field("_partition", I32), pa.field("_offset", I64), pa.field("_ts", KAFKA_TS)]


def column(name: str, type_: pa.DataType, default: str) -> pa.Field:
    """A column added after the first release: ``default`` (SQL) fills it in rows of an older database."""
    return pa.field(name, type_, metadata={"default": default})


def policy_fields(prefix: str = "policy") -> list[pa.Field]:
    return [pa.field(f"{prefix}_family", STR), pa.field(f"{prefix}_revision", I64),
            pa.field(f"{prefix}_checkpoint_digest", STR)]


def source_fields() -> list[pa.Field]:
    """A derived run's event: the source run's event it was computed from (``schemas.envelope.SourceEvent``)."""
    return [column("source_run_id", STR, "NULL"), column("source_topic", STR, "NULL"),
            column("source_partition", I32, "NULL"), column("source_offset", I64, "NULL"),
            column("source_digest", STR, "NULL")]


@dataclass(frozen=True)
class Table:
    name: str
    schema: pa.Schema
    doc: str


def _table(name: str, fields: list[pa.Field], doc: str, *, envelope: bool = True, kafka: bool = True) -> Table:
    return Table(name, pa.schema((ENVELOPE if envelope else []) + fields + (KAFKA if kafka else [])), doc)


# PolicyRevision.metrics with a typed column of their own in policy_revisions
REVISION_METRIC_COLUMNS = ("mismatch_mean", "mismatch_max", "mismatch_kl", "mismatch_tokens")

POLICY_REVISIONS = _table("policy_revisions", [
    pa.field("family", STR), pa.field("revision", I64), pa.field("checkpoint_uri", STR),
    pa.field("checkpoint_digest", STR), pa.field("parent_revision", I64),
    column("batch_id", STR, "NULL"), column("batch_digest", STR, "NULL"),
    column("metrics", pa.map_(STR, F64), "NULL"),
    *(column(name, F64, "NULL") for name in REVISION_METRIC_COLUMNS),
    column("objective_type", STR, "NULL"), column("objective", STR, "NULL"), column("probed", pa.bool_(), "false"),
    column("fork_family", STR, "NULL"), column("fork_revision", I64, "NULL"),
    column("fork_checkpoint_digest", STR, "NULL"), *source_fields(),
], "PolicyRevision events: which weights exist (family, revision, checkpoint) and the trainer's statistics "
   "for the step that made them (metrics; mismatch_* copied out of it) and the objective it optimized "
   "(objective_type, and its settings as JSON), whether it carries a logprob probe its servers were checked against "
   "(probed); a derived run's first revision names "
   "the source revision it forked from (fork_*, source_*)")

STEPS = _table("steps", [
    pa.field("step_id", STR), pa.field("rollout_id", STR), pa.field("root_group_id", STR),
    pa.field("step_index", I32), pa.field("member_id", STR), pa.field("target", STR),
    pa.field("trainable", pa.bool_()), *policy_fields(), column("policy_exact", pa.bool_(), "true"),
    pa.field("prompt", STR), pa.field("completion", STR), pa.field("tool_calls", STR),
    pa.field("prompt_token_ids", pa.list_(I32)), pa.field("completion_token_ids", pa.list_(I32)),
    pa.field("completion_logprobs", pa.list_(pa.float32())),
    pa.field("n_prompt_tokens", I32), pa.field("n_completion_tokens", I32),
    pa.field("finish_reason", STR), pa.field("latency_s", F64),
], "Step events: one model call each; prompt/completion/tool_calls are JSON, token arrays are lists")

ROLLOUTS = _table("rollouts", [
    pa.field("rollout_id", STR), pa.field("episode_type", STR), pa.field("environment", STR),
    pa.field("example_id", STR), pa.field("seed", STR), pa.field("step_ids", STR_LIST),
    pa.field("members", STR), pa.field("trainable_members", STR_LIST), pa.field("artifacts", STR),
    pa.field("parent_rollout_id", STR), pa.field("child_rollout_ids", STR_LIST),
    pa.field("group_id", STR), pa.field("root_group_id", STR), pa.field("group_size", I32),
    *policy_fields(), pa.field("status", STR), pa.field("failure_reason", STR),
    column("evaluation", pa.bool_(), "false"), column("train_source", STR, "NULL"),
], "Rollout events: finished episodes with their step ids, parent/child rollouts, group and training source")

SCORES = _table("scores", [
    pa.field("rollout_id", STR), pa.field("group_id", STR), pa.field("root_group_id", STR),
    pa.field("group_size", I32), pa.field("environment", STR), pa.field("example_id", STR),
    pa.field("parent_rollout_id", STR), pa.field("status", STR),
    pa.field("rewards", pa.map_(STR, F64)), pa.field("metrics", pa.map_(STR, F64)),
    pa.field("verifier", STR), pa.field("verifier_version", STR),
    pa.field("trainable_step_ids", STR_LIST), column("evaluation", pa.bool_(), "false"), *source_fields(),
    column("train_source", STR, "NULL"),
], "RolloutScored events: the verifier's rewards (member -> reward) and metrics per rollout; a derived run's "
   "name the source run's Rollout they re-scored (source_*)")

REFERENCE_SCORES = _table("reference_scores", [
    pa.field("rollout_id", STR), pa.field("group_id", STR), pa.field("root_group_id", STR),
    pa.field("score_event_id", STR), pa.field("train_source", STR), pa.field("reference_model", STR),
    pa.field("reference_base_url", STR), pa.field("reference_revision", STR), pa.field("step_ids", STR_LIST),
    pa.field("ref_logprobs", pa.list_(pa.list_(pa.float32()))), pa.field("n_tokens", I32),
    pa.field("ref_logprob_mean", F64),
], "RolloutReferenced events: which reference scored a ref_kl source's rollout (model, endpoint, what it served) "
   "and its logprob of every trainable completion token (one list per step, in step_ids' order)")

SCORE_REWARDS = _table("score_rewards", [
    pa.field("score_event_id", STR), pa.field("rollout_id", STR), pa.field("member_id", STR),
    pa.field("reward", F64),
], "one row per (scored rollout, member): the rewards of `scores` in long form", envelope=False, kafka=False)

TRAINING_RECORDS = _table("training_records", [
    pa.field("record_id", STR), pa.field("rollout_id", STR), pa.field("step_ids", STR_LIST),
    pa.field("member_id", STR), pa.field("group_id", STR), pa.field("environment", STR), *policy_fields(),
    pa.field("prompt_token_ids", pa.list_(I32)), pa.field("completion_token_ids", pa.list_(I32)),
    pa.field("completion_logprobs", pa.list_(pa.float32())), pa.field("loss_mask", pa.list_(pa.uint8())),
    pa.field("n_completion_tokens", I32), pa.field("n_trained_tokens", I32),
    pa.field("reward", F64), pa.field("advantage", F64), pa.field("credit", STR),
    pa.field("record_digest", STR), *source_fields(), column("ref_logprobs", pa.list_(pa.float32()), "NULL"),
    column("ce_spans", STR, "NULL"), column("n_ce_tokens", I32, "0"),
], "TrainingRecord events; record_digest is schemas.digests.record_digest of the event as read; a derived "
   "run's name the source run's Rollout their tokens come from (source_*); an opd source's carry the reference's "
   "logprob of each completion token (ref_logprobs, credit 'ref_kl'); an echo run's, the prompt tokens trained "
   "with cross-entropy (ce_spans: JSON [[start, end, weight], ...] over prompt_token_ids; n_ce_tokens)")

TRAINER_BATCHES = _table("trainer_batches", [
    pa.field("batch_id", STR), pa.field("family", STR), pa.field("target_revision", I64),
    pa.field("target_checkpoint_digest", STR), pa.field("max_off_policy_steps", I32), pa.field("n_records", I32),
    pa.field("reward_mean", F64), pa.field("reward_std", F64), pa.field("reward_min", F64), pa.field("reward_max", F64),
    pa.field("advantage_mean", F64), pa.field("advantage_std", F64),
    pa.field("completion_tokens", I64), pa.field("proof_refs", STR_LIST),
    pa.field("batch_digest", STR), pa.field("lineage_digest", STR),
    column("history_source_run_id", STR, "NULL"), column("history_fork_family", STR, "NULL"),
    column("history_fork_revision", I64, "NULL"), column("history_importance", STR, "NULL"),
    column("history_clip", F64, "NULL"),
], "TrainerBatch events (a derived run's: the history rule, history_*) (their records are in batch_records, their source revisions in batch_sources)")

BATCH_RECORDS = _table("batch_records", [
    pa.field("batch_id", STR), pa.field("batch_offset", I64), pa.field("position", I32),
    pa.field("record_id", STR), pa.field("record_digest", STR), pa.field("record_event_id", STR),
    pa.field("rollout_id", STR), pa.field("member_id", STR), *policy_fields(),
    pa.field("reward", F64), pa.field("advantage", F64), pa.field("n_completion_tokens", I32),
], "the records embedded in each trainer batch, in batch order; record_digest is computed from the "
   "embedded copy (batch_offset is the batch message's offset)", envelope=False, kafka=False)

BATCH_SOURCES = _table("batch_sources", [
    pa.field("batch_id", STR), pa.field("batch_offset", I64), *policy_fields(), pa.field("records", I32),
], "each batch's declared source revisions with their record counts (the lineage)", envelope=False, kafka=False)

DEAD_LETTERS = _table("dead_letters", [
    pa.field("origin_topic", STR), pa.field("origin_partition", I32), pa.field("origin_offset", I64),
    pa.field("origin_key", pa.binary()), pa.field("raw", pa.binary()), pa.field("error_type", STR),
    pa.field("error_message", STR), pa.field("service", STR), pa.field("partial", pa.bool_()),
    pa.field("raw_event_type", STR), pa.field("raw_subject_id", STR),
], "DeadLetter events; raw_event_type/raw_subject_id are read from `raw` when it decodes (record_id, rollout_id...); "
   "partial: one record of an input the service otherwise processed (a batch trained without its stale records)")

ADMISSIONS = _table("admissions", [
    pa.field("event_type", STR), pa.field("claim_id", STR), pa.field("arena_id", STR), pa.field("family", STR),
    pa.field("group_id", STR), pa.field("rollouts", I32), pa.field("seen_revision", I64),
    pa.field("batch_size", I32), pa.field("max_off_policy_steps", I32), pa.field("lease_s", F64),
    pa.field("reason", STR), column("slots", I32, "NULL"), column("revision", I64, "NULL"),
    column("claims", I32, "NULL"),
], "the arenas' admissions ledger in log order (schemas.admission): claims, done groups, renewed leases, released "
   "claims, groups an admission gate refunded (by group_id), and the batcher's rebases (revision, claims)")

REPLAY_ERRORS = _table("replay_errors", [
    pa.field("key", pa.binary()), pa.field("value", pa.binary()), pa.field("headers", STR), pa.field("error", STR),
], "messages of this run that could not be decoded (kept whole, with the reason)", envelope=False)

TABLES: dict[str, Table] = {t.name: t for t in (
    POLICY_REVISIONS, STEPS, ROLLOUTS, SCORES, SCORE_REWARDS, REFERENCE_SCORES, TRAINING_RECORDS, TRAINER_BATCHES,
    BATCH_RECORDS, BATCH_SOURCES, DEAD_LETTERS, ADMISSIONS, REPLAY_ERRORS)}

# Which table each event type lands in (child tables are written alongside their parent).
TABLE_FOR_EVENT = {
    "policy_revision": "policy_revisions", "step": "steps", "rollout": "rollouts", "rollout_scored": "scores",
    "rollout_referenced": "reference_scores", "training_record": "training_records", "trainer_batch": "trainer_batches", "dead_letter": "dead_letters",
    "admission_claim": "admissions", "admission_done": "admissions", "admission_renew": "admissions",
    "admission_release": "admissions", "admission_refund": "admissions",
    "admission_rebase": "admissions",
}

_DUCK_TYPES = {
    pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.float64(): "DOUBLE",
    pa.float32(): "FLOAT", pa.bool_(): "BOOLEAN", pa.uint8(): "UTINYINT", pa.binary(): "BLOB",
    TS: "TIMESTAMPTZ", KAFKA_TS: "TIMESTAMPTZ",
}


def duck_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return duck_type(t.value_type) + "[]"
    if pa.types.is_map(t):
        return f"MAP({duck_type(t.key_type)}, {duck_type(t.item_type)})"
    return _DUCK_TYPES[t]


def column_sql(f: pa.Field) -> str:
    default = (f.metadata or {}).get(b"default")
    return f'"{f.name}" {duck_type(f.type)}' + (f" DEFAULT {default.decode()}" if default else "")


def create_table_sql(table: Table) -> str:
    cols = ",\n  ".join(column_sql(f) for f in table.schema)
    return f"CREATE TABLE IF NOT EXISTS {table.name} (\n  {cols}\n)"


META_SQL = [
    """CREATE TABLE IF NOT EXISTS _replay_offsets (
  topic VARCHAR, "partition" INTEGER, next_offset BIGINT, PRIMARY KEY (topic, "partition"))""",
    "CREATE TABLE IF NOT EXISTS _replay_meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
]

# Views a user wants out of the box. Steps are attributed to the revision that produced their
# tokens; a step earns its rollout's reward for the member that spoke it. Evaluation rollouts
# (held out, never trained on) are left out of the training views (reward, pass rates), carry an
# `evaluation` column where a view lists everything (v_step_rewards, v_token_counts), and have
# views of their own (v_eval_*). Views are created in this order (later ones use earlier ones).
# The verifier's own exact-answer verdict for member `m` of score `sc`, where it reports one: a rubric's reward
# function or metric named exact_match (or exact_answer, arithmetic's shaped rubric); NULL otherwise.
_EXACT = ("coalesce(sc.metrics[{m} || '/metric/exact_match'], sc.metrics[{m} || '/reward/exact_match'], "
          "sc.metrics[{m} || '/reward/exact_answer'])")

VIEWS: dict[str, str] = {
    "v_eval_rollouts": """
SELECT rollout_id FROM rollouts WHERE evaluation UNION SELECT rollout_id FROM scores WHERE evaluation""",
    "v_step_rewards": """
SELECT s.step_id, s.rollout_id, s.member_id AS role, s.trainable, s.policy_family, s.policy_revision,
       s.policy_exact, s.n_prompt_tokens, s.n_completion_tokens, r.reward,
       s.rollout_id IN (SELECT rollout_id FROM v_eval_rollouts) AS evaluation
FROM steps s LEFT JOIN score_rewards r ON r.rollout_id = s.rollout_id AND r.member_id = s.member_id""",
    "v_reward_by_revision": """
SELECT s.policy_family, s.policy_revision, s.member_id AS role, bool_or(s.trainable) AS trainable,
       count(*) AS steps, count(r.reward) AS scored_steps, avg(r.reward) AS mean_reward,
       stddev_pop(r.reward) AS std_reward, min(r.reward) AS min_reward, max(r.reward) AS max_reward,
       sum(s.n_completion_tokens) AS completion_tokens, count(*) FILTER (WHERE NOT s.policy_exact) AS inexact_steps
FROM steps s LEFT JOIN score_rewards r ON r.rollout_id = s.rollout_id AND r.member_id = s.member_id
WHERE s.rollout_id NOT IN (SELECT rollout_id FROM v_eval_rollouts)
GROUP BY ALL ORDER BY s.policy_family, s.policy_revision, role""",
    "v_reward_by_admission_revision": """
SELECT ro.policy_family, ro.policy_revision, sr.member_id AS role,
       list_contains(ro.trainable_members, sr.member_id) AS trainable,
       count(*) AS rollouts, avg(sr.reward) AS mean_reward, stddev_pop(sr.reward) AS std_reward
FROM score_rewards sr JOIN rollouts ro ON ro.rollout_id = sr.rollout_id
WHERE sr.rollout_id NOT IN (SELECT rollout_id FROM v_eval_rollouts)
GROUP BY ALL ORDER BY ro.policy_family, ro.policy_revision, role""",
    # Per evaluation answer (rollout x trainable member), attributed to the revision of that member's
    # steps (the latest, if a weight swap fell inside the episode: mixed_revision). Correct = the
    # verifier's exact-answer verdict for the member (_EXACT) when it reports one, else reward >= 1.
    "v_eval_answers": f"""
WITH sc AS (SELECT DISTINCT ON (rollout_id) * FROM scores WHERE evaluation ORDER BY rollout_id, _offset),
learner AS (
  SELECT rollout_id, member_id, policy_family, max(policy_revision) AS policy_revision,
         count(DISTINCT policy_revision) > 1 AS mixed_revision, bool_and(policy_exact) AS policy_exact
  FROM steps WHERE trainable AND rollout_id IN (SELECT rollout_id FROM sc) GROUP BY ALL)
SELECT l.policy_family, l.policy_revision, sc.rollout_id, l.member_id AS role, sc.environment, sc.example_id,
       sc.status, sc.rewards[l.member_id] AS reward,
       coalesce({_EXACT.format(m='l.member_id')}, CASE WHEN sc.rewards[l.member_id] >= 1 THEN 1.0 ELSE 0.0 END) >= 1
         AS correct,
       l.mixed_revision, l.policy_exact
FROM sc JOIN learner l ON l.rollout_id = sc.rollout_id""",
    "v_eval_accuracy_by_revision": """
SELECT policy_family, policy_revision, count(DISTINCT rollout_id) AS rollouts, count(*) AS answers,
       avg(reward) AS mean_reward, avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS accuracy,
       count(*) FILTER (WHERE correct) AS correct, count(*) FILTER (WHERE mixed_revision) AS mixed_revision,
       count(*) FILTER (WHERE NOT policy_exact) AS inexact
FROM v_eval_answers GROUP BY ALL ORDER BY policy_family, policy_revision""",
    # PolicyRevision.metrics in long form, and the trainer-inference logprob mismatch it reports:
    # measured while training `revision` on the tokens `measured_revision` (its parent) generated, with the
    # objective that step optimized (its masked or clipped fractions are among the metrics).
    "v_revision_metrics": """
SELECT family, revision, e.key AS name, e.value
FROM (SELECT DISTINCT ON (family, revision) family, revision, metrics FROM policy_revisions
      ORDER BY family, revision, _offset), unnest(map_entries(metrics)) AS u(e)
ORDER BY family, revision, name""",
    "v_logprob_mismatch": """
SELECT DISTINCT ON (family, revision) family, revision, parent_revision AS measured_revision,
       mismatch_mean, mismatch_max, mismatch_kl, mismatch_tokens, objective_type
FROM policy_revisions WHERE mismatch_mean IS NOT NULL OR mismatch_max IS NOT NULL
ORDER BY family, revision, _offset""",
    "v_batch_staleness": """
SELECT b.batch_id, b._offset AS batch_offset, b.family, b.target_revision, b.max_off_policy_steps,
       br.record_id, br.policy_revision AS source_revision, b.target_revision - br.policy_revision AS staleness,
       (b.target_revision - br.policy_revision) > b.max_off_policy_steps
         OR br.policy_revision > b.target_revision OR br.policy_family <> b.family AS breaks_bound
FROM trainer_batches b JOIN batch_records br ON br.batch_id = b.batch_id AND br.batch_offset = b._offset""",
    "v_staleness_distribution": """
SELECT batch_id, batch_offset, target_revision, staleness, count(*) AS records
FROM v_batch_staleness GROUP BY ALL ORDER BY batch_offset, staleness""",
    "v_staleness_summary": """
SELECT batch_id, batch_offset, target_revision, max_off_policy_steps, count(*) AS records,
       min(staleness) AS min_staleness, avg(staleness) AS mean_staleness, max(staleness) AS max_staleness,
       histogram(staleness) AS histogram, count(*) FILTER (WHERE breaks_bound) AS out_of_bound
FROM v_batch_staleness GROUP BY ALL ORDER BY batch_offset""",
    # A pass is what the environment's verifier calls one, per answer (training rollout x trainable scored member,
    # every scored member when none is trainable): its exact-answer verdict (_EXACT), else an exact_match
    # verifier's reward of 1; a failed episode is no pass. Verifiers without a pass/fail verdict (judges, Monte
    # Carlo, rubrics without an exact part) give no answers: pass_rate is NULL and mean_reward is what there is.
    "v_env_pass_rates": f"""
WITH scored AS (
  SELECT sc.rollout_id, sc.environment, sc.status, sr.member_id, sr.reward,
         {_EXACT.format(m='sr.member_id')} AS exact, sc.verifier,
         list_contains(ro.trainable_members, sr.member_id) AS trainable,
         bool_or(list_contains(ro.trainable_members, sr.member_id)) OVER (PARTITION BY sc.event_id) AS any_trainable
  FROM scores sc
  LEFT JOIN score_rewards sr ON sr.score_event_id = sc.event_id
  LEFT JOIN (SELECT DISTINCT ON (rollout_id) rollout_id, trainable_members FROM rollouts) ro
         ON ro.rollout_id = sc.rollout_id
  WHERE sc.rollout_id NOT IN (SELECT rollout_id FROM v_eval_rollouts)),
answers AS (
  SELECT *, CASE WHEN exact IS NOT NULL THEN 'exact-answer metric = 1'
                 WHEN verifier = 'exact_match' THEN 'exact_match reward = 1'
                 WHEN status = 'failed' THEN 'failed episode' END AS rule,
         CASE WHEN exact IS NOT NULL THEN exact >= 1 WHEN verifier = 'exact_match' THEN reward >= 1
              WHEN status = 'failed' THEN false END AS passed
  FROM scored WHERE member_id IS NULL OR trainable OR NOT coalesce(any_trainable, false))
SELECT environment, count(DISTINCT rollout_id) AS rollouts, count(passed) AS answers,
       count(*) FILTER (WHERE passed) AS passes,
       CASE WHEN count(*) FILTER (WHERE rule <> 'failed episode') > 0
            THEN count(*) FILTER (WHERE passed) / count(passed) END AS pass_rate,
       string_agg(DISTINCT rule, '; ') FILTER (WHERE rule <> 'failed episode') AS pass_rule,
       string_agg(DISTINCT verifier, ', ') AS verifiers, avg(reward) AS mean_reward,
       count(DISTINCT rollout_id) FILTER (WHERE status = 'failed') / count(DISTINCT rollout_id) AS failed_rate,
       count(DISTINCT rollout_id) FILTER (WHERE status = 'truncated') / count(DISTINCT rollout_id) AS truncated_rate
FROM answers GROUP BY environment ORDER BY environment""",
    "v_token_counts": """
SELECT ro.environment, s.member_id AS role, s.policy_family, s.policy_revision,
       s.rollout_id IN (SELECT rollout_id FROM v_eval_rollouts) AS evaluation, count(*) AS steps,
       sum(s.n_prompt_tokens) AS prompt_tokens, sum(s.n_completion_tokens) AS completion_tokens,
       avg(s.n_completion_tokens) AS mean_completion_tokens
FROM steps s LEFT JOIN (SELECT DISTINCT ON (rollout_id) rollout_id, environment FROM rollouts) ro
  ON ro.rollout_id = s.rollout_id
GROUP BY ALL ORDER BY ALL""",
    "v_rollout_links": """
SELECT rollout_id, group_id, root_group_id, parent_rollout_id, unnest(child_rollout_ids) AS child_rollout_id
FROM rollouts""",
    "v_groups": """
SELECT group_id, root_group_id, any_value(group_size) AS group_size, count(DISTINCT rollout_id) AS rollouts,
       count(DISTINCT rollout_id) = any_value(group_size) AS complete, list(DISTINCT environment) AS environments
FROM rollouts GROUP BY group_id, root_group_id""",
    "v_lineage": """
SELECT br.batch_id, br.batch_offset, br.position, br.record_id, br.record_digest, tr.record_digest AS replayed_digest,
       br.rollout_id, st.step_id, st.step_index, st.member_id, st.policy_family AS step_family,
       st.policy_revision AS step_revision, pr.checkpoint_digest AS step_checkpoint_digest,
       pr.event_id IS NOT NULL AS revision_known
FROM batch_records br
LEFT JOIN (SELECT DISTINCT ON (record_id) record_id, record_digest, step_ids FROM training_records ORDER BY record_id, _offset) tr
       ON tr.record_id = br.record_id
LEFT JOIN steps st ON list_contains(tr.step_ids, st.step_id)
LEFT JOIN (SELECT DISTINCT ON (family, revision) * FROM policy_revisions ORDER BY family, revision, _offset) pr
       ON pr.family = st.policy_family AND pr.revision = st.policy_revision""",
    "v_revision_chain": """
SELECT pr.family, pr.revision, pr.parent_revision, pr.batch_id, pr.batch_digest,
       tb.batch_digest AS logged_batch_digest, tb.target_revision AS batch_target_revision,
       count(DISTINCT l.record_id) AS records, count(DISTINCT l.rollout_id) AS rollouts,
       count(DISTINCT l.step_id) AS steps,
       coalesce(list(DISTINCT l.step_revision ORDER BY l.step_revision) FILTER (WHERE l.step_revision IS NOT NULL),
                []) AS generated_by
FROM (SELECT DISTINCT ON (family, revision) * FROM policy_revisions ORDER BY family, revision, _offset) pr
LEFT JOIN (SELECT DISTINCT ON (batch_id) * FROM trainer_batches ORDER BY batch_id, _offset) tb ON tb.batch_id = pr.batch_id
LEFT JOIN v_lineage l ON l.batch_id = tb.batch_id AND l.batch_offset = tb._offset
GROUP BY ALL ORDER BY pr.family, pr.revision""",
    "v_counts": """
SELECT 'policy_revisions' AS "table", count(*) AS rows FROM policy_revisions UNION ALL
SELECT 'steps', count(*) FROM steps UNION ALL SELECT 'rollouts', count(*) FROM rollouts UNION ALL
SELECT 'scores', count(*) FROM scores UNION ALL SELECT 'training_records', count(*) FROM training_records UNION ALL
SELECT 'trainer_batches', count(*) FROM trainer_batches UNION ALL SELECT 'batch_records', count(*) FROM batch_records UNION ALL
SELECT 'dead_letters', count(*) FROM dead_letters UNION ALL SELECT 'replay_errors', count(*) FROM replay_errors""",
}

MACROS = [
    # SELECT * FROM batch_lineage('batch-id'): batch -> records -> rollouts -> steps -> producing revisions
    "CREATE OR REPLACE MACRO batch_lineage(b) AS TABLE SELECT * FROM v_lineage WHERE batch_id = b "
    "ORDER BY batch_offset, position, step_index",
]


class UnusableDatabase(RuntimeError):
    """A --db the read commands cannot use; the message says what to do instead."""


class OutdatedSchema(UnusableDatabase):
    """A database replayed by an older version, opened read-only (it is upgraded by the next replay into it)."""


def connect(db: str, *, read_only: bool = True):  # -> duckdb.DuckDBPyConnection
    """An existing replay database (never a new empty one), refused in one line that says what to do."""
    import duckdb

    if not os.path.exists(db):
        raise UnusableDatabase(f"no such DuckDB file {db}: run `rollout replay --db {db}` first")
    if not _is_duckdb_file(db):
        raise UnusableDatabase(f"{db} is not a DuckDB file: give --db the database `rollout replay --db FILE` wrote")
    try:
        return duckdb.connect(db, read_only=read_only)
    except duckdb.Error as e:  # held by a writer, written by a newer DuckDB, ...: DuckDB's reason says which
        raise UnusableDatabase(f"cannot open {db}: {e}") from None


def _is_duckdb_file(path: str) -> bool:
    """Whether the file has DuckDB's magic bytes ("DUCK" after the 8-byte header checksum)."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(12)[8:] == b"DUCK"


def open_read_only(db: str):  # -> duckdb.DuckDBPyConnection
    """The database for reading, refused with a clear reason when it lacks this version's views."""
    con = connect(db)
    missing = sorted(set(VIEWS) - _views(con))
    if missing:
        con.close()
        raise OutdatedSchema(f"{db} was replayed by an older version (no {', '.join(missing)}): run "
                             f"`rollout replay --db {db}` once more to upgrade it")
    return con


def _schema_sql(have: dict[str, set[str]]) -> list[str]:
    """The statements that bring a database whose tables have the columns ``have`` to this version's schema."""
    sql = []
    for t in TABLES.values():
        sql.append(create_table_sql(t))
        if t.name in have:  # replayed by an older version: add the columns it lacks (older events had their defaults)
            sql += [f"ALTER TABLE {t.name} ADD COLUMN {column_sql(f)}" for f in t.schema if f.name not in have[t.name]]
        sql.append(f"COMMENT ON TABLE {t.name} IS '{t.doc.replace(chr(39), chr(39) * 2)}'")
    sql += META_SQL
    sql += [f"CREATE OR REPLACE VIEW {name} AS {body.strip()}" for name, body in VIEWS.items()]
    return sql + MACROS


# What this version's schema is made of; stamped into _replay_meta (key "schema"), so that opening a database
# that already has it costs one lookup instead of re-creating ~60 tables, views and comments (~45 ms).
SCHEMA_DIGEST = hashlib.sha256(";".join(_schema_sql({})).encode()).hexdigest()[:16]


def _views(con) -> set[str]:
    return {v for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal "
                                      "AND database_name = current_database()").fetchall()}


def ensure_schema(con) -> None:  # con: duckdb.DuckDBPyConnection
    """Tables, views and macros of this version, created or upgraded in one call (~40 ms on a new file)."""
    import duckdb

    try:
        stamped = con.execute("SELECT value FROM _replay_meta WHERE key = 'schema'").fetchone() == (SCHEMA_DIGEST,)
    except duckdb.CatalogException:  # a new database (or one older than _replay_meta)
        stamped = False
    if stamped and _views(con) >= set(VIEWS):  # (a view dropped by hand is made again)
        return
    have: dict[str, set[str]] = {}
    for table, column in con.execute("SELECT table_name, column_name FROM duckdb_columns() "
                                     "WHERE database_name = current_database()").fetchall():
        have.setdefault(table, set()).add(column)
    con.execute(";\n".join([*_schema_sql(have),
                             f"INSERT OR REPLACE INTO _replay_meta VALUES ('schema', '{SCHEMA_DIGEST}')"]))
