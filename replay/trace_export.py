"""A replayed run out as verifiers traces (``rollout export``): one episode record per rollout, each member's
trace graph with its token streams and weight spans, validated against verifiers' own models when it is installed."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from replay.traces import (FORMAT_040, FORMAT_DEV, INFO_KEY, TRACE_FORMATS, TRACE_VERSION, VF_KEY, canonical_spans,
                           epoch_seconds, finish_reason_of, to_v1_message)


@dataclass
class StepRow:
    """What the export needs of one Step (a row of the replayed ``steps`` table, or a Step event)."""

    step_id: str
    index: int
    member_id: str
    target: str
    trainable: bool
    policy: dict[str, Any] | None
    policy_exact: bool
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    latency_s: float
    created_at: float


def step_weight_spans(s: StepRow, kept: Mapping[str, Any] | None = None) -> list[list[Any]] | None:
    """The ``weight_versions`` spans of a step's completion: the ones an import kept, else one span of its revision
    when that is exact, else None (we do not know which weights sampled which token)."""
    if kept and s.step_id in kept:
        return [list(x) for x in kept[s.step_id]]
    if s.policy and s.policy_exact and len(s.completion_token_ids):
        return canonical_spans(int(s.policy["revision"]), len(s.completion_token_ids))
    return None


def member_trace_graph(steps: list[StepRow], weight_spans: Mapping[str, list[list[Any]] | None] | None = None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One member's Steps (call order) -> (nodes, calls) of a v1 trace's message graph.

    ``weight_spans`` (the development form): step_id -> its completion's ``[[version, start, end], ...]``, written as
    the sampled node's ``weight_versions`` (left out where None, as the development builds' writer does)."""
    nodes: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    leaf: int | None = None
    path_msgs: list[dict[str, Any]] = []
    path_tokens: list[int] = []
    for s in steps:
        prompt = [to_v1_message(m) for m in s.prompt]
        pt, ct = list(s.prompt_token_ids), list(s.completion_token_ids)
        if leaf is not None and prompt[:len(path_msgs)] == path_msgs and pt[:len(path_tokens)] == path_tokens:
            parent, new_msgs, delta = leaf, prompt[len(path_msgs):], pt[len(path_tokens):]
        else:  # first call, or a history that is not an extension of the last one: a new branch
            parent, new_msgs, delta = None, prompt, pt
        for m in new_msgs:
            nodes.append({"parent": parent, "message": m, "sampled": False, "timestamp": s.created_at,
                          "token_ids": [], "mask": [], "logprobs": []})
            parent = len(nodes) - 1
        if len(s.completion) != 1:
            raise ValueError(f"step {s.step_id}: {len(s.completion)} completion messages (one assistant message expected)")
        reply = to_v1_message(s.completion[0])
        nodes.append({"parent": parent, "message": reply, "sampled": True, "timestamp": s.created_at + s.latency_s,
                      "token_ids": delta + ct, "mask": [False] * len(delta) + [True] * len(ct),
                      "logprobs": [float(x) for x in s.completion_logprobs]})
        if weight_spans is not None and weight_spans.get(s.step_id) is not None:
            nodes[-1]["weight_versions"] = [{"version": str(v), "start": int(a), "end": int(b)}
                                            for v, a, b in weight_spans[s.step_id]]
        leaf = len(nodes) - 1
        calls.append({"node": leaf, "model": s.target, "finish_reason": finish_reason_of(s.finish_reason),
                      "usage": {"prompt_tokens": len(pt), "completion_tokens": len(ct)},
                      "time": {"start": s.created_at, "end": s.created_at + s.latency_s}})
        path_msgs, path_tokens = prompt + [reply], pt + ct
    return nodes, calls


def _task(rollout: Mapping[str, Any]) -> dict[str, Any]:
    seed = rollout.get("seed") or {}
    data: dict[str, Any] = {"id": str(rollout["example_id"])}
    prompt = seed.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, Mapping) and "role" in m
                                                                    for m in prompt)):
        data["prompt"] = prompt if isinstance(prompt, str) else [to_v1_message(m) for m in prompt]
    if seed.get("answer") is not None:
        data["answer"] = seed["answer"]
    return {"type": "RolloutLogTask", "data": data, "key": str(rollout["example_id"]),
            "hash": hashlib.sha256(json.dumps(seed, sort_keys=True, default=str).encode()).hexdigest()[:16]}


