"""Trace interchange with verifiers 0.4 (replay/traces.py), checked with verifiers' own models.

* a run on the broker -> replay -> `rollout export --format traces` -> verifiers' Trace/WireEpisode accept every
  line -> `rollout import-traces` -> replay of the imported run: the same steps (messages, token ids, logprobs,
  members, revisions), rollouts and rewards, and a clean audit;
* a traces.jsonl written by verifiers itself (its own Trace/Episode classes and its own `write_episode`) is
  imported as a run: steps from the sampled nodes, rewards as `Trace.reward`, the policy span as the revision;
* the message graph: calls that extend the previous call's history hang under it (one branch), a rewritten
  history starts a new branch; verifiers' own `Trace.branches` reproduces each call's tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pytest

import verifiers.v1 as vf  # noqa: E402  (the `test` extra pins verifiers==0.4.0)

from replay.audit import run_audit  # noqa: E402
from replay.ingest import Replayer
from replay.runs import default_topics  # noqa: E402
from replay.synthetic import generate_run, produce  # noqa: E402
from replay.trace_export import StepRow, episode_record, member_trace_graph
from replay.trace_import import _sampled_calls, episode_events, import_file
from replay.traces import FORMAT_040, FORMAT_DEV, UnsupportedTraceVersion, span_revision, trace_format
from rollout.cli import main  # noqa: E402
from test_replay import log  # noqa: E402, F401 - fixture

STEP_COLS = ("step_id, rollout_id, step_index, member_id, target, trainable, policy_family, policy_revision, "
             "policy_checkpoint_digest, policy_exact, prompt, completion, tool_calls, prompt_token_ids, "
             "completion_token_ids, completion_logprobs, finish_reason, latency_s")
ROLLOUT_COLS = ("rollout_id, episode_type, environment, example_id, seed, step_ids, members, trainable_members, "
                "artifacts, parent_rollout_id, child_rollout_ids, group_id, root_group_id, group_size, policy_family, "
                "policy_revision, status, evaluation")
SCORE_COLS = "rollout_id, group_id, rewards, metrics, verifier, verifier_version, trainable_step_ids, evaluation"


def rows(db: str, table: str, cols: str) -> list[tuple]:
    con = duckdb.connect(db, read_only=True)
    try:
        return sorted(con.execute(f"SELECT {cols} FROM {table}").fetchall(), key=repr)
    finally:
        con.close()


def validate_line(line: str):
    """What verifiers' own reader (utils.trace_store.read_episodes) does with a traces.jsonl line."""
    from verifiers.v1.task import WireTaskData

    row = json.loads(line)
    episode = vf.WireEpisode.model_validate({**row, "traces": []})
    traces = [vf.Trace[WireTaskData].model_validate(t) for t in row["traces"]]
    return episode, traces


