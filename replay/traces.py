"""Trace interchange with verifiers 0.4 (``verifiers.v1``, ``TRACE_VERSION = 1``), its development builds, and prime-rl.

verifiers and prime-rl persist a run as ``traces.jsonl``: one **episode** per line
(``verifiers.v1.Episode``: ``id``, ``env``, ``task``, ``group``, ``run``, ``ok``, ``errors``, ``traces``),
each trace one agent's run of it (``Trace``: ``version``, ``task``, ``agent`` with ``name`` and
``trainable``, a message graph ``nodes`` + ``calls``, ``rewards``, ``metrics``, ``info``, ...). This
module maps both ways, with no import of verifiers (the tests validate what it writes with verifiers'
own ``Trace``/``WireEpisode`` models):

* **export** (``rollout export --format traces``): every rollout of a replayed run becomes one
  episode; every member (seat) of the rollout one trace (``agent.name`` = member id, ``agent.trainable``
  as on the Rollout). A member's Steps become the message graph the way verifiers builds it: when a
  Step's prompt (messages and token ids) extends the previous call's prompt + completion, its new
  messages hang under the previous assistant node; otherwise (a rewritten history) they start a new
  root, i.e. a new branch. Per-message token spans are not on our log, so input-message nodes carry no
  tokens and each assistant node carries the prompt tokens new since its parent (``mask`` False)
  followed by the sampled completion (``mask`` True, ``logprobs`` at full precision): concatenating
  ``token_ids`` along a branch gives exactly ``prompt_token_ids + completion_token_ids`` of the call.
  The member's reward is ``rewards["reward"]`` (weight 1), the verifier's metrics are ``metrics``; what
  has no verifiers field (ids, group, policy revision per call, target, latency, the verifier) is under
  ``info["rollout_log"]``, with the policy revisions the steps name (checkpoint uri and digest).
* **import** (``rollout import-traces FILE``): each episode line (or a bare trace line) becomes one
  Rollout (members = the traces' agent names), one Step per sampled assistant node (prompt = the
  messages and tokens on the path to it, completion = the node's sampled span and logprobs), and one
  RolloutScored (a member's reward = ``Trace.reward``, the weighted sum of its rewards; named reward
  components and metrics go to ``metrics``), produced onto the log as a new run, so it can be
  replayed, queried and audited. ``FILE`` may also be a prime-rl run's trace stream (its output dir,
  ``monitors/file/traces`` or its ``stream/``: chunks read in order, annotations folded on; ``replay.trace_stream``);
  a trace's folded ``info`` is kept under ``artifacts["verifiers"]["info"]`` and its ``info.advantage`` (prime-rl's
  credit) goes to the score's ``metrics``. Steps name a policy revision: the one recorded by our export, else
  the trace's training policy span (``run.work.policy.start``, ``policy_exact`` only when the span has
  no drift), else revision 0 of the agent's model; the import publishes each named revision
  (``PolicyRevision``, no checkpoint digest unless the export recorded one).

**The development builds after 0.4.0** (checked against ``verifiers==0.4.1.dev86``) still write ``Trace.version``
1 (``TRACE_VERSION`` was not bumped) and the same JSON record (``write_episode``: ``dump_json(exclude_none=True)``),
with additions this module reads and, with ``fmt=FORMAT_DEV`` (``rollout export --trace-format dev``), writes:

* node token streams are numpy arrays in memory (``IntStream``/``BoolStream``/``FloatStream``: int32, bool, float32)
  but JSON lists on disk; only the msgpack wire carries them as raw-bytes ``{"__nd__": true, "dtype", "shape",
  "data"}`` dicts. Import takes either (a ``__nd__`` dict only with real bytes) and maps them to the Step's token ids
  and logprobs exactly (float32 both sides);
* ``MessageNode.weight_versions``: ``[{"version": str, "start": int, "end": int}]`` or absent, the engine's weight
  label for completion tokens ``[start, end)`` of a sampled node. A step whose tokens all carry one numeric label
  names that revision, ``policy_exact`` true; a step spanning several labels (a weight swap mid-completion) is
  not split (a Step is one model call; its messages and logprobs belong to that call): it names the oldest
  revision, the one an off-policy bound must count from, with ``policy_exact`` false, and the spans are kept
  exactly under ``Rollout.artifacts["verifiers"]["weight_versions"][step_id]`` (as are partial or non-numeric
  labels), so an export writes them back;
* ``Trace.dropped``: ``str | None``, why consumers leave the trace out of reward means and training batches
  (independent of ``ok``). A dropped trace's member gets no reward in the RolloutScored, no trainable steps (its
  Steps keep the revision that produced them but are ``trainable`` false), ``members[m]`` false, and the reason,
  its original ``agent.trainable`` and its named rewards under ``artifacts["verifiers"]["dropped"][m]``; so credit
  assignment (``consumers.credit``, which trains only ``RolloutScored.trainable_steps``) makes no training record
  of it. The development form writes ``dropped`` for such a member, and for a learner seat of a rollout whose
  score listed none of its steps (a failed rollout): we did not train on it. The 0.4.0 form has no such field
  (0.4.0 ignores unknown keys, so it would train on it), so there a dropped seat is written ``trainable`` false
  with no rewards;
* new ``AgentConfig`` fields (``max_turn_tokens: int | None``, ``scoring: ScoringConfig`` as its set fields,
  ``deployment: DeploymentConfig``): our Rollout has no place for an agent config, so every imported
  ``agent`` record is kept whole under ``artifacts["verifiers"]["agents"][member]`` and written back verbatim in
  the form it came in. verifiers 0.4.0 forbids unknown agent-config keys (and the development builds always write
  ``scoring`` and ``deployment``), so it cannot read a development-build trace: the 0.4.0 form stays the default.

A ``Trace.version`` other than 1 is refused with one error for the whole file (``UnsupportedTraceVersion``).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from schemas.envelope import Event
from schemas.events import ChatMessage, Rollout, RolloutScored, Step, StepTokens, ToolCall
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision
from schemas.scoring import SCORING_ARTIFACT, ScoringSpec

TRACE_VERSION = 1  # verifiers.v1.trace.TRACE_VERSION this module reads and writes
TRACE_VERSIONS = (1,)  # every Trace.version import reads (0.4.0 and the 0.4.1 development builds both write 1)
FORMAT_040 = "0.4.0"  # the record verifiers 0.4.0 reads (the default export)
FORMAT_DEV = "0.4.1.dev86"  # the development builds' record, as of the build this module was checked against
TRACE_FORMATS = {"0.4.0": FORMAT_040, "dev": FORMAT_DEV}  # ``rollout export --trace-format`` choices
DEV_AGENT_CONFIG_FIELDS = ("max_turn_tokens", "scoring", "deployment")  # AgentConfig fields added after 0.4.0
VF_KEY = "verifiers"  # Rollout.artifacts[VF_KEY]: what an import keeps that our events have no field for


class UnsupportedTraceVersion(ValueError):
    """A trace of a schema version this module does not read: the whole import is refused."""
INFO_KEY = "rollout_log"
IMPORT_PRODUCER = "rollout-import"
FINISH_REASONS = ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------------------------------- messages

def to_v1_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """Our ChatMessage (as a dict) -> a verifiers v1 message record."""
    role = m["role"]
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
        calls = m.get("tool_calls") or []
        if calls:
            out["tool_calls"] = [{"id": c["id"], "type": "function", "name": c["name"], "arguments": c["arguments"]}
                                 for c in calls]
        return out
    if role == "tool":
        out = {"role": "tool", "tool_call_id": m.get("tool_call_id") or "", "content": m.get("content") or ""}
        if m.get("name"):
            out["name"] = m["name"]
        return out
    return {"role": role, "content": m.get("content") or ""}


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def from_v1_message(m: Mapping[str, Any]) -> ChatMessage:
    role = m.get("role")
    if role == "assistant":
        calls = [ToolCall(id=c.get("id") or f"call_{i}", name=(f"{c['namespace']}.{c['name']}" if c.get("namespace")
                                                               else c["name"]), arguments=c.get("arguments") or "")
                 for i, c in enumerate(m.get("tool_calls") or [])]
        return ChatMessage(role="assistant", content=_text(m.get("content")), tool_calls=calls)
    if role == "tool":
        return ChatMessage(role="tool", content=_text(m.get("content")), tool_call_id=m.get("tool_call_id"),
                           name=m.get("name"))
    if role not in ("system", "user"):
        raise ValueError(f"message role {role!r} is not one of system/user/assistant/tool")
    return ChatMessage(role=role, content=_text(m.get("content")))


def _finish(reason: str | None) -> str | None:
    return reason if reason in FINISH_REASONS else ("stop" if reason else None)


def _epoch(ts: Any) -> float:
    if isinstance(ts, datetime):
        return ts.timestamp()
    return float(ts or 0.0)


# ---------------------------------------------------------------------------------------------- versions and shapes

def check_trace_version(trace: Mapping[str, Any], where: str = "trace") -> None:
    """Refuse a trace of a schema this module does not read (``version`` absent reads as verifiers' default, 1)."""
    v = trace.get("version", TRACE_VERSION)
    if isinstance(v, bool) or v not in TRACE_VERSIONS:
        raise UnsupportedTraceVersion(
            f"{where}: trace {trace.get('id')!r} has version {v!r} (written by verifiers "
            f"{(trace.get('verifiers') or {}).get('version', '?')}); this importer reads verifiers trace version "
            f"{', '.join(map(str, TRACE_VERSIONS))} only (verifiers 0.4.0 and its 0.4.1 development builds)")


def trace_format(trace: Mapping[str, Any]) -> str:
    """FORMAT_DEV when the trace holds a field only the development builds write, else FORMAT_040.

    Both write ``version`` 1, so the shape decides: ``dropped`` (even null), a node's ``weight_versions``, an
    agent-config field added after 0.4.0, or a ``verifiers.version`` past 0.4.0."""
    if "dropped" in trace or any("weight_versions" in n for n in trace.get("nodes") or []):
        return FORMAT_DEV
    if set(((trace.get("agent") or {}).get("config") or {})) & set(DEV_AGENT_CONFIG_FIELDS):
        return FORMAT_DEV
    release = re.match(r"(\d+)\.(\d+)\.(\d+)", str((trace.get("verifiers") or {}).get("version") or ""))
    return FORMAT_DEV if release and tuple(map(int, release.groups())) > (0, 4, 0) else FORMAT_040


def _stream(node: Mapping[str, Any], key: str, where: str) -> list:
    """A node's per-token stream as a list: a JSON list (the record on disk), a numpy array, or the msgpack
    wire's raw-bytes ``__nd__`` dict. Anything else is refused, never guessed at."""
    v = node.get(key)
    if v is None:
        return []
    if isinstance(v, list):
        return v
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Mapping) and v.get("__nd__"):
        data = v.get("data")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"{where}: {key} is a raw-bytes array (__nd__) without bytes ({type(data).__name__}): "
                             "only the msgpack wire carries those; a JSON record holds a list")
        return np.frombuffer(data, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).tolist()
    raise ValueError(f"{where}: {key} must be a list of per-token values, got {type(v).__name__}")