def _dropped_reason(rollout: Mapping[str, Any], member: str, trainable: bool, mine: list[StepRow],
                    score: Mapping[str, Any] | None) -> str | None:
    """Why a learner seat of ours was not trained on, when its score says so: the score listed none of its steps
    as training data (a failed rollout). None for evaluation rollouts (held out, not dropped) and unscored ones."""
    if not trainable or not mine or rollout.get("evaluation") or score is None or "trainable_step_ids" not in score:
        return None
    listed = set(score.get("trainable_step_ids") or [])
    if any(s.step_id in listed for s in mine):
        return None
    why = f"not trained on: rollout {rollout['status']}"
    return why + (f" ({rollout['failure_reason']})" if rollout.get("failure_reason") else "")


def episode_record(rollout: Mapping[str, Any], steps: list[StepRow], score: Mapping[str, Any] | None,
                   revisions: Mapping[tuple[str, int], Mapping[str, Any]], verifiers_version: str | None = None,
                   *, fmt: str = FORMAT_040) -> dict[str, Any]:
    """One rollout (a dict of Rollout fields), its Steps and its score -> a v1 Episode record.

    ``fmt``: FORMAT_040 (what verifiers 0.4.0 reads) or FORMAT_DEV (the development builds' record: ``dropped``,
    ``weight_versions``, agent records as imported)."""
    if fmt not in (FORMAT_040, FORMAT_DEV):
        raise ValueError(f"unknown trace format {fmt!r}; choose from {', '.join(TRACE_FORMATS)}")
    dev = fmt == FORMAT_DEV
    members: dict[str, bool] = dict(rollout["members"])
    for s in steps:
        members.setdefault(s.member_id, s.trainable)
    task = _task(rollout)
    revs = [s.policy["revision"] for s in steps if s.policy]
    span = {"start": min(revs), "end": max(revs)} if revs else None
    step_no = (rollout.get("policy") or {}).get("revision", span["start"] if span else 0)
    work = {"type": "eval" if rollout.get("evaluation") else "train", "step": step_no, "policy": span}
    ok = rollout["status"] == "completed"
    errors = [] if ok else [{"type": "RolloutFailed", "message": rollout.get("failure_reason") or rollout["status"]}]
    artifacts = rollout.get("artifacts") or {}
    kept = artifacts.get(VF_KEY) if isinstance(artifacts.get(VF_KEY), Mapping) else {}
    kept_agents, kept_drops = kept.get("agents") or {}, kept.get("dropped") or {}
    kept_spans = kept.get("weight_versions") or {}
    traces = []
    for member, trainable in members.items():
        mine = [s for s in steps if s.member_id == member]
        nodes, calls = member_trace_graph(mine, {s.step_id: step_weight_spans(s, kept_spans) for s in mine}
                                          if dev else None)
        reward = (score or {}).get("rewards", {}).get(member)
        rewards = {} if reward is None else {"reward": {"score": float(reward), "weight": 1.0}}
        named = {(s.policy["family"], s.policy["revision"]) for s in mine if s.policy}
        info = {INFO_KEY: {
            "run_id": rollout["run_id"], "rollout_id": rollout["rollout_id"], "member_id": member,
            "episode_type": rollout["episode_type"], "environment": rollout["environment"],
            "example_id": rollout["example_id"], "seed": rollout.get("seed"), "group_id": rollout["group_id"],
            "root_group_id": rollout["root_group_id"], "group_size": rollout["group_size"],
            "parent_rollout_id": rollout.get("parent_rollout_id"),
            "child_rollout_ids": list(rollout.get("child_rollout_ids") or []),
            "rollout_policy": rollout.get("policy"), "evaluation": bool(rollout.get("evaluation")),
            "status": rollout["status"], "failure_reason": rollout.get("failure_reason"), "artifacts": artifacts,
            "steps": [{"step_id": s.step_id, "index": s.index, "node": c["node"], "target": s.target,
                       "policy": s.policy, "policy_exact": s.policy_exact, "latency_s": s.latency_s,
                       "finish_reason": s.finish_reason, "trainable": s.trainable} for s, c in zip(mine, calls)],
            "policy_revisions": [dict(revisions[k]) for k in sorted(named) if k in revisions],
            "score": None if score is None else {"verifier": score["verifier"],
                                                 "verifier_version": score["verifier_version"],
                                                 "status": score.get("status"),
                                                 "members": sorted(score.get("rewards", {}))},
        }}
        model = next((s.target for s in mine), None)
        agent: dict[str, Any] = {"config": {"model": model}, "name": member, "trainable": bool(trainable)}
        ka = kept_agents.get(member)
        if isinstance(ka, Mapping) and ka.get("config") is not None and \
                (kept.get("format", FORMAT_040) != FORMAT_040) == dev:  # verbatim only into the form it came in
            agent = {**ka, "trainable": bool(trainable)}
        elif isinstance(ka, Mapping) and ka.get("name"):
            agent["name"] = ka["name"]
        dropped = None
        drop = kept_drops.get(member)
        if isinstance(drop, Mapping):  # a trace the import found dropped
            dropped = str(drop.get("reason") or "dropped")
            if dev:
                agent["trainable"] = bool(drop.get("trainable", agent["trainable"]))
                rewards = dict(drop.get("rewards") or {})
            else:  # 0.4.0 has no `dropped` and ignores unknown keys: only a non-trainable seat is safe from training
                agent["trainable"], rewards = False, {}
        elif dev and (dropped := _dropped_reason(rollout, member, trainable, mine, score)) is not None:
            info[INFO_KEY]["dropped_derived"] = dropped  # ours to re-derive: an import keeps the steps as they were
        trace = {
            "version": TRACE_VERSION,
            "id": f"{rollout['rollout_id']}.{member}",
            "verifiers": {"version": verifiers_version or fmt, "commit": None},
            "task": task,
            "agent": agent,
            "nodes": nodes, "calls": calls,
            "rewards": rewards,
            "metrics": {k: float(v) for k, v in ((score or {}).get("metrics") or {}).items()},
            "info": info,
            "is_completed": True, "ok": ok,
            "stop_condition": artifacts.get("stop_reason") if isinstance(artifacts.get("stop_reason"), str) else None,
            "errors": errors,
            "timing": {"start": nodes[0]["timestamp"] if nodes else epoch_seconds(rollout.get("created_at"))},
        }
        if dev and dropped is not None:
            trace["dropped"] = dropped
        traces.append(trace)
    run = {"type": "train", "id": rollout["run_id"], "work": work}
    return {"id": rollout["rollout_id"], "env": {"id": rollout["environment"], "name": rollout["episode_type"]},
            "task": task, "group": {"id": rollout["group_id"]}, "run": run, "ok": ok, "errors": errors,
            "traces": traces}