@pytest.mark.integration
@pytest.mark.parametrize("trace_format", ["0.4.0", "dev"])
async def test_run_to_traces_to_run_round_trip(log, tmp_path, capsys, trace_format):  # noqa: F811
    run_id = f"orig{uuid.uuid4().hex[:8]}"
    run = generate_run(run_id, rounds=2, groups=3, group_size=2, eval_questions=2)
    await produce(run.transactions, log.client_kwargs(), default_topics(), transactional_id=f"t-{run_id}")
    db1, db2 = str(tmp_path / "orig.duckdb"), str(tmp_path / "imported.duckdb")
    await Replayer(db1, log, run_id=run_id).run()

    out = tmp_path / "traces.jsonl"
    # the development form is checked here by the pinned 0.4.0 too (it ignores `dropped` and `weight_versions`)
    assert main(["export", "--db", db1, "--format", "traces", "--out", str(out), "--trace-format", trace_format,
                 "--validate", "yes" if trace_format == "0.4.0" else "auto"]) == 0
    lines = out.read_text().splitlines()
    if trace_format == "dev":  # every exact learner step says which weights sampled it
        nodes = [n for line in lines for t in json.loads(line)["traces"] for n in t["nodes"] if n["sampled"]]
        labelled = [n for n in nodes if "weight_versions" in n]
        assert labelled and all(len(n["weight_versions"]) == 1 and n["weight_versions"][0]["start"] == 0
                                and n["weight_versions"][0]["end"] == sum(n["mask"]) for n in labelled)
    n_rollouts = len(rows(db1, "rollouts", "rollout_id"))
    assert len(lines) == n_rollouts > 10
    seats = 0
    for line in lines:
        episode, traces = validate_line(line)
        assert all(t.version == vf.TRACE_VERSION == 1 for t in traces)
        for t in traces:
            seats += 1
            assert t.num_turns == len(t.info["rollout_log"]["steps"]) == len(t.calls)
            assert t.agent.name in ("solver", "pro", "con", "proposer")
            assert t.agent.trainable == (t.agent.name != "con")
            if t.rewards:
                assert t.reward == t.rewards["reward"].score
        if episode.id.startswith("rollout") and any(t.agent.name == "pro" for t in traces):
            assert {t.agent.name for t in traces} == {"pro", "con"}  # the debate: one trace per seat
    assert seats > n_rollouts

    # the token view verifiers trains on equals ours, call by call
    con = duckdb.connect(db1, read_only=True)
    by_step = {r[0]: r[1:] for r in con.execute(
        "SELECT step_id, prompt_token_ids, completion_token_ids, completion_logprobs FROM steps").fetchall()}
    con.close()
    _, traces = validate_line(lines[0])
    for t in traces:
        for branch, rec in zip(t.branches, t.info["rollout_log"]["steps"]):
            pt, ct, lp = by_step[rec["step_id"]]
            assert branch.token_ids == list(pt) + list(ct)
            assert branch.sampled_mask == [False] * len(pt) + [True] * len(ct)
            assert np.allclose(branch.logprobs[len(pt):], lp, atol=0)

    new_run = f"imp{uuid.uuid4().hex[:8]}"
    assert await asyncio.to_thread(main, ["import-traces", str(out), "--run-id", new_run]) == 0
    assert f"imported run {new_run}" in capsys.readouterr().out
    await Replayer(db2, log, run_id=new_run).run()

    for table, cols in (("steps", STEP_COLS), ("rollouts", ROLLOUT_COLS), ("scores", SCORE_COLS)):
        a, b = rows(db1, table, cols), rows(db2, table, cols)
        assert len(a) == len(b) > 0, table
        assert a == b, (table, next((x, y) for x, y in zip(a, b) if x != y))
    assert rows(db1, "score_rewards", "rollout_id, member_id, reward") == \
        rows(db2, "score_rewards", "rollout_id, member_id, reward")
    named = "family, revision, checkpoint_digest, checkpoint_uri"  # the revisions the steps name, as published
    assert rows(db2, "policy_revisions", named) == rows(
        db1, "policy_revisions WHERE (family, revision) IN (SELECT (policy_family, policy_revision) FROM steps)", named)
    report = run_audit(db2)
    assert report.ok, report.summary()
    assert report.checked["trainable_steps"] > 0