def _weight_spans(node: Mapping[str, Any], where: str) -> list[list[Any]] | None:
    """``MessageNode.weight_versions`` as ``[[version, start, end], ...]``; None when the engine labelled none."""
    raw = node.get("weight_versions")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"{where}: weight_versions must be a list of spans, got {type(raw).__name__}")
    out = []
    for sp in raw:
        if not isinstance(sp, Mapping) or not {"version", "start", "end"} <= set(sp):
            raise ValueError(f"{where}: a weight_versions span must have version, start and end: {sp!r}")
        out.append([str(sp["version"]), int(sp["start"]), int(sp["end"])])
    return out


def span_revision(spans: list[list[Any]] | None, n_completion: int) -> tuple[int | None, bool]:
    """(revision, exact) of a step from its completion's weight spans: the oldest numeric label, exact only when
    one label covers every completion token; (None, False) when a label is not a number or there are no spans."""
    if not spans:
        return None, False
    labels = {v for v, _, _ in spans}
    if not all(v.isdecimal() for v in labels):
        return None, False
    covered = np.zeros(n_completion, dtype=bool)
    for _, start, end in spans:
        covered[max(0, start):max(0, min(end, n_completion))] = True
    return min(int(v) for v in labels), len(labels) == 1 and bool(covered.all())