def _rows(con, sql: str) -> list[dict[str, Any]]:
    # timestamps as epoch seconds (DuckDB hands TIMESTAMPTZ to Python through pytz, not installed here)
    sql = sql.replace("SELECT * FROM", "SELECT * REPLACE (epoch(created_at) AS created_at, epoch(_ts) AS _ts) FROM", 1)
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def _loads(x: Any) -> Any:
    return json.loads(x) if isinstance(x, str) else x


def _policy(row: Mapping[str, Any], prefix: str = "policy") -> dict[str, Any] | None:
    if row.get(f"{prefix}_family") is None:
        return None
    return {"family": row[f"{prefix}_family"], "revision": int(row[f"{prefix}_revision"]),
            "checkpoint_digest": row.get(f"{prefix}_checkpoint_digest")}


def export_episodes(db: str, *, include_failed: bool = True, fmt: str = FORMAT_040) -> Iterator[dict[str, Any]]:
    """Episode records of the run replayed into ``db`` (one per rollout, in log order), in form ``fmt``."""
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        last = "QUALIFY row_number() OVER (PARTITION BY {k} ORDER BY _ts DESC, _offset DESC) = 1"
        revisions = {(r["family"], int(r["revision"])): {
            "family": r["family"], "revision": int(r["revision"]), "checkpoint_uri": r["checkpoint_uri"],
            "checkpoint_digest": r["checkpoint_digest"], "parent_revision": r["parent_revision"]}
            for r in _rows(con, f"SELECT * FROM policy_revisions {last.format(k='family, revision')}")}
        scores = {r["rollout_id"]: r for r in _rows(con, f"SELECT * FROM scores {last.format(k='rollout_id')}")}
        steps_by: dict[str, list[StepRow]] = {}
        for r in _rows(con, f"SELECT * FROM steps {last.format(k='step_id')} ORDER BY rollout_id, step_index"):
            steps_by.setdefault(r["rollout_id"], []).append(StepRow(
                step_id=r["step_id"], index=int(r["step_index"]), member_id=r["member_id"], target=r["target"],
                trainable=bool(r["trainable"]), policy=_policy(r), policy_exact=bool(r["policy_exact"]),
                prompt=_loads(r["prompt"]), completion=_loads(r["completion"]),
                prompt_token_ids=list(r["prompt_token_ids"] or []),
                completion_token_ids=list(r["completion_token_ids"] or []),
                completion_logprobs=list(r["completion_logprobs"] or []), finish_reason=r["finish_reason"],
                latency_s=float(r["latency_s"] or 0.0), created_at=epoch_seconds(r["created_at"])))
        rollouts = _rows(con, f"SELECT * FROM rollouts {last.format(k='rollout_id')} ORDER BY _ts, _partition, _offset")
    finally:
        con.close()
    for r in rollouts:
        if not include_failed and r["status"] != "completed":
            continue
        rollout = {**r, "seed": _loads(r["seed"]), "members": _loads(r["members"]), "artifacts": _loads(r["artifacts"]),
                   "policy": _policy(r), "created_at": r["created_at"]}
        score = scores.get(r["rollout_id"])
        if score is not None:
            score = {**score, "rewards": dict(score["rewards"] or {}), "metrics": dict(score["metrics"] or {})}
        by_id = {s.step_id: s for s in steps_by.get(r["rollout_id"], [])}
        steps = [by_id[i] for i in r["step_ids"] if i in by_id]  # call order, as the Rollout lists them
        yield episode_record(rollout, steps, score, revisions, fmt=fmt)