def _verifiers_written_traces(path):
    """A traces.jsonl written by verifiers itself: a two-call tool conversation and a judged seat."""
    from verifiers.v1.utils.trace_store import write_episode

    def node(parent, message, *, sampled=False, tokens=(), mask=(), lps=()):
        return vf.MessageNode(parent=parent, message=message, sampled=sampled, token_ids=list(tokens),
                              mask=list(mask), logprobs=list(lps))

    task = vf.TraceTask(type="Task", data=vf.TaskData(id="q-7", prompt="What is 19+23?"), key="q-7")
    nodes = [
        node(None, vf.SystemMessage(content="Use tools."), tokens=[1, 2]),
        node(0, vf.UserMessage(content="What is 19+23?"), tokens=[3, 4, 5]),
        node(1, vf.AssistantMessage(content=None, tool_calls=[vf.ToolCall(id="c1", name="add", arguments='{"a":19,"b":23}')]),
             sampled=True, tokens=[6, 70, 71, 72], mask=[False, True, True, True], lps=[-0.5, -0.25, -0.125]),
        node(2, vf.ToolMessage(tool_call_id="c1", content="42", name="add"), tokens=[8, 9]),
        node(3, vf.AssistantMessage(content="The sum is 42."), sampled=True, tokens=[6, 80, 81],
             mask=[False, True, True], lps=[-1.0, -0.75]),
    ]
    calls = [vf.ModelCall(node=2, model="Qwen/Qwen3-0.6B", finish_reason="tool_calls",
                          usage=vf.Usage(prompt_tokens=6, completion_tokens=3), time=vf.TimeSpan(start=10.0, end=10.5)),
             vf.ModelCall(node=4, model="Qwen/Qwen3-0.6B", finish_reason="stop",
                          usage=vf.Usage(prompt_tokens=12, completion_tokens=2), time=vf.TimeSpan(start=11.0, end=11.25))]
    solver = vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig(model="Qwen/Qwen3-0.6B"), name="solver"),
                      nodes=nodes, calls=calls, is_completed=True, ok=True, stop_condition="agent_completed")
    solver.record_reward("correct", 1.0)
    solver.record_reward("format", 0.5, weight=0.2)
    solver.record_metric("num_tool_calls", 1)
    judge_nodes = [node(None, vf.UserMessage(content="Is 42 right?"), tokens=[3]),
                   node(0, vf.AssistantMessage(content="yes"), sampled=True, tokens=[90], mask=[True], lps=[-0.1])]
    judge = vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig(model="judge-model"), name="judge",
                                                   trainable=False),
                     nodes=judge_nodes, calls=[vf.ModelCall(node=1, model="judge-model", finish_reason="stop",
                                                            time=vf.TimeSpan(start=12.0, end=12.1))],
                     is_completed=True, ok=True)
    run = vf.TrainRunInfo(id="prime-run", work=vf.TrainWorkInfo(step=3, policy=vf.PolicySpan(start=3, end=3)))
    episode = vf.Episode(env=vf.EnvInfo(id="math-tools", name="math-tools"), task=task,
                         group=vf.GroupInfo(id="g-1"), run=run, ok=True, traces=[solver, judge])
    write_episode(path, episode)
    return solver


@pytest.mark.integration
async def test_import_of_a_traces_file_written_by_verifiers(log, tmp_path):  # noqa: F811
    solver = _verifiers_written_traces(tmp_path)
    imp = import_file(tmp_path / "traces.jsonl", f"pr{uuid.uuid4().hex[:8]}")
    assert not imp.skipped and imp.rollouts == 1
    from replay.trace_import import produce_imported

    await produce_imported(imp, log)
    db = str(tmp_path / "pr.duckdb")
    await Replayer(db, log, run_id=imp.run_id).run()
    con = duckdb.connect(db, read_only=True)
    steps = con.execute("SELECT step_index, member_id, trainable, policy_family, policy_revision, policy_exact, "
                        "prompt_token_ids, completion_token_ids, completion_logprobs, finish_reason, tool_calls, "
                        "prompt, completion FROM steps ORDER BY step_index").fetchall()
    (members, env, example, group) = con.execute(
        "SELECT members, environment, example_id, group_id FROM rollouts").fetchone()
    rewards = dict(con.execute("SELECT member_id, reward FROM score_rewards").fetchall())
    (metrics,) = con.execute("SELECT metrics FROM scores").fetchone()
    con.close()
    assert [s[:6] for s in steps] == [(0, "solver", True, "Qwen/Qwen3-0.6B", 3, True),
                                      (1, "solver", True, "Qwen/Qwen3-0.6B", 3, True),
                                      (2, "judge", False, None, None, True)]
    # prompt = every token on the path plus the generation scaffold; completion = the sampled span
    assert (steps[0][6], steps[0][7]) == ([1, 2, 3, 4, 5, 6], [70, 71, 72])
    assert (steps[1][6], steps[1][7]) == ([1, 2, 3, 4, 5, 6, 70, 71, 72, 8, 9, 6], [80, 81])
    assert steps[1][6] + steps[1][7] == solver.branches[-1].token_ids
    assert steps[0][8] == pytest.approx([-0.5, -0.25, -0.125]) and steps[1][8] == pytest.approx([-1.0, -0.75])
    assert steps[0][9] == "tool_calls" and json.loads(steps[0][10])[0]["name"] == "add"
    assert [m["role"] for m in json.loads(steps[1][11])] == ["system", "user", "assistant", "tool"]
    assert json.loads(steps[1][12])[0]["content"] == "The sum is 42."
    assert json.loads(members) == {"solver": True, "judge": False}
    assert (env, example, group) == ("math-tools@imported", "q-7", "g-1")
    assert rewards == {"solver": pytest.approx(solver.reward)} and solver.reward == pytest.approx(1.1)
    assert dict(metrics)["num_tool_calls"] == 1.0 and dict(metrics)["solver/reward/format"] == 0.5
    report = run_audit(db)
    assert report.ok, report.summary()  # Qwen/Qwen3-0.6B@r3 is published by the import (no checkpoint digest)


