"""verifiers environments found by id, as users ship them: the packages under tests/envs (pip-installed into the
venv by .ci/setup, never registered in-process) run from their prime-rl recipes, unchanged, through
`rollout arena RECIPE` on the broker; bad input stops with one line and no traceback; a raising reward function
dead-letters its rollout with the reason; an endless taskset is drawn with bounded memory."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from schemas import codec
from schemas.plan_compiler import compile_plan
from streams import topics
from streams.local_broker import free_port
from tests.test_eos_pipeline import prefix, read_all  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "tests" / "envs" / "recipes"

pytest.importorskip("verifiers.v1")


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout.cli", *args], cwd=ROOT, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def _recipe(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


QUIZ = """
[model]
name = "HuggingFaceTB/SmolLM2-135M-Instruct"

[orchestrator]
batch_size = 4
group_size = 2

[[orchestrator.train.source]]
name = "quiz"

[orchestrator.train.source.env.taskset]
id = "{taskset}"
{args}

[orchestrator.train.source.env.agent.harness]
id = "{harness}"

[orchestrator.train.source.env.agent.runtime]
type = "{runtime}"
{extra}
"""


def quiz(taskset: str = "rlt-sum-quiz", args: str = "", harness: str = "null", runtime: str = "subprocess",
         extra: str = "") -> str:
    return QUIZ.format(taskset=taskset, args=args, harness=harness, runtime=runtime, extra=extra)


# -- every package's recipe, unchanged, through `rollout arena` on the broker --------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("name, groups, members", [
    ("rlt-sum-quiz", 2, {"policy"}),                 # single-turn, its dataset shipped inside the package
    ("rlt-tally-duel", 6, {"player0", "player1"}),   # an endless seeded two-seat game, seats on harness "null"
    ("rlt-pose-solve", 2, {"proposer", "solver"}),   # a proposer whose reward depends on solver runs
])
async def test_recipe_runs_through_the_arena(kafka_settings, prefix, name, groups, members):  # noqa: F811
    plan = compile_plan(RECIPES / f"{name}.toml")
    assert plan.refused == [] and plan.environments[0].env_table["taskset"]["id"] == name
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    out = await asyncio.to_thread(_cli, "arena", str(RECIPES / f"{name}.toml"), "--groups", str(groups),
                                  "--policy", "local", "--policy-port", str(free_port()), "--no-progress",
                                  "--run-id", f"byid-{name}", env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    n = groups * plan.group_size
    assert stats["rollouts"] == n and stats["failed"] == 0, stats
    kw = kafka_settings.client_kwargs()
    rollouts = [codec.decode(r.value) for r in await read_all(kw, topics.ROLLOUTS.name, idle_s=2, timeout_s=30)]
    top = [r for r in rollouts if r.parent_rollout_id is None]
    assert len(top) == n and all(r.status == "completed" for r in rollouts)
    for r in top:
        assert r.environment == f"{name}@0.1.0"  # the installed package's version
        assert r.seed["info"]["task_key"] == r.example_id  # the task's key (these tasks keep their ids)
        assert r.artifacts["verifiers"]["env_id"] == name
        assert set(r.artifacts["verifiers"]["rewards_by_member"]) == members
        assert all(v is not None for v in r.artifacts["verifiers"]["rewards_by_member"].values())
    steps = [codec.decode(s.value) for s in await read_all(kw, topics.STEPS.name, idle_s=2, timeout_s=30)]
    assert {s.member_id for s in steps} == members and all(s.trainable and len(s.completion_token_ids) for s in steps)
    assert sum(len(r.step_ids) for r in rollouts) == len(steps)
    if name == "rlt-tally-duel":  # drawn lazily, each task once: no repeats in an endless stream
        assert len({r.example_id for r in top}) == n
    if name == "rlt-pose-solve":  # the proposer calls once, each of its num_solvers solver runs once
        assert all(r.artifacts["verifiers"]["model_calls"] == {"proposer": 1, "solver": 2} for r in top)


# -- bad input: one line, no traceback, nothing started ----------------------------------------------------

@pytest.mark.parametrize("text, says", [
    (quiz(taskset="rlt-no-such-env"),
     ["no installed package provides the verifiers taskset id 'rlt-no-such-env'", "pip install rlt-no-such-env"]),
    (quiz(taskset="someone/rlt-hub-env@1.2"),
     ["'someone/rlt-hub-env@1.2'", "prime env install someone/rlt-hub-env@1.2"]),
    (quiz(harness="codex", runtime="prime"), ["seat 'agent' uses harness 'codex'", "runtime 'prime'"]),
    (quiz(harness="bash"), ["seat 'agent' uses harness 'bash'", "uv is not installed"]),
    (quiz(args='split = "nope"'), ["taskset 'rlt-sum-quiz' failed while loading",
                                   "no dataset split 'nope' (data/nope.jsonl)"]),
    (quiz(extra="[trainer.optim]\ntype = \"muon\"\n"), ["trainer.optim.type: optimizer 'muon'"]),
    (quiz(extra="[orchestrator.train.sampler]\ntype = \"difficulty_pool\"\n"), ["task sampler 'difficulty_pool'"]),
])
def test_bad_input_is_one_line(tmp_path, text, says):
    if "harness 'bash'" in says[0] and __import__("shutil").which("uv"):
        pytest.skip("uv is installed here, so the bash harness can run")
    # no broker is named: the failure must come before anything touches one
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_BOOTSTRAP_SERVERS"}
    out = _cli("arena", str(_recipe(tmp_path, "bad", text)), "--groups", "1", env=env, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("rollout arena: error: ")
    for s in says:
        assert s in lines[0], lines[0]


def test_endless_eval_source_needs_a_bound(tmp_path):
    text = quiz() + """
