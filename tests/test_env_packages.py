"""The verifiers.v1 test env packages of tests/envs/ (rlt-tally-duel, rlt-sum-quiz, rlt-pose-solve, rlt-sum-chain), installed
into .venv by .ci/setup, found and loaded the way a recipe names them: by id, through verifiers' own loader
(`resolve_env_config` + `load_environment`). No Kafka, no model: loading, typing and task streams only, plus
the sum-quiz reward scored by verifiers' `Task.score` on a hand-made trace."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import re
from pathlib import Path

import pytest

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import (
    environment_class,
    load_environment,
    resolve_env_config,
    taskset_class,
)

ENVS_DIR = Path(__file__).resolve().parent / "envs"
MODULES = {"rlt-tally-duel": "rlt_tally_duel", "rlt-sum-quiz": "rlt_sum_quiz", "rlt-pose-solve": "rlt_pose_solve",
           "rlt-sum-chain": "rlt_sum_chain"}
SEAT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    missing = [m for m in MODULES.values() if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"env packages not installed in this venv: {missing}; run .ci/setup (it installs tests/envs/rlt-*)")


def module(env_id: str):
    return importlib.import_module(MODULES[env_id])


def load(raw: dict):
    cfg = resolve_env_config(raw)
    return cfg, load_environment(cfg)


def first(env, n: int) -> list:
    return list(itertools.islice(env.taskset, n))


# -- found by id: the package's own classes ------------------------------------------------------------------

@pytest.mark.parametrize("env_id", sorted(MODULES))
def test_installed_as_a_distribution_not_from_the_checkout(env_id):
    mod = module(env_id)
    assert not Path(mod.__file__).resolve().is_relative_to(ENVS_DIR), mod.__file__
    assert importlib.metadata.version(env_id) == "0.1.0"


@pytest.mark.parametrize("env_id, env_cls, config_cls, taskset_cls, taskset_config_cls, seats", [
    ("rlt-tally-duel", "TallyDuelEnv", "TallyDuelEnvConfig", "TallyDuelTaskset", "TallyDuelTasksetConfig",
     ["player0", "player1"]),
    ("rlt-sum-quiz", None, None, "SumQuizTaskset", "SumQuizTasksetConfig", ["agent"]),
    ("rlt-pose-solve", "PoseSolveEnv", "PoseSolveEnvConfig", "PoseSolveTaskset", "PoseSolveTasksetConfig",
     ["proposer", "solver"]),
    ("rlt-sum-chain", "SumChainEnv", None, "SumChainTaskset", "SumChainConfig", ["agent"]),
])
def test_id_resolves_to_the_package_classes(env_id, env_cls, config_cls, taskset_cls, taskset_config_cls, seats):
    mod = module(env_id)
    raw = {"taskset": {"id": env_id}} | {seat: SEAT for seat in seats}
    cfg, env = load(raw)
    want_env = getattr(mod, env_cls) if env_cls else vf.SingleAgentEnv
    want_cfg = getattr(mod, config_cls) if config_cls else vf.SingleAgentEnvConfig  # a SingleAgentEnv's own
    assert environment_class(env_id) is want_env
    assert taskset_class(env_id) is getattr(mod, taskset_cls)
    assert type(cfg) is want_cfg
    assert type(cfg.taskset) is getattr(mod, taskset_config_cls)
    assert type(env) is want_env
    assert type(env.taskset) is getattr(mod, taskset_cls)
    assert list(cfg.agent_harnesses()) == seats
    for seat in seats:
        assert getattr(cfg, seat).harness.id == "null"
        assert getattr(cfg, seat).runtime.type == "subprocess"


@pytest.mark.parametrize("env_id, seats", [("rlt-tally-duel", ["player0", "player1"]),
                                           ("rlt-pose-solve", ["proposer", "solver"])])
def test_seats_default_to_the_null_harness_in_a_subprocess(env_id, seats):
    cfg = resolve_env_config({"taskset": {"id": env_id}})  # no seat tables: the package's declared defaults
    harnesses = cfg.agent_harnesses()
    assert list(harnesses) == seats
    assert {name: h.id for name, h in harnesses.items()} == {seat: "null" for seat in seats}
    assert all(getattr(cfg, seat).runtime.type == "subprocess" for seat in seats)


def test_a_seat_override_merges_onto_the_declared_default():
    cfg = resolve_env_config({"taskset": {"id": "rlt-pose-solve"}, "solver": {"max_turns": 1}})
    assert cfg.solver.max_turns == 1
    assert cfg.solver.harness.id == "null" and cfg.solver.runtime.type == "subprocess"
    assert cfg.proposer.max_turns is None


# -- rlt-tally-duel: endless, seeded ---------------------------------------------------------------------------

def duel_stream(seed: int | None, n: int = 20) -> list[tuple]:
    taskset = {"id": "rlt-tally-duel"} | ({} if seed is None else {"seed": seed})
    cfg, env = load({"taskset": taskset, "player0": SEAT, "player1": SEAT})
    assert env.taskset.INFINITE is True and env.taskset.bounded is False
    return [(t.data.idx, t.data.id, t.key, t.data.prompt, t.data.target) for t in first(env, n)]


def test_tally_duel_is_endless_and_lazy():
    cfg, env = load({"taskset": {"id": "rlt-tally-duel", "seed": 7}})
    assert type(env.taskset).INFINITE is True
    # far past any finite list, read lazily
    (task,) = list(itertools.islice(env.taskset, 5000, 5001))
    assert task.data.idx == 5000 and task.data.id == "duel-7-5000"
    assert len(list(env.taskset.take(5))) == 5
    with pytest.raises(ValueError, match="infinite"):
        env.taskset.shuffle(0)


def test_tally_duel_same_seed_same_tasks_other_seed_other_tasks():
    a, b = duel_stream(3), duel_stream(3)
    assert a == b
    assert [row[0] for row in a] == list(range(20))
    ids = [row[1] for row in a]
    assert ids == [f"duel-3-{i}" for i in range(20)]
    assert [row[2] for row in a] == ids  # Task.key is the durable id
    assert all(1 <= row[4] <= 20 for row in a)
    assert all(re.search(r"between \d+ and \d+", row[3]) for row in a)
    other = duel_stream(4)
    assert [row[1] for row in other] == [f"duel-4-{i}" for i in range(20)]
    assert [(row[3], row[4]) for row in other] != [(row[3], row[4]) for row in a]
    assert duel_stream(None) == duel_stream(0)  # seed defaults to 0


def test_tally_duel_seed_is_typed():
    cfg = resolve_env_config({"taskset": {"id": "rlt-tally-duel", "seed": "11"}})
    assert cfg.taskset.seed == 11
    with pytest.raises(Exception, match="seed"):
        resolve_env_config({"taskset": {"id": "rlt-tally-duel", "seed": "eleven"}})


# -- rlt-sum-quiz: the dataset ships in the package -------------------------------------------------------------

def quiz(split: str | None = None, **taskset) -> list:
    args = {"id": "rlt-sum-quiz"} | ({} if split is None else {"split": split}) | taskset
    cfg, env = load({"taskset": args, "agent": SEAT})
    assert env.taskset.INFINITE is False and env.taskset.bounded is True
    return list(env.taskset)


def test_sum_quiz_split_is_typed_on_the_taskset_config():
    cfg = resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "split": "test"}})
    assert type(cfg.taskset).__name__ == "SumQuizTasksetConfig"
    assert cfg.taskset.split == "test" and cfg.taskset.reward_bug is False
    assert resolve_env_config({"taskset": {"id": "rlt-sum-quiz"}}).taskset.split == "train"
    with pytest.raises(Exception, match="splitt"):
        resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "splitt": "test"}})  # extra keys are refused


def test_sum_quiz_train_and_test_sizes_rows_and_disjointness():
    train, test = quiz("train"), quiz("test")
    assert len(train) == 300 and len(test) == 48
    assert len(quiz()) == 300  # default split: train
    for tasks in (train, test):
        keys = [t.key for t in tasks]
        assert len(set(keys)) == len(keys)
        assert [t.data.idx for t in tasks] == list(range(len(tasks)))
        for t in tasks:
            d = t.data
            assert 1 <= d.a <= 99 and 1 <= d.b <= 99 and d.answer == d.a + d.b
            assert d.prompt == f"What is {d.a} + {d.b}? Answer with a number."
            assert t.key == d.id
    assert not {(t.data.a, t.data.b) for t in train} & {(t.data.a, t.data.b) for t in test}
    assert not {t.key for t in train} & {t.key for t in test}
    digits = {(len(str(t.data.a)), len(str(t.data.b))) for t in train + test}
    assert {(1, 1), (2, 2)} <= digits  # 1- and 2-digit additions


def test_sum_quiz_unknown_split_raises_naming_the_file():
    cfg = resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "split": "xyz"}})
    with pytest.raises(FileNotFoundError, match=re.escape("data/xyz.jsonl")) as e:
        load_environment(cfg)
    assert "train" in str(e.value) and "test" in str(e.value)


def quiz_trace(task, reply: str):
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), root_reply=reply)


@pytest.mark.parametrize("reply, want", [
    ("{answer}", 1.0), ("The sum is {answer}.", 1.0), ("{a} + {b} = {answer}", 1.0),
    ("{answer} or maybe {wrong}", 0.0), ("", 0.0), ("no idea", 0.0), ("\x00\ufffd" + "9" * 5000, 0.0),
])
async def test_sum_quiz_exact_answer_reward(reply, want):
    task = quiz("test")[0]
    d = task.data
    trace = quiz_trace(task, reply.format(answer=d.answer, a=d.a, b=d.b, wrong=d.answer + 1))
    await task.score(trace)
    assert trace.rewards["exact_answer"].score == want


async def test_sum_quiz_reward_bug_makes_the_reward_function_raise():
    cfg = resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "split": "test", "reward_bug": True}})
    assert cfg.taskset.reward_bug is True and cfg.taskset.task.reward_bug is True
    # the flag survives the config's wire form (an env server rebuilds tasks from `taskset.task`)
    assert resolve_env_config(cfg.model_dump(mode="json")).taskset.task.reward_bug is True
    task = list(load_environment(cfg).taskset)[0]
    trace = quiz_trace(task, str(task.data.answer))
    with pytest.raises(vf.TaskError, match="reward_bug"):
        await task.score(trace)


# -- rlt-pose-solve ----------------------------------------------------------------------------------------------

def test_pose_solve_config_and_finite_taskset():
    cfg, env = load({"taskset": {"id": "rlt-pose-solve"}, "proposer": SEAT, "solver": SEAT})
    assert cfg.num_solvers == 2
    assert resolve_env_config({"taskset": {"id": "rlt-pose-solve"}, "num_solvers": 3}).num_solvers == 3
    with pytest.raises(Exception, match="num_solvers"):
        resolve_env_config({"taskset": {"id": "rlt-pose-solve"}, "num_solvers": 0})
    assert env.taskset.INFINITE is False
    tasks = list(env.taskset)
    assert len(tasks) == 20
    keys = [t.key for t in tasks]
    assert len(set(keys)) == 20 and keys == [t.data.id for t in tasks]
    assert all("a + b" in t.data.prompt for t in tasks)
    assert [t.key for t in load({"taskset": {"id": "rlt-pose-solve"}})[1].taskset] == keys


def test_an_endless_taskset_that_does_not_say_so_is_drawn_lazily_not_read_for_ever(monkeypatch, caplog):
    """rlt-tally-duel's endless taskset with its ``INFINITE`` declaration taken away (as a package that forgot it
    ships): it was read whole, spinning with memory growing until killed. Past ``EAGER_TASKS`` it is drawn lazily,
    with one warning naming ``INFINITE``."""
    from producers.environments import verifiers_v1
    from producers.environments.dataset import TaskStream

    cfg, env = load({"taskset": {"id": "rlt-tally-duel", "seed": 3}, "player0": SEAT, "player1": SEAT})
    monkeypatch.setattr(type(env.taskset), "INFINITE", False)
    assert env.taskset.bounded  # what verifiers reports for it now
    monkeypatch.setattr(verifiers_v1, "EAGER_TASKS", 50)
    wrapped = verifiers_v1.verifiers_v1_environment(env, name="rlt-tally-duel", version="0")
    assert isinstance(wrapped.dataset, TaskStream)
    assert "does not declare itself endless (Taskset.INFINITE) but has more than 50 tasks" in caplog.text
    finite = verifiers_v1.verifiers_v1_environment(env, name="rlt-tally-duel", version="0", num_tasks=20)
    assert isinstance(finite.dataset, list) and len(finite.dataset) == 20  # a bounded view: read whole, as before


async def test_sum_quiz_reward_faults_raise_and_hang_on_their_fraction_of_calls():
    """The chaos benchmark's faults: at rate 1 every reward call raises, or never returns; the rates reach the
    tasks through the config's wire form, as reward_bug does."""
    import asyncio

    for key in ("reward_error_rate", "reward_hang_rate"):
        cfg = resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "split": "test", key: 1.0}})
        assert getattr(resolve_env_config(cfg.model_dump(mode="json")).taskset.task, key) == 1.0
        task = list(load_environment(cfg).taskset)[0]
        trace = quiz_trace(task, str(task.data.answer))
        if key == "reward_error_rate":
            with pytest.raises(vf.TaskError, match="reward_error_rate"):
                await task.score(trace)
        else:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(task.score(trace), 0.5)
    clean = list(load_environment(resolve_env_config({"taskset": {"id": "rlt-sum-quiz", "split": "test"}})).taskset)[0]
    trace = quiz_trace(clean, str(clean.data.answer))
    await clean.score(trace)
    assert trace.rewards["exact_answer"].score == 1.0


def test_sum_chain_tasks_are_seeded_turns_with_their_running_totals():
    taskset = load({"taskset": {"id": "rlt-sum-chain", "seed": 3, "min_turns": 2, "max_turns": 3}})[1].taskset
    tasks = list(itertools.islice(iter(taskset), 20))
    again = list(itertools.islice(iter(load({"taskset": {"id": "rlt-sum-chain", "seed": 3}})[1].taskset), 20))
    assert [t.data.id for t in tasks] == [f"chain-3-{i}" for i in range(20)]
    for t in tasks:
        d = t.data
        assert 2 <= len(d.user_turns) == len(d.totals) <= 3 and d.prompt is None
        start, add = map(int, re.findall(r"\d+", d.user_turns[0]))
        adds = [int(re.findall(r"\d+", u)[0]) for u in d.user_turns[1:]]
        assert d.totals == list(itertools.accumulate([start + add, *adds]))
    assert [t.data.totals for t in again] == [t.data.totals for t in tasks]  # the same seed: the same stream