def _row(i, prompt, completion, pt, ct, member="p"):
    return StepRow(step_id=f"s{i}", index=i, member_id=member, target="learner", trainable=True,
                   policy={"family": "f", "revision": 0, "checkpoint_digest": None}, policy_exact=True,
                   prompt=prompt, completion=[completion], prompt_token_ids=pt, completion_token_ids=ct,
                   completion_logprobs=[-0.5] * len(ct), finish_reason="stop", latency_s=0.1, created_at=100.0 + i)


def test_message_graph_branches_like_verifiers():
    u1, a1 = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    u2, a2 = {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}
    steps = [_row(0, [u1], a1, [1, 2], [3]),
             _row(1, [u1, a1, u2], a2, [1, 2, 3, 4, 5], [6]),     # extends call 0: same branch
             _row(2, [{"role": "user", "content": "summary"}], a2, [9], [7, 8])]  # rewritten history: new branch
    nodes, calls = member_trace_graph(steps)
    assert [n["parent"] for n in nodes] == [None, 0, 1, 2, None, 4]
    assert nodes[3]["token_ids"] == [4, 5, 6] and nodes[3]["mask"] == [False, False, True]
    rollout = {"run_id": "r", "rollout_id": "x", "episode_type": "e", "environment": "e@1", "example_id": "0",
               "seed": {"prompt": "hi"}, "members": {"p": True}, "group_id": "g", "root_group_id": "g",
               "group_size": 1, "status": "completed", "policy": None, "artifacts": {}}
    ep = episode_record(rollout, steps, {"rewards": {"p": 1.0}, "metrics": {}, "verifier": "v",
                                         "verifier_version": "1"}, {})
    (trace,) = validate_line(json.dumps(ep))[1]
    assert trace.num_branches == 2 and trace.num_turns == 3
    assert [b.token_ids for b in trace.branches] == [[1, 2, 3, 4, 5, 6], [9, 7, 8]]
    back = _sampled_calls(ep["traces"][0])
    for s, c in zip(steps, back):
        assert (c["prompt_token_ids"], c["completion_token_ids"]) == (s.prompt_token_ids, s.completion_token_ids)
        assert [m["content"] for m in c["prompt"]] == [m["content"] for m in s.prompt]


# ------------------------------------------------------------------------------------------------------------------
# verifiers after 0.4.0: the development builds (0.4.1.dev*) write Trace.version 1 still, with `Trace.dropped`,
# per-token `MessageNode.weight_versions` and new AgentConfig fields. The fixtures are written by verifiers' own
# models and `write_episode` (tests/fixtures/make_verifiers_traces.py), one file per build, the same two episodes.

FIXTURES = Path(__file__).parent / "fixtures"
DEV_FIXTURE = FIXTURES / "verifiers-0.4.1.dev86-traces.jsonl"
V040_FIXTURE = FIXTURES / "verifiers-0.4.0-traces.jsonl"


def fixture_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_kind(events) -> tuple[list, object, object]:
    steps = [e for k, e in events if k == "steps"]
    (rollout,) = [e for k, e in events if k == "rollouts"]
    scores = [e for k, e in events if k == "scores"]
    return steps, rollout, (scores[0] if scores else None)


def export_inputs(events) -> tuple[dict, list[StepRow], dict | None]:
    """What `export_episodes` reads back from a replayed run, built from the events directly (no Kafka)."""
    steps, rollout, score = by_kind(events)
    rd = rollout.model_dump(mode="json")
    rows = [StepRow(step_id=s.step_id, index=s.index, member_id=s.member_id, target=s.target, trainable=s.trainable,
                    policy=s.policy.model_dump(mode="json") if s.policy else None, policy_exact=s.policy_exact,
                    prompt=[m.model_dump(mode="json") for m in s.prompt],
                    completion=[m.model_dump(mode="json") for m in s.completion],
                    prompt_token_ids=s.prompt_token_ids.tolist(), completion_token_ids=s.completion_token_ids.tolist(),
                    completion_logprobs=s.completion_logprobs.tolist(), finish_reason=s.finish_reason,
                    latency_s=s.latency_s, created_at=s.created_at.timestamp()) for s in steps]
    sd = None if score is None else {**score.model_dump(mode="json"),
                                     "trainable_step_ids": [t.step_id for t in score.trainable_steps]}
    return rd, rows, sd