def write_traces(db: str, out: str | Path, *, validate: bool | None = None, include_failed: bool = True,
                 fmt: str = FORMAT_040) -> int:
    """Write the replayed run as verifiers ``traces.jsonl`` (``out`` a file, or a directory to hold one).

    ``fmt``: FORMAT_040 (default: what verifiers 0.4.0 reads) or FORMAT_DEV (the development builds' record).
    ``validate``: check every line with verifiers' own models (``None``: when the installed verifiers reads
    ``fmt``; ``True`` fails with ImportError when it does not). Returns the number of episodes written."""
    fmt = TRACE_FORMATS.get(fmt, fmt)
    if fmt not in (FORMAT_040, FORMAT_DEV):
        raise ValueError(f"unknown trace format {fmt!r}; choose from {', '.join(TRACE_FORMATS)}")
    path = Path(out)
    if path.suffix != ".jsonl":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "traces.jsonl"
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    check = _validator(required=validate is True, fmt=fmt) if validate is not False else None
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for ep in export_episodes(db, include_failed=include_failed, fmt=fmt):
            if check is not None:
                check(ep)
            f.write(json.dumps(ep, separators=(",", ":")) + "\n")
            n += 1
    return n


def _validator(required: bool, fmt: str = FORMAT_040):
    """verifiers' own reading of a traces.jsonl line (``utils.trace_store.read_episodes``), or None: the installed
    verifiers must be of the form's kind (0.4.0 rejects the development builds' agent configs; a development build
    is checked for the development form)."""
    try:
        from verifiers.v1 import Trace, WireEpisode
        from verifiers.v1.task import WireTaskData
    except ImportError:
        if required:
            raise
        return None
    installed = FORMAT_DEV if "dropped" in Trace.model_fields else FORMAT_040
    if installed != fmt:
        if required:
            need = "0.4.0" if fmt == FORMAT_040 else "of a development build (0.4.1.dev*)"
            raise ImportError(f"checking the {fmt} form needs verifiers {need}; the installed one writes the "
                              f"{installed} form")
        return None

    def check(ep: dict[str, Any]) -> None:
        WireEpisode.model_validate({**ep, "traces": []})
        for t in ep["traces"]:
            Trace[WireTaskData].model_validate(t)

    return check


# ---------------------------------------------------------------------------------------------- import