[[orchestrator.eval.source]]
name = "duel-eval"

[orchestrator.eval.source.env.taskset]
id = "rlt-tally-duel"
"""
    out = _cli("arena", str(_recipe(tmp_path, "eval", text)), "--evaluate", timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "evaluation source 'duel-eval': its taskset never ends" in out.stderr


# -- a reward function that raises: the rollout is kept, the verifier dead-letters it with the reason ----------

@pytest.mark.integration
async def test_raising_reward_is_dead_lettered_with_its_reason(kafka_settings, prefix, tmp_path):  # noqa: F811
    from consumers import settings as service_settings
    from consumers.runner import System
    from schemas.events import DeadLetter

    path = _recipe(tmp_path, "bug", quiz(args="reward_bug = true"))
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    out = await asyncio.to_thread(_cli, "arena", str(path), "--groups", "1", "--policy", "local", "--policy-port",
                                  str(free_port()), "--no-progress", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["failed"] == 0  # the episode ran: nothing is lost
    kw = kafka_settings.client_kwargs()
    cfg = service_settings.build(plan=compile_plan(path), credit=True, checkpoint_dir=str(tmp_path))
    async with System(["verifier"], cfg, kw):
        letters = await read_all(kw, topics.DEAD_LETTERS.name, until=lambda v: len(v) >= 2, timeout_s=60)
    letters = [codec.decode(r.value) for r in letters]
    assert len(letters) == 2 and all(isinstance(d, DeadLetter) and d.service == "verifier" for d in letters)
    for d in letters:
        assert "reward raised for member 'policy'" in d.error_message, d.error_message
        assert "reward_bug is set" in d.error_message


# -- an endless taskset: lazily drawn, reproducible, bounded memory ------------------------------------------

def _duel_environment():
    from producers.environment import environment_from_spec

    return environment_from_spec(compile_plan(RECIPES / "rlt-tally-duel.toml").environments[0])


def test_endless_taskset_draws_are_seeded_and_memory_is_bounded():
    from producers.environment import TaskStream

    one, two, other = _duel_environment(), _duel_environment(), _duel_environment()
    assert isinstance(one.store, TaskStream)
    r1, r2, r3 = random.Random(3), random.Random(3), random.Random(4)
    a = [one.store.sample(r1).id for _ in range(300)]
    assert a == [two.store.sample(r2).id for _ in range(300)]  # the same seed draws the same tasks
    assert a != [other.store.sample(r3).id for _ in range(300)]  # another seed, another order
    assert len(set(a)) == 300  # each task drawn once

    env = _duel_environment()
    rng = random.Random(0)
    for _ in range(500):  # warm: the buffer and the stream's generator state exist
        env.store.sample(rng)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(10_000):
        env.store.sample(rng)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(env.store) <= env.store.buffer  # never more than the buffer held
    assert grown < 2 * 1024 * 1024, f"memory grew {grown} bytes over 10,000 draws"