def content(events) -> list:
    """The events' fields that a round trip must keep (ids, clocks and causation links are new per import)."""
    skip = {"event_id", "created_at", "causation_id", "producer", "run_id"}
    out = []
    for kind, e in events:
        d = e.model_dump(mode="json", exclude=skip)
        if kind == "scores":
            d["trainable_steps"] = [t["step_id"] for t in d["trainable_steps"]]
        out.append((kind, d))
    return out


def import_lines(tmp_path, lines: list[dict], name="t.jsonl", run_id="imp"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return import_file(p, run_id)


def test_the_development_build_fixture_is_its_shape_and_0_4_0_cannot_read_it():
    dev, old = fixture_lines(DEV_FIXTURE), fixture_lines(V040_FIXTURE)
    for ep in dev:
        for t in ep["traces"]:
            assert t["version"] == 1 and t["verifiers"]["version"] == "0.4.1.dev86"  # TRACE_VERSION not bumped
            assert trace_format(t) == FORMAT_DEV
    solver = dev[0]["traces"][0]
    assert {"max_turn_tokens", "scoring", "deployment"} <= set(solver["agent"]["config"])
    assert [n.get("weight_versions") for n in solver["nodes"]] == [
        None, None, [{"version": "3", "start": 0, "end": 3}], None,
        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]]
    assert dev[1]["traces"][0]["dropped"] == "rubric: no reward signal" and "dropped" not in solver  # None: left out
    for ep in old:
        for t in ep["traces"]:
            assert trace_format(t) == FORMAT_040 and "dropped" not in t
        validate_line(json.dumps(ep))  # the pinned 0.4.0 reads its own file
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        validate_line(json.dumps(dev[0]))  # ... and refuses the development builds' agent configs


def test_import_of_both_verifiers_versions(tmp_path):
    old = import_file(V040_FIXTURE, "old")
    new = import_file(DEV_FIXTURE, "new")
    assert not old.skipped and not new.skipped and old.rollouts == new.rollouts == 2
    for imp, path in ((old, V040_FIXTURE), (new, DEV_FIXTURE)):
        for ep, line in zip(imp.episodes, fixture_lines(path)):
            steps, rollout, _ = by_kind(ep)
            sampled = [(t, n) for t in line["traces"] for n in t["nodes"] if n["sampled"]]
            assert len(steps) == len(sampled)
            for s, (t, n) in zip(sorted(steps, key=lambda s: s.index), sampled):
                # token ids and logprobs exactly as the node arrays hold them (int32 / float32 both sides)
                assert s.completion_token_ids.tolist() == [x for x, m in zip(n["token_ids"], n["mask"]) if m]
                assert s.completion_logprobs.dtype == np.float32
                assert s.completion_logprobs.tolist() == np.asarray(n["logprobs"], dtype=np.float32).tolist()
            vf_kept = rollout.artifacts["verifiers"]
            assert vf_kept["format"] == (FORMAT_DEV if imp is new else "0.4.0")
            assert vf_kept["agents"] == {t["agent"]["name"]: t["agent"] for t in line["traces"]}  # kept whole
    # 0.4.0: every learner step is attributed to the episode's policy span start, inexact (the span drifts 3..4)
    old_steps = [s for ep in old.episodes for s in by_kind(ep)[0]]
    assert {(s.member_id, s.policy.revision if s.policy else None, s.policy_exact) for s in old_steps} == {
        ("solver", 3, False), ("judge", None, True)}
    # the development build: the engine's labels name the revisions
    a_steps, a_rollout, a_score = by_kind(new.episodes[0])
    assert [(s.member_id, s.trainable, s.policy and s.policy.revision, s.policy_exact) for s in a_steps] == [
        ("solver", True, 3, True), ("solver", True, 3, False), ("judge", False, None, True)]
    assert a_rollout.artifacts["verifiers"]["agents"]["solver"]["config"]["max_turn_tokens"] == 256
    assert a_score.rewards == {"solver": pytest.approx(1.1)} and len(a_score.trainable_steps) == 2