def canonical_spans(revision: int, n_completion: int) -> list[list[Any]]:
    """The spans an engine reports for a completion sampled wholly by one revision."""
    return [[str(revision), 0, n_completion]] if n_completion else []


# ---------------------------------------------------------------------------------------------- export

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
        calls.append({"node": leaf, "model": s.target, "finish_reason": _finish(s.finish_reason),
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
            "timing": {"start": nodes[0]["timestamp"] if nodes else _epoch(rollout.get("created_at"))},
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
                latency_s=float(r["latency_s"] or 0.0), created_at=_epoch(r["created_at"])))
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
        prefix = [t for k in path for t in _stream(nodes[k], "token_ids", f"trace {trace.get('id')!r} node {k}")]
        tok, mask = _stream(node, "token_ids", where), _stream(node, "mask", where)
        k = next((n for n, m in enumerate(mask) if m), len(tok))
        sampled_lp = _stream(node, "logprobs", where)
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
                    "weight_versions": _weight_spans(node, where)})
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
                     "final_text": _text(last.get("content")) if last else None,
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
    return [StepTokens(step_id=s.step_id, member_id=s.member_id, policy=s.policy,
                       prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                       completion_logprobs=s.completion_logprobs)
            for s in sorted(steps, key=lambda s: s.index)
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
    from replay.ingest import default_topics
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
