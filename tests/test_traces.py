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

import duckdb
import numpy as np
import pytest

import verifiers.v1 as vf  # noqa: E402  (the `test` extra pins verifiers==0.4.0)

from replay.audit import run_audit  # noqa: E402
from replay.ingest import Replayer, default_topics  # noqa: E402
from replay.synthetic import generate_run, produce  # noqa: E402
from replay.traces import StepRow, _sampled_calls, episode_record, import_file, member_trace_graph  # noqa: E402
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
async def test_run_to_traces_to_run_round_trip(log, tmp_path, capsys):  # noqa: F811
    run_id = f"orig{uuid.uuid4().hex[:8]}"
    run = generate_run(run_id, rounds=2, groups=3, group_size=2, eval_questions=2)
    await produce(run.transactions, log.client_kwargs(), default_topics(), transactional_id=f"t-{run_id}")
    db1, db2 = str(tmp_path / "orig.duckdb"), str(tmp_path / "imported.duckdb")
    await Replayer(db1, log, run_id=run_id).run()

    out = tmp_path / "traces.jsonl"
    assert main(["export", "--db", db1, "--format", "traces", "--out", str(out), "--validate", "yes"]) == 0
    lines = out.read_text().splitlines()
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
    from replay.traces import produce_imported

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