def test_weight_versions_map_to_revisions(tmp_path):
    assert span_revision([["7", 0, 4]], 4) == (7, True)
    assert span_revision([["7", 0, 2], ["8", 2, 4]], 4) == (7, False)  # a swap mid-completion: the oldest, inexact
    assert span_revision([["7", 0, 3]], 4) == (7, False)  # a token without a label
    assert span_revision([["step-7", 0, 4]], 4) == (None, False)  # not a number: no revision from it
    assert span_revision([], 4) == (None, False) and span_revision(None, 4) == (None, False)

    (ep_a, _) = fixture_lines(DEV_FIXTURE)
    steps, rollout, _ = by_kind(import_lines(tmp_path, [ep_a]).episodes[0])
    first, second = steps[0], steps[1]
    assert (first.policy.family, first.policy.revision, first.policy_exact) == ("Qwen/Qwen3-0.6B", 3, True)
    assert (second.policy.revision, second.policy_exact) == (3, False)
    # what the Step cannot say is kept exactly, per step; the exact one-label step needs nothing kept
    assert rollout.artifacts["verifiers"]["weight_versions"] == {second.step_id: [["3", 0, 1], ["4", 1, 2]]}

    # labels that are no revision number: the episode's policy span, inexact, the labels kept
    odd = json.loads(json.dumps(ep_a))
    odd["traces"][0]["nodes"][2]["weight_versions"] = [{"version": "ckpt-a", "start": 0, "end": 3}]
    odd["run"]["work"]["policy"] = {"start": 5, "end": 5}
    steps, rollout, _ = by_kind(import_lines(tmp_path, [odd]).episodes[0])
    assert (steps[0].policy.revision, steps[0].policy_exact) == (5, False)
    assert rollout.artifacts["verifiers"]["weight_versions"][steps[0].step_id] == [["ckpt-a", 0, 3]]

    # with labels absent the pre-0.4.1 rule holds: a span without drift is exact
    plain = json.loads(json.dumps(odd))
    for n in plain["traces"][0]["nodes"]:
        n.pop("weight_versions", None)
    steps, _, _ = by_kind(import_lines(tmp_path, [plain]).episodes[0])
    assert [(s.policy.revision, s.policy_exact) for s in steps if s.trainable] == [(5, True), (5, True)]


def test_a_dropped_trace_yields_no_training_record(tmp_path):
    from consumers.credit import STRATEGIES, CreditAssigner, records_for

    imp = import_file(DEV_FIXTURE, "drop")
    steps, rollout, score = by_kind(imp.episodes[1])  # ep-b: its only trace is dropped
    (step,) = steps
    assert not step.trainable and (step.policy.revision, step.policy_exact) == (4, True)  # still says who made it
    assert rollout.members == {"solver": False} and rollout.policy.revision == 4
    assert rollout.artifacts["verifiers"]["dropped"] == {
        "solver": {"reason": "rubric: no reward signal", "trainable": True, "rewards": {}}}
    assert score is not None and score.rewards == {} and score.trainable_steps == []  # out of means and batches
    assert records_for(score, {"solver": 1.0}, "per_step", producer="t") == []
    trained = {}
    for name in STRATEGIES:
        credit = CreditAssigner(name)
        trained[name] = {r.rollout_id for ep in imp.episodes for r in credit.add(by_kind(ep)[2], 0.0)}
    assert all("ep-b" not in ids for ids in trained.values()) and trained["per_step"] == {"ep-a"}

    # a dropped trace with rewards and trainable steps on record: still nothing of it is trained on
    ep_a = fixture_lines(DEV_FIXTURE)[0]
    ep_a["traces"][0]["dropped"] = "judge: reward hacking"
    steps, rollout, score = by_kind(import_lines(tmp_path, [ep_a]).episodes[0])
    assert [s.trainable for s in steps] == [False, False, False] and score.trainable_steps == []
    assert score.rewards == {} and not any(k.startswith("solver/reward") for k in score.metrics)
    kept = rollout.artifacts["verifiers"]["dropped"]["solver"]
    assert kept["reason"] == "judge: reward hacking" and kept["rewards"]["correct"] == {"score": 1.0, "weight": 1.0}
    assert all(CreditAssigner(name).add(score, 0.0) == [] for name in STRATEGIES)

    # the record form with nulls (Trace.to_record keeps None): null means not dropped, unlabelled
    nulls = fixture_lines(DEV_FIXTURE)[0]
    for t in nulls["traces"]:
        t["dropped"] = None
        for n in t["nodes"]:
            n.setdefault("weight_versions", None)
    assert content(import_lines(tmp_path, [nulls]).episodes[0]) == content(import_file(DEV_FIXTURE, "x").episodes[0])


