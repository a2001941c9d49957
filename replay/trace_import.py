"""verifiers traces in as a run (``rollout import``): each episode's sampled calls become Steps, its reward a
score, every token stream and weight span kept, written to the log transactionally."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.envelope import Event
from schemas.events import Rollout, RolloutScored, Step, StepTokens
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision
from schemas.scoring import SCORING_ARTIFACT, ScoringSpec
from replay.traces import (FORMAT_040, FORMAT_DEV, IMPORT_PRODUCER, INFO_KEY, VF_KEY, canonical_spans,
                           check_trace_version, from_v1_message, message_text, node_stream, node_weight_spans,
                           span_revision, trace_format, UnsupportedTraceVersion)


@dataclass
class Imported:
    """The events one traces file becomes: topic key -> events, in the order they are produced."""

    run_id: str
    revisions: list[PolicyRevision] = field(default_factory=list)
    episodes: list[list[tuple[str, Event]]] = field(default_factory=list)  # per rollout: steps, rollout, score
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how a trace stream was read, where worth saying

    @property
    def rollouts(self) -> int:
        return len(self.episodes)

    def transactions(self, per_txn: int = 64) -> list[list[tuple[str, Event]]]:
        txs: list[list[tuple[str, Event]]] = [[("policy-revisions", r) for r in self.revisions]] if self.revisions else []
        for i in range(0, len(self.episodes), per_txn):
            txs.append([m for ep in self.episodes[i:i + per_txn] for m in ep])
        return txs


def read_trace_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, episode record) of a traces.jsonl; a bare trace line is wrapped as a one-trace episode."""
    p = Path(path)
    if p.is_dir():
        if not (p / "traces.jsonl").exists():
            raise FileNotFoundError(f"{p}: neither a traces.jsonl nor a prime-rl trace stream "
                                    "(monitors/file/traces/stream/) is there")
        p = p / "traces.jsonl"
    with p.open(encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "traces" not in row and "nodes" in row:
                row = {"id": row.get("id") or uuid.uuid4().hex, "task": row.get("task"), "ok": row.get("ok", False),
                       "errors": row.get("errors") or [], "traces": [row]}
            yield no, row


def read_episodes(path: str | Path, imp: Imported | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, episode record) of a run's traces: a prime-rl trace stream (its run dir, ``monitors/file/traces`` or
    the ``stream`` dir: chunks in order, sealed ones decompressed, annotations folded on; see
    ``replay.trace_stream``), else a traces.jsonl (the file, or a dir holding one). What a stream read had to
    skip, and how it was read, goes to ``imp.skipped`` and ``imp.notes``."""
    from replay.trace_stream import TraceStream, locate

    traces = locate(path)
    if traces is None:
        for no, row in read_trace_lines(path):
            yield f"line {no}", row
        return
    stream = TraceStream(traces)
    try:
        yield from stream.episodes()
    finally:
        if imp is not None:
            imp.skipped.extend(stream.skipped)
            imp.notes.extend(stream.notes)


def _sampled_calls(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per sampled assistant node: the Step it was (prompt = its path, completion = its sampled span)."""
    nodes = trace.get("nodes") or []
    calls = {c["node"]: c for c in trace.get("calls") or [] if c.get("node") is not None}
    out = []
    for i, node in enumerate(nodes):
        if not node.get("sampled"):
            continue
        path: list[int] = []
        j = node.get("parent")
        while j is not None:
            path.append(j)
            j = nodes[j].get("parent")
        path.reverse()
        where = f"trace {trace.get('id')!r} node {i}"
        prefix = [t for k in path for t in node_stream(nodes[k], "token_ids", f"trace {trace.get('id')!r} node {k}")]
        tok, mask = node_stream(node, "token_ids", where), node_stream(node, "mask", where)
        k = next((n for n, m in enumerate(mask) if m), len(tok))
        sampled_lp = node_stream(node, "logprobs", where)
        lps, li = [], 0
        for m in mask[k:]:
            if m:
                lps.append(sampled_lp[li] if li < len(sampled_lp) else 0.0)
                li += 1
            else:
                lps.append(0.0)
        lps += [0.0] * (len(tok) - k - len(lps))
        call = calls.get(i, {})
        span = call.get("time") or {}
        out.append({"node": i, "prompt": [nodes[k2]["message"] for k2 in path], "message": node["message"],
                    "prompt_token_ids": prefix + tok[:k], "completion_token_ids": tok[k:], "logprobs": lps,
                    "finish_reason": call.get("finish_reason") or "stop", "model": call.get("model"),
                    "start": float(span.get("start") or node.get("timestamp") or 0.0),
                    "latency_s": max(0.0, float(span.get("end") or 0.0) - float(span.get("start") or 0.0)),
                    "weight_versions": node_weight_spans(node, where)})
    return out


