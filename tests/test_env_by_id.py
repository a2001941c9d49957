"""verifiers environments found by id, as users ship them: the packages under tests/envs (pip-installed into the
venv by .ci/setup, never registered in-process) run from their prime-rl recipes, unchanged, through
`rollout arena RECIPE` on the broker; bad input stops with one line and no traceback; a raising reward function
dead-letters its rollout with the reason; an endless taskset is drawn with bounded memory."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
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
                                  "--policy", "local", "--policy-port", "0", "--no-progress",
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
        for r in top:
            v = r.artifacts["verifiers"]
            assert v["model_calls"] == {"proposer": 1, "solver": 2} and len(v["trace_rewards"]["solver"]) == 2
            solve_rate = sum(v["trace_rewards"]["solver"]) / 2  # the solver seat scores its traces' mean
            assert v["rewards_by_member"]["solver"] == pytest.approx(solve_rate)
            assert v["metrics"]["proposer"]["solve_rate"] == pytest.approx(solve_rate)
            goldilocks = 1 - 2 * abs(solve_rate - 0.5) if v["metrics"]["proposer"]["valid_problem"] else 0.0
            assert v["rewards_by_member"]["proposer"] == pytest.approx(goldilocks)


# -- bad input: one line, no traceback, nothing started ----------------------------------------------------

@pytest.mark.parametrize("text, says", [
    (quiz(taskset="rlt-no-such-env"),
     ["no installed package provides the verifiers taskset id 'rlt-no-such-env'", "pip install rlt-no-such-env"]),
    (quiz(taskset="someone/rlt-hub-env@1.2"),
     ["'someone/rlt-hub-env@1.2'", "prime env install someone/rlt-hub-env@1.2"]),
    (quiz(harness="codex", runtime="prime"), ["seat 'agent' uses harness 'codex'", "runtime 'prime'"]),
    (quiz(harness="codex", runtime="docker"), ["seat 'agent' uses harness 'codex' in runtime 'docker' (image "
                                               "'rollout-log/vf-harness:local')", "installs its agent"]),
    (quiz(harness="bash", runtime="docker", extra='allow = ["example.com"]'),
     ["seat 'agent' uses harness 'bash' in runtime 'docker'", "network policy (allow=['example.com']",
      "docker.io/library/alpine"]),
    (quiz(args='split = "nope"'), ["taskset 'rlt-sum-quiz' failed while loading",
                                   "no dataset split 'nope' (data/nope.jsonl)"]),
    (quiz(extra="[trainer.optim]\ntype = \"sgd\"\n"), ["trainer.optim.type: optimizer 'sgd'"]),
    (quiz(extra="[orchestrator.train.sampler]\ntype = \"difficulty_pool\"\n"), ["task sampler 'difficulty_pool'"]),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, text, says):
    # no broker is named: the failure must come before anything touches one
    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    err = _arena_error(capsys, _recipe(tmp_path, "bad", text))
    for s in says:
        assert s in err, err


def test_a_docker_seat_whose_image_is_not_here_is_one_line(tmp_path, monkeypatch, capsys):
    """No registry can be reached: a docker seat's image must be in the local engine, or the start is refused
    naming the seat, the harness, the runtime and the image (and the docker CLI, where there is none)."""
    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    text = quiz(harness="bash", runtime="docker", extra='image = "rlt-no-such-image:0"')
    err = _arena_error(capsys, _recipe(tmp_path, "absent", text))
    assert "seat 'agent' uses harness 'bash' in runtime 'docker' (image 'rlt-no-such-image:0'), which cannot run " \
           "here" in err, err
    if shutil.which("docker") is None:
        assert "the docker CLI is not installed" in err, err
    else:
        assert "the image is not in the local Docker engine and no registry can be reached" in err, err
    # without the docker CLI, verifiers' default image (the local harness image in its place) is refused the same way
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "docker" else which(name, *a, **k))
    err = _arena_error(capsys, _recipe(tmp_path, "no-docker", quiz(harness="bash", runtime="docker")))
    assert "seat 'agent' uses harness 'bash' in runtime 'docker' (image 'rollout-log/vf-harness:local'), which " \
           "cannot run here: the docker CLI is not installed" in err, err


def _arena_error(capsys, recipe: Path, *args: str) -> str:
    """`rollout arena RECIPE` in this process (the CLI's own entry point): exit 1 and exactly one line on stderr."""
    from rollout.cli import main

    capsys.readouterr()
    assert main(["arena", str(recipe), "--groups", "1", *args]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rollout arena: error: ")
    return lines[0]


def test_a_package_that_fails_to_import_says_why(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "site" / "rlt_broken"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import verifiers.rubrics  # an API verifiers 0.4 no longer has\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    err = _arena_error(capsys, _recipe(tmp_path, "broken", quiz(taskset="rlt-broken")))
    assert "is installed (module rlt_broken) but importing it fails: ModuleNotFoundError: No module named " \
           "'verifiers.rubrics'" in err, err


OLD_FORM = """
[model]
name = "tiny-byte-lm"

[orchestrator]
batch_size = 4
group_size = 2

[[orchestrator.train.env]]
id = "rlt-sum-quiz"
harness = { id = "null", runtime = { type = "subprocess" } }
"""


@pytest.mark.integration
async def test_older_env_form_keeps_its_harness(kafka_settings, prefix, tmp_path):  # noqa: F811
    """prime-rl's older [[orchestrator.train.env]] with an env-level harness: the one seat plays it (null runs
    in-process), not verifiers' default harness."""
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    out = await asyncio.to_thread(_cli, "arena", str(_recipe(tmp_path, "old", OLD_FORM)), "--groups", "1",
                                  "--policy", "local", "--policy-port", "0", "--no-progress", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["rollouts"] == 2 and stats["failed"] == 0 and stats["steps"] == 2


@pytest.mark.integration
@pytest.mark.parametrize("runtime", [
    pytest.param("docker", marks=pytest.mark.skipif(shutil.which("docker") is None,
                                                    reason="no docker CLI: verifiers' docker runtime drives one")),
    "subprocess",
])
async def test_bash_harness_runs_in_its_runtime(kafka_settings, prefix, tmp_path, runtime):  # noqa: F811
    """rlt-sum-quiz with verifiers' `bash` harness, through `rollout arena` with the local policy: its chat program
    runs in the seat's runtime and streams its model calls through verifiers' interception server to the capture
    endpoint; they are the rollouts' Steps. In `docker` on verifiers' default image, which runs as the locally
    built rollout-log/vf-harness:local (harness-image/build-image.sh), each episode in its own container; in
    `subprocess` under uv on this machine. The tiny local policy makes no tool call, so each episode is one model
    call (the bash harness's system prompt, its tools offered), then its reward."""
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix,
           "ROLLOUT_LOG_LEVEL": "WARNING"}
    since = time.time() - 1
    started = time.monotonic()
    out = await asyncio.to_thread(_cli, "arena", str(_recipe(tmp_path, runtime, quiz(harness="bash",
                                  runtime=runtime))), "--groups", "1", "--policy", "local", "--policy-port",
                                  "0", "--no-progress", env=env)
    wall = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["rollouts"] == 2 and stats["failed"] == 0, stats
    kw = kafka_settings.client_kwargs()
    rollouts = [codec.decode(r.value) for r in await read_all(kw, topics.ROLLOUTS.name, idle_s=2, timeout_s=30)]
    assert len(rollouts) == 2 and all(r.status == "completed" for r in rollouts)
    steps = [codec.decode(s.value) for s in await read_all(kw, topics.STEPS.name, idle_s=2, timeout_s=30)]
    assert len(steps) == sum(len(r.step_ids) for r in rollouts) >= 2
    for s in steps:  # the bash harness's program made the call: its system prompt
        assert s.member_id == "policy" and s.trainable and len(s.completion_token_ids)
        assert "You are a coding agent. You have access to a bash tool" in s.prompt[0].content, s.prompt[0]
    print(f"runtime {runtime}: 2 episodes, `rollout arena` wall time {wall:.1f} s")
    if runtime != "docker":
        return
    assert "runs 'rollout-log/vf-harness:local' in place of verifiers' default image 'python:3.11-slim'" in out.stderr
    # the engine's record: the episodes' containers (vf-<uuid>, one each) started from the local image during the run
    events = subprocess.run(["docker", "events", "--since", f"{since:.0f}", "--until", f"{time.time() + 1:.0f}",
                             "--filter", "type=container", "--filter", "event=start", "--filter",
                             "image=rollout-log/vf-harness:local", "--filter", "label=verifiers.run",
                             "--format", "{{.Actor.Attributes.name}}"], capture_output=True, text=True, timeout=60)
    episodes = [n for n in events.stdout.split() if n.startswith("vf-")]
    assert len(episodes) >= 2, events.stdout + events.stderr  # (>=: another run on this engine may overlap)


def test_endless_eval_source_needs_a_bound(tmp_path, capsys):
    text = quiz() + """
[[orchestrator.eval.source]]
name = "duel-eval"

[orchestrator.eval.source.env.taskset]
id = "rlt-tally-duel"
"""
    assert "evaluation source 'duel-eval': its taskset never ends" in \
        _arena_error(capsys, _recipe(tmp_path, "eval", text), "--evaluate")


# -- a reward function that raises: the rollout is kept, the verifier dead-letters it with the reason ----------

@pytest.mark.integration
async def test_raising_reward_is_dead_lettered_with_its_reason(kafka_settings, prefix, tmp_path):  # noqa: F811
    from consumers import settings as service_settings
    from consumers.runner import System
    from schemas.events import DeadLetter

    path = _recipe(tmp_path, "bug", quiz(args="reward_bug = true"))
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    out = await asyncio.to_thread(_cli, "arena", str(path), "--groups", "1", "--policy", "local", "--policy-port",
                                  "0", "--no-progress", env=env)
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
    from producers.environments.loader import environment_from_spec

    return environment_from_spec(compile_plan(RECIPES / "rlt-tally-duel.toml").environments[0])


def test_endless_taskset_draws_are_seeded_and_memory_is_bounded():
    from producers.environments.dataset import TaskStream

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


# -- the whole loop from a recipe: `rollout rl` -------------------------------------------------------------

def _rl(recipe: Path, env: dict[str, str], *extra: str, logs: Path, timeout: float = 1400) -> dict:
    """`rollout rl` with its output in ``logs`` (stdout, stderr): a run that hangs shows where it stopped."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout", "w") as o, open(logs / "stderr", "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "rl", "@", str(recipe), "--no-progress", *extra],
                                cwd=ROOT, env=env, stdout=o, stderr=e)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    out, err = (logs / "stdout").read_text(), (logs / "stderr").read_text()
    assert rc == 0, f"rc {rc} (None: still running after {timeout:.0f}s)\n" + out[-3000:] + err[-6000:]
    print(out[-2500:])
    return json.loads(out.strip().splitlines()[-1])


def _replay_and_audit(summary: dict, env: dict[str, str], db: Path):
    import duckdb

    for cmd in (["replay", "--db", str(db), "--run", summary["run"]], ["audit", "--db", str(db), "--format", "json"]):
        res = _cli(*cmd, env=env, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(res.stdout), duckdb.connect(str(db), read_only=True)


@pytest.mark.integration
@pytest.mark.timeout(1500)  # a CPU without fast bf16 kernels trains and serves in float32: slower steps
def test_recipe_whole_loop_on_vllm(kafka_bootstrap, vllm_server, tmp_path):
    """rlt-sum-quiz's recipe, unchanged, through `rollout rl` on real vLLM with SmolLM2 (the recipe's own model,
    served as is): at least 3 trained revisions, each loaded into vLLM and evaluated on the package's test split."""
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    s = _rl(RECIPES / "rlt-sum-quiz.toml", env, "--max-steps", "3", "--vllm-url", vllm_server.base_url,
            "--cores", "turns", logs=tmp_path / "rl")  # the fixture's server shares this machine's cores
    assert s["family"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and s["served_model"] is None
    # max_steps 3: exactly 3 revisions; the arena admitted until r3 was published, at least 3 batches' worth
    assert s["revisions"] == 3 and s["rollouts"] == s["scored"]
    # nothing lost: every rollout's step is in a batch, refused as stale or as generated past the run's last
    # revision, or its rollout is recorded failed with the reason (one of 288 failed here once with a verifiers
    # ProviderError between its interception server and the capture endpoint; the reasons are checked in replay)
    stale = sum(n for k, n in s["dead_letter_reasons"].items() if k.endswith(": StaleRecordError"))
    late = s["dead_letter_reasons"].get("trainer: RunComplete", 0)  # batched, then refused by the trainer
    assert s["records_in_batches"] + stale + s["failed_rollouts"] == s["rollouts"]
    assert s["dead_letters"] == stale + late
    # one record a rollout: the arena admits no more than the 3 batches the run trains (it generated 12 before)
    assert s["rollouts"] == 3 * 32
    # every batched record was trained by one of the 3 revisions or refused as past the run's end. Refused ones
    # come from a batch flushed partial: a failed rollout's, or no record for flush_after_s (10 s) while vLLM
    # answers the evaluation beside them (seen once on a float32 CPU, when the oldest record's wait decided it)
    trained = sum(m["records"] for m in s["trainer_metrics_by_revision"].values())
    assert len(s["trainer_metrics_by_revision"]) == 3 and trained + late == s["records_in_batches"]
    # the eval source (split "test", num_examples 48, interval 1): every revision answers the 48 questions
    assert [int(k) for k in s["eval_accuracy_by_revision"]][:4] == [0, 1, 2, 3]
    assert set(s["eval_questions_by_revision"].values()) == {48}
    report, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
    assert report["checked"]["chain_links"] == s["revisions"]
    assert con.execute("SELECT count(*) FROM rollouts WHERE status = 'failed' AND failure_reason IS NULL"
                       ).fetchone()[0] == 0
    envs = {r[0] for r in con.execute("SELECT DISTINCT environment FROM rollouts").fetchall()}
    assert envs == {"rlt-sum-quiz@0.1.0", "rlt-sum-quiz-test@0.1.0"}


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_a_lora_recipe_trains_its_adapter_on_vllm_and_leaves_the_base(kafka_bootstrap, tmp_path):
    """The LoRA example recipe (rank 16, alpha 32, prime-rl's default target modules) through `rollout rl`, which
    starts vLLM with LoRA enabled: exactly 2 revisions, each its adapter alone (a PEFT folder naming revision 0 as
    its base, by digest), loaded into vLLM with ``/v1/load_lora_adapter`` under prime-rl's adapter name and answered
    under it. The adapter moved (B away from zero at r1, r2 not r1); the base did not: revision 0 is the only whole
    weights of the run, the packaged model's, bit for bit, and each revision's adapter applies to it."""
    import torch

    from policy import hf, lora
    from schemas.policy import CheckpointRef

    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    text = (ROOT / "examples" / "plans" / "arithmetic-smollm2-lora.toml").read_text()
    # 1-digit sums only (40 of the 100 to train on): the model gets ~64% right, so every group holds a signal
    one_digit = {"digits = [1, 2]": "digits = [1]", "num_examples = 2000": "num_examples = 40"}
    for old, new in one_digit.items():
        assert old in text
        text = text.replace(old, new)
    s = _rl(_recipe(tmp_path, "lora", text), env, "--max-steps", "2", logs=tmp_path / "rl")
    assert s["revisions"] == 2 and s["failed_rollouts"] == 0, s["failure_reasons"]
    assert s["dead_letters"] == s["dead_letter_reasons"].get("trainer: RunComplete", 0)
    assert [int(k) for k in s["eval_accuracy_by_revision"]] == [0, 2]  # the recipe's interval 8, and the last
    _, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
    refs = {r: CheckpointRef(uri=u, digest=d) for r, u, d in con.execute(
        "SELECT revision, checkpoint_uri, checkpoint_digest FROM policy_revisions").fetchall()}
    assert sorted(refs) == [0, 1, 2] and refs[0] == hf.prepare_model().checkpoint  # the packaged weights
    assert not refs[0].adapter and refs[1].adapter and refs[2].adapter
    for r in (1, 2):
        assert lora.base_of(refs[r]) == refs[0]  # the adapter's digest covers the base it names: revision 0
        config = json.loads((hf.checkpoint_folder(refs[r]) / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["target_modules"]) == (16, 32.0, sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    r1, r2 = (hf.load_weights(refs[r]) for r in (1, 2))
    assert r1.keys() == r2.keys() and len(r1) == 2 * 7 * 30  # A and B, 7 projections, SmolLM2's 30 layers
    assert all(k.startswith("base_model.model.model.layers.") for k in r1)  # peft's names
    b1 = [v for k, v in r1.items() if ".lora_B." in k]
    assert all(bool(v.abs().sum() > 0) for v in b1), "B still zero at r1: the adapter did not train"
    assert sum(not torch.equal(r1[k], r2[k]) for k in r1) >= len(r1) // 2, "the adapter did not move from r1 to r2"
    # no whole weights were written by the run: every checkpoint of it is an adapter folder
    checkpoints = hf.checkpoint_folder(refs[1]).parent  # the run's folder: its checkpoints, vLLM's log beside them
    folders = [p for p in checkpoints.iterdir() if p.is_dir() and not p.name.endswith(".train")]
    assert len(folders) == 2 and all(not (p / hf.WEIGHTS).exists() for p in folders)
    log = (checkpoints.parent / "vllm.log").read_text()
    assert log.count("Loaded new LoRA adapter: name 'r16-a32.0'") >= 1
    print({r: (m.get("mismatch_mean"), m.get("step_s")) for r, m in s["trainer_metrics_by_revision"].items()},
          s["reload_s"], s["arena"])


@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_a_tool_recipe_trains_the_models_tokens_and_none_of_the_tools(kafka_bootstrap, tmp_path):
    """rlt-word-lookup's recipe through `rollout rl`, which starts vLLM with the recipe's tool-call parser and chat
    template: its seat runs verifiers' own chat program with the package's MCP toolset (streamed calls through the
    capture endpoint). Exactly 2 revisions; every Step's prompt holds the tool call and the tool's answer as the
    server rendered them (token ids); each training record is its Step's tokens, the mask covers the completion
    only, so no token the tool returned is ever trained."""
    from transformers import AutoTokenizer

    from policy.hf import prepare_model
    from rlt_word_lookup import secret

    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    s = _rl(RECIPES / "rlt-word-lookup.toml", env, "--max-steps", "2", logs=tmp_path / "rl")
    assert s["revisions"] == 2 and s["failed_rollouts"] == 0, s
    _, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
    tok = AutoTokenizer.from_pretrained(prepare_model().path)
    steps = con.execute("SELECT step_id, prompt, tool_calls, prompt_token_ids, completion_token_ids FROM steps"
                        ).fetchall()
    assert steps
    by_id = {}
    for step_id, prompt, tool_calls, prompt_ids, completion_ids in steps:
        messages = json.loads(prompt)
        calls = {c["id"] for m in messages for c in m["tool_calls"]}
        tools = [m for m in messages if m["role"] == "tool"]
        assert tools and all(t["tool_call_id"] in calls for t in tools)  # every answer follows its call
        word = json.loads(messages[1]["tool_calls"][0]["arguments"])["word"]  # the task's own exchange
        assert messages[2]["content"] == str(secret(word))
        rendered, said = tok.decode(prompt_ids), tok.decode(completion_ids)
        for t in tools:  # the template's rendering of each tool answer, in the prompt's tokens
            assert f"<tool_response>\n{t['content']}\n</tool_response>" in rendered
        assert '"name": "words_lookup"' in rendered  # the tool offered, in the system turn
        for call in json.loads(tool_calls):  # a call the model made itself is parsed from its own tokens
            assert call["name"] in said
        by_id[step_id] = (prompt_ids, completion_ids)
    records = con.execute("SELECT step_ids, prompt_token_ids, completion_token_ids, loss_mask, n_trained_tokens "
                          "FROM training_records").fetchall()
    assert len(records) >= 8  # 2 batches of 4
    for step_ids, prompt_ids, completion_ids, mask, trained in records:
        assert len(step_ids) == 1 and (prompt_ids, completion_ids) == by_id[step_ids[0]]
        assert len(mask) == len(completion_ids) and sum(mask) == trained <= len(completion_ids)


def _tiny(recipe: str, tmp_path: Path, extra: str = "") -> Path:
    """A package's recipe with the tiny byte-level model as the policy (the fast loop), everything else as written."""
    text = (RECIPES / f"{recipe}.toml").read_text()
    assert 'name = "HuggingFaceTB/SmolLM2-135M-Instruct"' in text
    return _recipe(tmp_path, recipe, text.replace('name = "HuggingFaceTB/SmolLM2-135M-Instruct"',
                                                  'name = "tiny-byte-lm"') + extra)


@pytest.mark.integration
@pytest.mark.parametrize("recipe, members, credit", [
    ("rlt-tally-duel", {"player0", "player1"}, "ema_per_member"),  # two-seat self-play, rae: a baseline per seat
    ("rlt-pose-solve", {"proposer", "solver"}, "grpo"),            # a proposer rewarded by its solvers' outcomes
])
def test_multi_agent_whole_loop(kafka_bootstrap, tmp_path, recipe, members, credit):
    """Each seat is its own member through credit, the batches, the audit and replay's tables."""
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    s = _rl(_tiny(recipe, tmp_path), env, "--max-steps", "2", logs=tmp_path / "rl")
    assert s["arena"]["final_revision_reached"] is True
    assert s["failed_rollouts"] == 0 and s["revisions"] == 2 and s["batches"] >= 2, s  # max_steps: exactly 2
    # the arena counts the records its rollouts yield (both seats' turns, the solvers'): it stops admitting once
    # they fill the 2 batches, so at most one batch's worth is generated past the run's end (refused by the
    # trainer); counted at one record a rollout, the duel generated 16 rollouts, 32 records, 16 refused
    assert s["records_in_batches"] >= 16 and s["records_in_batches"] > s["rollouts"] / 2
    assert s["dead_letter_reasons"].get("trainer: RunComplete", 0) <= 8, s["dead_letter_reasons"]  # batch_size 8
    report, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
    assert report["checked"]["chain_links"] == s["revisions"]
    rows = dict(con.execute("SELECT member_id, count(*) FROM training_records GROUP BY 1").fetchall())
    assert set(rows) == members, rows
    assert {r[0] for r in con.execute("SELECT DISTINCT credit FROM training_records").fetchall()} == {credit}
    in_batches = {r[0] for r in con.execute("SELECT DISTINCT member_id FROM batch_records").fetchall()}
    assert in_batches == members
    by_role = {r[0] for r in con.execute("SELECT DISTINCT role FROM v_reward_by_revision").fetchall()}
    assert by_role == members


@pytest.mark.integration
def test_train_one_against_a_fixed_seat_on_its_own_endpoint(kafka_bootstrap, tmp_path):
    """player1 pinned to its own model and endpoint (a second server): never trained; player0 is the learner."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rollout.cli", "serve", "policy", "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        for _ in range(120):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            import time

            time.sleep(0.5)
        text = _tiny("rlt-tally-duel", tmp_path).read_text()
        pinned = text.replace('[orchestrator.train.source.env.player1.runtime]',
                              f'[orchestrator.train.source.env.player1]\nmodel = "opponent"\n'
                              f'client = {{ type = "eval", base_url = "http://127.0.0.1:{port}/v1" }}\n\n'
                              '[orchestrator.train.source.env.player1.runtime]', 1)
        path = _recipe(tmp_path, "train-one", pinned.split("[orchestrator.eval]")[0])
        plan = compile_plan(path)
        assert plan.environments[0].seats["player1"].trainable is False
        env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
        env.pop("ROLLOUT_TOPIC_PREFIX", None)
        s = _rl(path, env, "--max-steps", "2", logs=tmp_path / "rl")
        # the recipe has no eval source: the arena waits for the last revision, not for an evaluation of it
        assert s["arena"]["final_revision_reached"] is True
        assert s["failed_rollouts"] == 0 and s["revisions"] >= 2, s
        report, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
        steps = dict(con.execute("SELECT member_id, bool_or(trainable) FROM steps GROUP BY 1").fetchall())
        assert steps == {"player0": True, "player1": False}
        targets = dict(con.execute("SELECT DISTINCT member_id, target FROM steps").fetchall())
        assert targets == {"player0": "learner", "player1": "player1"}
        rows = {r[0] for r in con.execute("SELECT DISTINCT member_id FROM training_records").fetchall()}
        assert rows == {"player0"}
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.integration
def test_an_echo_recipe_trains_the_users_later_turns_with_cross_entropy(kafka_bootstrap, tmp_path):
    """prime-rl's echo on rlt-sum-chain (a scripted user over 2-3 turns, found by id), the tiny model as the policy:
    every record of a later turn carries a ce span, exactly the prompt tokens the user's turn added after the
    previous call's prompt and completion (here bytes: they read as the user's words); a first turn's carries
    none; each revision's step reports ce/nll beside the grpo part."""
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    s = _rl(_tiny("rlt-sum-chain", tmp_path), env, "--max-steps", "2", logs=tmp_path / "rl")
    assert s["failed_rollouts"] == 0 and s["revisions"] == 2, s
    assert all(m["ce/nll"] > 0 for m in s["trainer_metrics_by_revision"].values()), s["trainer_metrics_by_revision"]
    report, con = _replay_and_audit(s, env, tmp_path / "run.duckdb")
    assert report["ok"], report
    rows = con.execute("""
        SELECT s.step_index, r.ce_spans, r.n_ce_tokens, r.prompt_token_ids, p.prompt_token_ids, p.completion_token_ids
        FROM training_records r JOIN steps s ON s.step_id = r.step_ids[1]
        LEFT JOIN steps p ON p.rollout_id = s.rollout_id AND p.step_index = s.step_index - 1""").fetchall()
    later = [r for r in rows if r[0] > 0]
    assert later and all(r[1] is None and r[2] == 0 for r in rows if r[0] == 0)
    for index, spans, n, prompt, prev_prompt, prev_completion in later:
        (start, end, weight), = json.loads(spans)
        assert (end, weight, n) == (len(prompt), 0.1, end - start)
        assert prompt[:start] == (prev_prompt + prev_completion)[:start] and start >= len(prev_prompt)
        assert "Now add" in bytes(t for t in prompt[start:end] if t < 256).decode(errors="replace")  # specials: roles