def test_development_build_traces_round_trip(tmp_path):
    imp = import_file(DEV_FIXTURE, "rt")
    lines = fixture_lines(DEV_FIXTURE)
    exported_dev, exported_old = [], []
    for ep, line in zip(imp.episodes, lines):
        rollout, rows, score = export_inputs(ep)
        dev = episode_record(rollout, rows, score, {}, fmt=FORMAT_DEV)
        old = episode_record(rollout, rows, score, {})
        exported_dev.append(dev)
        exported_old.append(old)
        validate_line(json.dumps(old))  # the default form: what the pinned 0.4.0 reads
        for mine, theirs in zip(dev["traces"], line["traces"]):
            assert mine["agent"] == theirs["agent"]  # new agent fields and all, verbatim
            assert mine.get("dropped") == theirs.get("dropped")
            assert [n.get("weight_versions") for n in mine["nodes"] if n["sampled"]] == \
                [n.get("weight_versions") for n in theirs["nodes"] if n["sampled"]]
            f32 = [np.asarray(n["logprobs"], dtype=np.float32).tolist() for n in theirs["nodes"] if n["sampled"]]
            assert [n["logprobs"] for n in mine["nodes"] if n["sampled"]] == f32  # the float32 values, exactly
        for mine in old["traces"]:  # 0.4.0 knows no `dropped`: a dropped seat is written as no learner, unrewarded
            assert "dropped" not in mine and all("weight_versions" not in n for n in mine["nodes"])
            assert set(mine["agent"]["config"]) == {"model"}
    (b_dev,), (b_old,) = exported_dev[1]["traces"], exported_old[1]["traces"]
    assert b_dev["agent"]["trainable"] and b_dev["dropped"] == "rubric: no reward signal"
    assert not b_old["agent"]["trainable"] and b_old["rewards"] == {}
    # either form imports back to the same events
    for form, exported in (("dev", exported_dev), ("0.4.0", exported_old)):
        back = import_lines(tmp_path, exported, f"{form}.jsonl", "rt")
        assert not back.skipped, back.skipped
        for a, b in zip(imp.episodes, back.episodes):
            assert content(a) == content(b), form


def test_a_failed_rollouts_learner_is_written_dropped_and_imports_as_it_was(tmp_path):
    u, a = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    steps = [_row(0, [u], a, [1, 2], [3])]
    rollout = {"run_id": "r", "rollout_id": "x", "episode_type": "e", "environment": "e@1", "example_id": "0",
               "seed": {"prompt": "hi"}, "members": {"p": True}, "group_id": "g", "root_group_id": "g",
               "group_size": 1, "status": "failed", "failure_reason": "env crashed", "policy": None, "artifacts": {}}
    score = {"rewards": {"p": 0.0}, "metrics": {}, "verifier": "v", "verifier_version": "1", "status": "failed",
             "trainable_step_ids": []}
    (old,) = episode_record(rollout, steps, score, {})["traces"]
    (dev,) = episode_record(rollout, steps, score, {}, fmt=FORMAT_DEV)["traces"]
    assert "dropped" not in old and old["agent"]["trainable"] and not old["ok"]
    assert dev["dropped"] == "not trained on: rollout failed (env crashed)" and dev["agent"]["trainable"]
    assert dev["nodes"][-1]["weight_versions"] == [{"version": "0", "start": 0, "end": 1}]
    back_steps, back_rollout, back_score = by_kind(episode_events(
        episode_record(rollout, steps, score, {}, fmt=FORMAT_DEV), "r2"))
    assert back_steps[0].trainable and back_rollout.members == {"p": True}  # as recorded
    assert "verifiers" not in back_rollout.artifacts
    assert back_score.rewards == {"p": 0.0} and back_score.trainable_steps == []  # a failed rollout trains nothing