def _env_ref(name: str) -> str:
    from schemas.events import ENV_REF

    if ENV_REF.fullmatch(name):
        return name
    clean = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "verifiers"
    ref = f"{clean}@imported"
    return ref if ENV_REF.fullmatch(ref) else "verifiers@imported"


def _trace_reward(trace: Mapping[str, Any]) -> float | None:
    rewards = [r for r in (trace.get("rewards") or {}).values() if r is not None]
    if not rewards:
        return None
    return float(sum(float(r["score"]) * float(r.get("weight", 1.0)) for r in rewards))


def episode_events(ep: Mapping[str, Any], run_id: str, *, family: str | None = None,
                   revisions: dict[tuple[str, int], PolicyRevision] | None = None,
                   producer: str = IMPORT_PRODUCER) -> list[tuple[str, Event]]:
    """One episode record -> [("steps", Step)..., ("rollouts", Rollout), ("scores", RolloutScored)].

    Raises UnsupportedTraceVersion for a trace of another schema version, ValueError for a malformed one."""
    revisions = revisions if revisions is not None else {}
    traces = list(ep.get("traces") or [])
    if not traces:
        raise ValueError("an episode without traces")
    for t in traces:
        check_trace_version(t, f"episode {ep.get('id')!r}")
    forms = {trace_format(t) for t in traces}
    form = FORMAT_DEV if FORMAT_DEV in forms else FORMAT_040
    ours = [t.get("info", {}).get(INFO_KEY) for t in traces]
    head = next((o for o in ours if o), None)
    rollout_id = (head or {}).get("rollout_id") or str(ep.get("id") or uuid.uuid4().hex)
    group_id = (head or {}).get("group_id") or (ep.get("group") or {}).get("id") or \
        (ep.get("task") or {}).get("key") or (ep.get("task") or {}).get("hash") or rollout_id
    root_group_id = (head or {}).get("root_group_id") or group_id
    work = (ep.get("run") or {}).get("work") or {}
    span = work.get("policy") or None
    evaluation = bool((head or {}).get("evaluation")) if head else (
        work.get("type") == "eval" or (ep.get("run") or {}).get("type") == "eval"
        # prime-rl's trace stream holds train and eval work alike, each trace stamped with its kind on arrival
        or any((t.get("info") or {}).get("kind") == "eval" for t in traces))

    def ref_for(trace: Mapping[str, Any], recorded: Mapping[str, Any] | None, spans: list[list[Any]] | None,
                n_completion: int) -> tuple[PolicyRef, bool]:
        """The revision of one call: recorded by our export, else the engine's weight labels, else the episode's
        policy span, else revision 0 (the last three in the agent's model family)."""
        if recorded and recorded.get("policy"):
            p = recorded["policy"]
            ref = PolicyRef(family=p["family"], revision=int(p["revision"]), checkpoint_digest=p.get("checkpoint_digest"))
            return ref, bool(recorded.get("policy_exact", True))
        fam = family or (trace.get("agent") or {}).get("config", {}).get("model") or "imported"
        rev, exact = span_revision(spans, n_completion)
        if rev is not None:
            return PolicyRef(family=fam, revision=rev), exact
        if span:  # exact only when the span has no drift and no engine label says otherwise
            return PolicyRef(family=fam, revision=int(span["start"])), \
                int(span["start"]) == int(span["end"]) and not spans
        return PolicyRef(family=fam, revision=0), False

    members: dict[str, bool] = {}
    names: list[str] = []
    for t, o in zip(traces, ours):
        name = (o or {}).get("member_id") or (t.get("agent") or {}).get("name") or "agent"
        base, n = name, 1
        while name in members:  # several traces of one agent (n solvers): one member each
            n += 1
            name = f"{base}#{n}"
        members[name] = bool((t.get("agent") or {}).get("trainable", True))
        names.append(name)

    # dropped traces: (member -> reason); `derived` ones are our own export's reading of a failed rollout, whose
    # recorded step flags stay as they were. Either way nothing of theirs becomes training data.
    head_kept = ((head or {}).get("artifacts") or {}).get(VF_KEY) or {}
    dropped: dict[str, str] = {}
    derived: set[str] = set()
    new_drops: dict[str, dict[str, Any]] = {}
    for t, member, info in zip(traces, names, ours):
        reason = t.get("dropped")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"trace {t.get('id')!r}: dropped must be a reason (str) or null, "
                             f"got {type(reason).__name__}")
        kept = (head_kept.get("dropped") or {}).get(member)
        if reason is None and isinstance(kept, Mapping):  # our 0.4.0-form export of a dropped trace
            reason = str(kept.get("reason") or "dropped")
        if reason is None:
            continue
        dropped[member] = reason
        if info and info.get("dropped_derived") == reason:
            derived.add(member)
            continue
        was_trainable = bool(kept.get("trainable", members[member])) if isinstance(kept, Mapping) else members[member]
        named_rewards = dict(kept.get("rewards") or {}) if isinstance(kept, Mapping) else \
            {k: r for k, r in (t.get("rewards") or {}).items() if r is not None}
        new_drops[member] = {"reason": reason, "trainable": was_trainable, "rewards": named_rewards}
        members[member] = False  # not the learner's data in this rollout

    pending: list[tuple[float, int, dict[str, Any]]] = []  # (order key, original index or -1, step fields)
    kept_spans: dict[str, list[list[Any]]] = {}
    for t, member, info in zip(traces, names, ours):
        recorded = {s["node"]: s for s in (info or {}).get("steps", [])}
        for pr in (info or {}).get("policy_revisions", []):
            key = (pr["family"], int(pr["revision"]))
            if key not in revisions or revisions[key].checkpoint is None:
                ckpt = CheckpointRef(uri=pr["checkpoint_uri"], digest=pr["checkpoint_digest"]) \
                    if pr.get("checkpoint_uri") and pr.get("checkpoint_digest") else None
                revisions[key] = PolicyRevision(run_id=run_id, producer=producer, family=key[0], revision=key[1],
                                                checkpoint=ckpt, parent_revision=pr.get("parent_revision"))
        learner = members[member] or member in new_drops and new_drops[member]["trainable"]
        for c in _sampled_calls(t):
            rec = recorded.get(c["node"])
            trainable = bool(rec["trainable"]) if rec else members[member]
            if member in dropped and member not in derived:
                trainable = False
            n = len(c["completion_token_ids"])
            spans = c["weight_versions"]
            policy, exact = (ref_for(t, rec, spans, n) if (trainable or learner or (rec and rec.get("policy")))
                             else (None, True))
            if policy is not None and (policy.family, policy.revision) not in revisions:
                revisions[(policy.family, policy.revision)] = PolicyRevision(
                    run_id=run_id, producer=producer, family=policy.family, revision=policy.revision)
            completion = from_v1_message(c["message"])
            step_id = (rec or {}).get("step_id") or f"{rollout_id}.{member}.{c['node']}"
            derivable = policy is not None and exact and spans == canonical_spans(policy.revision, n)
            if spans is not None and not derivable:
                kept_spans[step_id] = spans  # what a Step cannot say: several weights, partial or non-numeric labels
            fields = dict(
                step_id=step_id, member_id=member,
                target=(rec or {}).get("target") or c["model"] or "imported", trainable=trainable,
                policy=policy, policy_exact=exact, prompt=[from_v1_message(m) for m in c["prompt"]],
                completion=[completion], prompt_token_ids=np.asarray(c["prompt_token_ids"], dtype=np.int32),
                completion_token_ids=np.asarray(c["completion_token_ids"], dtype=np.int32),
                completion_logprobs=np.asarray(c["logprobs"], dtype=np.float32),
                finish_reason=(rec or {}).get("finish_reason") or c["finish_reason"],
                tool_calls=list(completion.tool_calls),
                latency_s=float((rec or {}).get("latency_s", c["latency_s"])))
            pending.append((c["start"], int(rec["index"]) if rec else -1, fields))
    if all(i >= 0 for _, i, _ in pending):
        pending.sort(key=lambda x: x[1])
    else:
        pending.sort(key=lambda x: x[0])
    steps = [Step(run_id=run_id, producer=producer, rollout_id=rollout_id, root_group_id=root_group_id, index=i,
                  **fields) for i, (_, _, fields) in enumerate(pending)]

    ok = bool(ep.get("ok")) if "ok" in ep else all(t.get("ok") for t in traces)
    errors = list(ep.get("errors") or []) + [e for t in traces for e in t.get("errors") or []]
    status = (head or {}).get("status") or ("completed" if ok else "failed")
    failure = (head or {}).get("failure_reason") if head else (
        None if ok else "; ".join(f"{e.get('type')}: {e.get('message')}" for e in errors) or "not ok")
    task = ep.get("task") or traces[0].get("task") or {}
    data = task.get("data") or {}
    if head:
        seed = head.get("seed") or {}
        artifacts = dict(head.get("artifacts") or {})
    else:
        seed = {k: v for k, v in data.items() if v not in (None, [], {}, "")}
        last = next((m for t in reversed(traces) for n in reversed(t.get("nodes") or [])
                     if n.get("sampled") and (m := n["message"])), None)
        artifacts = {"verifiers_trace_ids": [t.get("id") for t in traces],
                     "final_text": message_text(last.get("content")) if last else None,
                     "stop_reason": next((t.get("stop_condition") for t in traces if t.get("stop_condition")), None),
                     "verifiers_version": (traces[0].get("verifiers") or {}).get("version")}
        artifacts[VF_KEY] = {"format": form, "agents": {m: t.get("agent") for m, t in zip(names, traces)
                                                        if t.get("agent")}}
        # a trace's info as read, annotations folded on (prime-rl: kind, dispatch/arrival/ship {step, time},
        # effective, advantage, trainer): no event field holds it
        infos = {m: info for m, t in zip(names, traces) if (info := t.get("info"))}
        if infos:
            artifacts[VF_KEY]["info"] = infos
    if new_drops or kept_spans:  # kept so that an export writes them back (and a re-import finds them)
        vf_kept = dict(artifacts.get(VF_KEY) or {"format": form})
        if new_drops:
            vf_kept["dropped"] = {**(vf_kept.get("dropped") or {}), **new_drops}
        if kept_spans:
            vf_kept["weight_versions"] = {**(vf_kept.get("weight_versions") or {}), **kept_spans}
        artifacts[VF_KEY] = vf_kept
    rpol = (head or {}).get("rollout_policy")
    learner_refs = [s.policy for s in steps if s.policy and (s.trainable or s.member_id in new_drops)]
    rollout_policy = PolicyRef(**rpol) if rpol else (learner_refs[0] if learner_refs else None)
    env_name = (head or {}).get("environment") or (ep.get("env") or {}).get("name") or (ep.get("env") or {}).get("id") \
        or "verifiers"
    group_size = int((head or {}).get("group_size") or 1)
    # a dropped trace is left out of the rewards (and so of every baseline and group mean) and of the training data
    left_out = set(dropped) - derived
    rewards = {m: r for m, t in zip(names, traces) if m not in left_out and (r := _trace_reward(t)) is not None}
    if rewards and not head:  # a foreign trace: on the log, a verifier scores it with the reward it came with
        artifacts[SCORING_ARTIFACT] = ScoringSpec(kind="recorded", params={"rewards": rewards}).model_dump(mode="json")
    rollout = Rollout(
        run_id=run_id, producer=producer, rollout_id=rollout_id,
        episode_type=(head or {}).get("episode_type") or "verifiers",
        environment=_env_ref(env_name), example_id=str((head or {}).get("example_id") or task.get("key")
                                                        or data.get("id") or data.get("idx") or task.get("hash") or "0"),
        seed=seed, step_ids=[s.step_id for s in steps], members=members, artifacts=artifacts,
        parent_rollout_id=(head or {}).get("parent_rollout_id"), child_rollout_ids=(head or {}).get("child_rollout_ids") or [],
        group_id=group_id, root_group_id=root_group_id, group_size=group_size, policy=rollout_policy,
        status=status, failure_reason=failure if status != "completed" else None, evaluation=evaluation)
    out: list[tuple[str, Event]] = [("steps", s) for s in steps] + [("rollouts", rollout)]

    scored_by = (head or {}).get("score")
    if rewards or scored_by or dropped:
        metrics: dict[str, float] = {}
        for m, t in zip(names, traces):
            for k, v in (t.get("metrics") or {}).items():
                if v is None:
                    continue
                key = k if (k not in metrics or metrics[k] == float(v)) else f"{m}/{k}"
                metrics[key] = float(v)
            advantage = (t.get("info") or {}).get("advantage")  # the credit prime-rl gave it (an annotation)
            if isinstance(advantage, (int, float)) and not isinstance(advantage, bool):
                metrics[f"{m}/advantage" if len(traces) > 1 else "advantage"] = float(advantage)
            named = {k: r for k, r in (t.get("rewards") or {}).items() if r is not None}
            if set(named) != {"reward"} and m not in left_out:
                for k, r in named.items():
                    metrics[f"{m}/reward/{k}" if len(traces) > 1 else f"reward/{k}"] = float(r["score"])
        version = (traces[0].get("verifiers") or {}).get("version") or "unknown"
        out.append(("scores", RolloutScored(
            run_id=run_id, producer=producer, causation_id=rollout.event_id, rollout_id=rollout_id,
            group_id=group_id, root_group_id=root_group_id, group_size=group_size, environment=rollout.environment,
            example_id=rollout.example_id, parent_rollout_id=rollout.parent_rollout_id, status=status,
            rewards=rewards, metrics=metrics,
            verifier=(scored_by or {}).get("verifier") or "verifiers",
            verifier_version=(scored_by or {}).get("verifier_version") or version,
            trainable_steps=training_steps(steps, status, dropped),
            evaluation=evaluation)))
    return out


