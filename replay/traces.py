"""Trace interchange with verifiers 0.4 (``verifiers.v1``, ``TRACE_VERSION = 1``), its development builds, and prime-rl.

verifiers and prime-rl persist a run as ``traces.jsonl``: one **episode** per line
(``verifiers.v1.Episode``: ``id``, ``env``, ``task``, ``group``, ``run``, ``ok``, ``errors``, ``traces``),
each trace one agent's run of it (``Trace``: ``version``, ``task``, ``agent`` with ``name`` and
``trainable``, a message graph ``nodes`` + ``calls``, ``rewards``, ``metrics``, ``info``, ...). This
module holds what both ways share (messages, versions, weight spans; the export is ``replay.trace_export``, the
import ``replay.trace_import``), with no import of verifiers (the tests validate what it writes with verifiers'
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

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import numpy as np

from schemas.events import ChatMessage, ToolCall

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


def message_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def from_v1_message(m: Mapping[str, Any]) -> ChatMessage:
    role = m.get("role")
    if role == "assistant":
        calls = [ToolCall(id=c.get("id") or f"call_{i}", name=(f"{c['namespace']}.{c['name']}" if c.get("namespace")
                                                               else c["name"]), arguments=c.get("arguments") or "")
                 for i, c in enumerate(m.get("tool_calls") or [])]
        return ChatMessage(role="assistant", content=message_text(m.get("content")), tool_calls=calls)
    if role == "tool":
        return ChatMessage(role="tool", content=message_text(m.get("content")), tool_call_id=m.get("tool_call_id"),
                           name=m.get("name"))
    if role not in ("system", "user"):
        raise ValueError(f"message role {role!r} is not one of system/user/assistant/tool")
    return ChatMessage(role=role, content=message_text(m.get("content")))


def finish_reason_of(reason: str | None) -> str | None:
    return reason if reason in FINISH_REASONS else ("stop" if reason else None)


def epoch_seconds(ts: Any) -> float:
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


def node_stream(node: Mapping[str, Any], key: str, where: str) -> list:
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


def node_weight_spans(node: Mapping[str, Any], where: str) -> list[list[Any]] | None:
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