def test_token_arrays_of_the_msgpack_wire(tmp_path):
    ep = fixture_lines(DEV_FIXTURE)[0]
    ref = content(import_lines(tmp_path, [ep]).episodes[0])

    def nd(values, dtype):
        arr = np.asarray(values, dtype=dtype)
        return {"__nd__": True, "dtype": str(arr.dtype), "shape": list(arr.shape), "data": arr.tobytes()}

    wire = json.loads(json.dumps(ep))
    for t in wire["traces"]:
        for n in t["nodes"]:
            n["token_ids"], n["mask"] = nd(n["token_ids"], np.int32), nd(n["mask"], np.bool_)
            n["logprobs"] = nd(n["logprobs"], np.float32)
    assert content(episode_events(wire, "imp")) == ref  # the same steps, exactly
    wire["traces"][0]["nodes"][2]["token_ids"]["data"] = "AQID"  # base64 text is no __nd__ array: refused, not guessed
    with pytest.raises(ValueError, match="raw-bytes array"):
        episode_events(wire, "imp")


def test_an_unknown_trace_version_is_one_clear_error(tmp_path, capsys):
    lines = fixture_lines(DEV_FIXTURE)
    lines[1]["traces"][0]["version"] = 2
    path = tmp_path / "future.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UnsupportedTraceVersion, match=r"line 2: .*version 2 .*reads verifiers trace version 1 only"):
        import_file(path, "future")
    capsys.readouterr()
    assert main(["import-traces", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "version 2" in err[0] and "line 2" in err[0]
    lines[1]["traces"][0]["version"] = 1
    lines[0]["traces"][1]["version"] = "1"  # not a version number either
    with pytest.raises(UnsupportedTraceVersion):
        import_lines(tmp_path, lines)


@pytest.mark.integration
async def test_development_build_traces_through_the_log(log, tmp_path, capsys):  # noqa: F811
    """dev traces -> import -> log -> replay -> `export --trace-format dev` -> the same traces -> import -> the
    same run; the dropped trace has no training data on the replayed log."""
    from replay.trace_import import produce_imported

    imp = import_file(DEV_FIXTURE, f"dev{uuid.uuid4().hex[:8]}")
    await produce_imported(imp, log)
    db1, db2 = str(tmp_path / "dev1.duckdb"), str(tmp_path / "dev2.duckdb")
    await Replayer(db1, log, run_id=imp.run_id).run()
    con = duckdb.connect(db1, read_only=True)
    scored = dict(con.execute("SELECT rollout_id, trainable_step_ids FROM scores").fetchall())
    con.close()
    assert scored == {"ep-a": ["ep-a.solver.2", "ep-a.solver.4"], "ep-b": []}

    out = tmp_path / "dev.jsonl"
    assert main(["export", "--db", db1, "--format", "traces", "--trace-format", "dev", "--out", str(out)]) == 0
    exported = fixture_lines(out)
    for mine, theirs in zip(exported, fixture_lines(DEV_FIXTURE)):
        by_name = {t["agent"]["name"]: t for t in mine["traces"]}  # the replayed members come back name-sorted
        assert len(by_name) == len(theirs["traces"])
        for b in theirs["traces"]:
            a = by_name[b["agent"]["name"]]
            assert (a["agent"], a.get("dropped")) == (b["agent"], b.get("dropped"))
            assert [n.get("weight_versions") for n in a["nodes"] if n["sampled"]] == \
                [n.get("weight_versions") for n in b["nodes"] if n["sampled"]]
    assert main(["export", "--db", db1, "--format", "traces", "--trace-format", "dev", "--out", str(out),
                 "--validate", "yes"]) == 2  # the pinned 0.4.0 cannot check the development form: said, not skipped

    new_run = f"dev{uuid.uuid4().hex[:8]}"
    assert await asyncio.to_thread(main, ["import-traces", str(tmp_path / "dev.jsonl"), "--run-id", new_run]) == 0
    await Replayer(db2, log, run_id=new_run).run()
    for table, cols in (("steps", STEP_COLS), ("rollouts", ROLLOUT_COLS), ("scores", SCORE_COLS)):
        assert rows(db1, table, cols) == rows(db2, table, cols), table
    for db in (db1, db2):
        report = run_audit(db)
        assert report.ok, report.summary()