def training_steps(steps: list[Step], status: str, dropped: Mapping[str, str] | None = None) -> list[StepTokens]:
    """The steps a score offers for training, as the scoring service decides (``consumers.scoring.trainable_steps``:
    trainable, with a revision, of a rollout that did not fail), less every step of a dropped trace."""
    if status == "failed":
        return []
    return [StepTokens.of(s) for s in sorted(steps, key=lambda s: s.index)
            if s.trainable and s.policy is not None and s.member_id not in (dropped or {})]


def import_file(path: str | Path, run_id: str | None = None, *, family: str | None = None) -> Imported:
    """A run's traces as the events of a new run (nothing is produced; see ``produce_imported``): a traces.jsonl,
    or a prime-rl trace stream directory (``read_episodes``).

    A malformed episode is skipped (``Imported.skipped``); a trace of an unknown schema version raises
    UnsupportedTraceVersion, and nothing of the file is imported."""
    imp = Imported(run_id=run_id or uuid.uuid4().hex[:12])
    revisions: dict[tuple[str, int], PolicyRevision] = {}
    by_rollout: dict[str, int] = {}
    for where, ep in read_episodes(path, imp):
        try:
            events = episode_events(ep, imp.run_id, family=family, revisions=revisions)
        except UnsupportedTraceVersion as e:  # not one bad line: a file of a schema we do not read, refused whole
            raise UnsupportedTraceVersion(f"{path} {where}: {e}") from None
        except (ValueError, KeyError, TypeError) as e:
            imp.skipped.append(f"{where}: {type(e).__name__}: {e}")
            continue
        rid = next(e.rollout_id for k, e in events if k == "rollouts")
        if rid in by_rollout:  # a re-run of the same rollout id (a resumed eval): the last line wins
            imp.episodes[by_rollout[rid]] = events
        else:
            by_rollout[rid] = len(imp.episodes)
            imp.episodes.append(events)
    imp.revisions = sorted(revisions.values(), key=lambda r: (r.family, r.revision))
    return imp


async def produce_imported(imp: Imported, settings, *, transactional_id: str | None = None) -> int:
    """Create the topics (current ROLLOUT_TOPIC_PREFIX) and produce the import, transaction by transaction."""
    from replay.runs import default_topics
    from replay.synthetic import produce
    from streams import topics

    await topics.create_topics(settings.admin_kwargs())
    return await produce(imp.transactions(), settings.client_kwargs(), default_topics(),
                         transactional_id=transactional_id or f"rollout-import-{imp.run_id}")


def summary(imp: Imported) -> str:
    n_steps = sum(1 for ep in imp.episodes for k, _ in ep if k == "steps")
    n_scores = sum(1 for ep in imp.episodes for k, _ in ep if k == "scores")
    return (f"imported run {imp.run_id}: {imp.rollouts} rollouts, {n_steps} steps, {n_scores} scores, "
            f"{len(imp.revisions)} policy revisions" + (f"; {len(imp.skipped)} lines skipped" if imp.skipped else ""))
